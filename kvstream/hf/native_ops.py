"""The decoder's RMSNorm and rotary embedding on CPU in one native call each (``native_ops.cpp``).

Why it exists: at decode sizes a step's small elementwise ops cost their dispatch, not their
arithmetic. transformers' RMSNorm is seven torch ops (30-45 us a call here) and its rotary
embedding eleven (~50 us); a decoder layer runs two norms and one rotary per step, ~3 ms of
SmolLM2's 30 ms AWQ decode step. One native call costs a few microseconds.

``install`` does two things to the model it is given, as ``native_linear.install`` does to
its linear layers, and only where a check on the model's own shapes passes:

- RMSNorm modules (a float32 ``weight`` and a ``variance_epsilon``, transformers' Llama-style
  norm) get a subclass of their own class whose forward calls the kernel: same objects and
  parameters. Checked against the module's own forward (1e-6 relative: the kernel sums the
  squares in another order than torch's ``mean``); a norm of another formula (Gemma's
  ``1 + weight``) fails the check and is left alone.
- The ``apply_rotary_pos_emb`` of the attention modules' modeling module (transformers looks
  it up there on every call) is wrapped: float32 CPU calls in the standard form go to the
  kernel, anything else to the original. Only where the kernel gives the original's result
  bit for bit on the model's head size (it rounds every product and sum as torch's ops do), so
  the wrapper is invisible to any other model of that family in the process.

Both are taken unless the matmul backend is ``torch`` (``RunnerConfig.matmul``), which gives
the model its own ops back.
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn

from kvstream.hf import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_ops.cpp")


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """The compiled kernels and how they were built, or None and why not."""
    return native_build.load_extension("kvstream_native_ops", SOURCE, extra_flags=("-ffp-contract=off",))


@dataclass
class NativeOpsChoice:
    """What runs the decoder's norms and rotary embedding, and why not the kernels."""

    norms: int = 0  # RMSNorm modules switched to the kernel
    rotary: list[str] = field(default_factory=list)  # modeling modules whose rotary is wrapped
    why_not: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"rms_norm_modules": self.norms, "rotary_wrapped": self.rotary, "why_not": self.why_not}


# ------------------------------------------------------------------------------- RMSNorm
def _native_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if (
        hidden_states.dtype != torch.float32 or weight.dtype != torch.float32
        or hidden_states.device.type != "cpu" or weight.device.type != "cpu"
        or (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
    ):
        return super(type(self), self).forward(hidden_states)
    module, _ = load()
    return module.rms_norm(hidden_states, weight, self.variance_epsilon)


@functools.cache
def _native_norm_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with its forward on the kernel (one subclass per norm class)."""
    return type(f"Native{cls.__name__}", (cls,), {"forward": _native_norm_forward, "_kvstream_native": True})


def _norms(model: nn.Module) -> list[nn.Module]:
    """The model's Llama-style RMSNorm modules, switched or not."""
    return [
        m for m in model.modules()
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")
        and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1
    ]


def _original_class(module: nn.Module) -> type[nn.Module]:
    cls = type(module)
    return cls.__bases__[0] if getattr(cls, "_kvstream_native", False) else cls


def _norm_disagreement(kernels: ModuleType, norm: nn.Module) -> float:
    """Largest difference between the kernel and the module's own forward, relative to the
    largest output, on 1 and 5 random rows."""
    generator = torch.Generator().manual_seed(0)
    original = _original_class(norm).forward
    worst = 0.0
    with torch.inference_mode():
        for rows in (1, 5):
            x = torch.randn(rows, norm.weight.numel(), generator=generator)
            want = original(norm, x)
            got = kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    return worst


def _switch_norms(norms: list[nn.Module], native: bool) -> None:
    for norm in norms:
        original = _original_class(norm)
        norm.__class__ = _native_norm_class(original) if native else original


# ------------------------------------------------------------------------------- rotary
def _wrap_rotary(original: Callable) -> Callable:
    """``original`` (transformers' ``apply_rotary_pos_emb``) with its standard float32 CPU calls
    on the kernel."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (
            not args and not kwargs
            and q.dtype == k.dtype == cos.dtype == sin.dtype == torch.float32
            and q.device.type == "cpu" and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3
            and q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
            and cos.shape == sin.shape and q.shape[2:] == k.shape[2:] == cos.shape[1:] and q.shape[-1] % 2 == 0
            and q.shape[0] == k.shape[0] and cos.shape[0] in (1, q.shape[0])
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
        ):
            q_embed, k_embed = load()[0].rotary(q, k, cos, sin)
            return q_embed, k_embed
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._kvstream_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def _rotary_modules(model: nn.Module) -> list[ModuleType]:
    """The modeling modules of the model's attention layers that define ``apply_rotary_pos_emb``."""
    found: dict[str, ModuleType] = {}
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "head_dim"):
            source = sys.modules.get(type(m).__module__)
            if source is not None and callable(getattr(source, "apply_rotary_pos_emb", None)):
                found[source.__name__] = source
    return list(found.values())


def _rotary_agrees(kernels: ModuleType, original: Callable, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel gives ``original``'s result bit for bit, on the layouts a forward
    passes (q / k transposed views of a projection's output, cos / sin per token)."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        try:
            return all(_rotary_agrees_on(kernels, original, heads, kv_heads, head_dim, tokens, generator) for tokens in (1, 7))
        except (TypeError, ValueError, RuntimeError):  # another signature or shape rule: not the standard form
            return False


def _rotary_agrees_on(kernels: ModuleType, original: Callable, heads: int, kv_heads: int, head_dim: int, tokens: int,
                      generator: torch.Generator) -> bool:
    q = torch.randn(1, tokens, heads, head_dim, generator=generator).transpose(1, 2)
    k = torch.randn(1, tokens, kv_heads, head_dim, generator=generator).transpose(1, 2)
    angles = torch.randn(1, tokens, head_dim // 2, generator=generator) * 10
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    want = original(q, k, cos, sin)
    got = kernels.rotary(q, k, cos, sin)
    return torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def _wrap_rotaries(model: nn.Module, kernels: ModuleType, why_not: dict[str, str]) -> list[str]:
    sources = _rotary_modules(model)
    config = getattr(model, "config", None)
    if not sources or config is None:
        return []
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    wrapped = []
    for source in sources:
        current = source.apply_rotary_pos_emb
        original = getattr(current, "_kvstream_original", current)
        if _rotary_agrees(kernels, original, heads, kv_heads, head_dim):
            if current is original:
                source.apply_rotary_pos_emb = _wrap_rotary(original)
            wrapped.append(source.__name__)
        else:
            why_not[f"rotary:{source.__name__}"] = "its apply_rotary_pos_emb is not the standard rotate_half form"
    return wrapped


def _unwrap_rotaries(model: nn.Module) -> None:
    for source in _rotary_modules(model):
        source.apply_rotary_pos_emb = getattr(source.apply_rotary_pos_emb, "_kvstream_original", source.apply_rotary_pos_emb)


def install(model: nn.Module, native: bool) -> NativeOpsChoice:
    """Put ``model``'s RMSNorm modules and rotary embedding on the kernels where they agree
    (``native``), or give them back their own ops (not ``native``; the rotary for the whole
    process, as it was wrapped)."""
    choice = NativeOpsChoice()
    norms = _norms(model)
    if not native:
        _switch_norms(norms, False)
        _unwrap_rotaries(model)
        choice.why_not["native"] = "not requested (matmul backend torch)"
        return choice
    kernels, how = load()
    if kernels is None:
        _switch_norms(norms, False)
        choice.why_not["native"] = f"not built: {how}"
        return choice
    eligible = [n for n in norms if n.weight.dtype == torch.float32 and n.weight.device.type == "cpu"]
    for cls, norm in {_original_class(n): n for n in eligible}.items():  # one check per norm class
        try:
            error = _norm_disagreement(kernels, norm)
            why = f"disagrees with the module's own forward by {error:.2e} (relative)" if error > 1e-6 else None
        except (TypeError, ValueError, RuntimeError) as exc:  # a forward of another signature or shape rule
            why = f"its forward cannot be checked: {type(exc).__name__}"
        if why is not None:
            choice.why_not[f"rms_norm:{cls.__name__}"] = why
            eligible = [n for n in eligible if _original_class(n) is not cls]
    _switch_norms([n for n in norms if n not in eligible], False)
    _switch_norms(eligible, True)
    choice.norms = len(eligible)
    first = next(model.parameters(), None)
    if first is not None and first.dtype == torch.float32 and first.device.type == "cpu":
        choice.rotary = _wrap_rotaries(model, kernels, choice.why_not)
    logger.info("native ops: %d RMSNorm modules, rotary in %s", choice.norms, ", ".join(choice.rotary) or "none")
    return choice
