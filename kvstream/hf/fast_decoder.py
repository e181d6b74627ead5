"""A Llama-family decoder layer's engine step as direct kernel calls, without transformers'
per-call Python.

Why it exists: at decode sizes a layer's Python costs about as much as its matmuls. A
decoder layer of transformers is four module calls deep (layer, attention, MLP, projection),
and each projection's ``forward`` re-decides per call what the engine settled at start (the
kernel, the dtype, the row limit); with the native kernels that Python was a quarter of an
AWQ decode step: 96 layers, 41 -> 31 ms a token (prototype, same tokens).

``install`` gives each eligible decoder layer a subclass of its own class (same object,
modules and parameters; the class swap native_ops.py does for norms) whose ``forward``, on
the engine's own steps (a call that carries ``kvstream_plan``), runs the layer as: the input
RMSNorm kernel, the Q / K / V projections' kernels, the rotary kernel, ``paged_attention``,
the O projection, a residual add, the post-attention norm, gate / up, the activation times
up, down, a residual add: the same kernels on the same inputs in the same order as the module tree, so
the result is bit for bit the same. Each projection's kernel call comes from its own class
(``direct_call()``: ``AWQLinear``, ``NativeLinear``, ``HalfLinear``), the choices its forward
makes per call made once; any other module is called as a module. Q / K / V, and gate / up,
share one call where their class fuses projections of one input (``AWQLinear.fused_call``:
one kernel call, each output bit for bit its own). Any other call (no plan, a Cache,
gradients) runs transformers' forward.

Eligible: a layer with exactly transformers' Llama structure (``self_attn`` of q/k/v/o
projections, an MLP of gate/up/down and an activation, two norms; Mistral, Qwen2 and SmolLM2
share it; Qwen3's q/k norms or Gemma's extra norms do not), CPU, float32, no hooks on its
submodules (the direct calls do not run them; hooks on the layer itself still run). Then the
probe decides: the engine's own steps (prefills, decodes, a mixed step) on a scratch pool,
with and without, must give bit-identical logits; otherwise nothing is switched and
``/status`` says why (``decoder``). Off with the ``torch`` matmul backend, as the other
native kernels are.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvstream.hf import compat, native_ops
from kvstream.hf.attention import AttentionPlan, paged_attention
from kvstream.hf.kv_cache import KVShape, PagedKVCache

logger = logging.getLogger(__name__)

ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}
LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}

Kernel = Callable[[torch.Tensor], torch.Tensor]
Projections = Callable[[torch.Tensor], list[torch.Tensor]]  # several projections of one input


@dataclass
class DecoderChoice:
    """Which decoder layers run the direct path, and why not where they do not."""

    layers: int = 0
    why_not: str | None = None

    def summary(self) -> dict[str, Any]:
        return {"fast_layers": self.layers, "why_not": self.why_not}


@dataclass(frozen=True)
class LayerKernels:
    """One layer's calls, resolved at install (the layer's own modules' kernels)."""

    input_norm: Kernel
    qkv: Projections  # Q, K and V of the normed input
    o: Kernel
    post_norm: Kernel
    gate_up: Projections  # gate and up of the normed input
    act: Kernel
    down: Kernel
    rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    head_dim: int
    scaling: float


def _fast_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any) -> torch.Tensor:
    plan: AttentionPlan | None = kwargs.get("kvstream_plan")
    if (plan is None or position_embeddings is None or torch.is_grad_enabled()
            or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None):
        return _original_class(self).forward(
            self, hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings, **kwargs)
    run: LayerKernels = self._kvstream_kernels
    x = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, hidden]: the packed row
    tokens = x.shape[0]
    # The layouts transformers' attention passes on: [1, heads, T, head_dim] views.
    q, k, v = (y.view(1, tokens, -1, run.head_dim).transpose(1, 2) for y in run.qkv(run.input_norm(x)))
    cos, sin = position_embeddings
    q, k = run.rotary(q, k, cos, sin)
    attended, _ = paged_attention(self.self_attn, q, k, v, None, run.scaling, kvstream_plan=plan)
    x = x + run.o(attended.reshape(tokens, -1))
    gate, up = run.gate_up(run.post_norm(x))
    x = x + run.down(run.act(gate) * up)
    return x.view(hidden_states.shape)


@functools.cache
def _fast_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with the direct forward (one subclass per decoder layer class)."""
    return type(f"Fast{cls.__name__}", (cls,), {"forward": _fast_forward, "_kvstream_fast": True})


def _original_class(layer: nn.Module) -> type[nn.Module]:
    cls = type(layer)
    return cls.__bases__[0] if getattr(cls, "_kvstream_fast", False) else cls


def switch(layers: list[nn.Module], fast: bool) -> None:
    """Put ``layers`` on the direct forward (``fast``; ``install`` must have resolved their
    kernels) or back on their own class's; benchmarks and tests compare the two this way."""
    for layer in layers:
        original = _original_class(layer)
        layer.__class__ = _fast_class(original) if fast else original


def _children(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_children()}


def _has_hooks(module: nn.Module) -> bool:
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None)
        for m in module.modules() if m is not module
    )


def _module_call(module: nn.Module) -> Kernel:
    """The module's own direct kernel call where its class offers one, else the module."""
    direct = getattr(module, "direct_call", None)
    return direct() if callable(direct) else module


def projections_call(modules: list[nn.Module], fuse: bool = True) -> Projections:
    """Several projections of one input: one call where their class can fuse them
    (``AWQLinear.fused_call``: one kernel call for all) and ``fuse``, else each module's own
    call (benchmarks/fast_decoder.py compares the two)."""
    fuser = getattr(type(modules[0]), "fused_call", None)
    fused = fuser(modules) if fuse and callable(fuser) and all(type(m) is type(modules[0]) for m in modules) else None
    if fused is not None:
        return fused
    calls = [_module_call(m) for m in modules]
    return lambda x: [call(x) for call in calls]


def _norm_call(norm: nn.Module, kernels: Any) -> Kernel:
    if getattr(type(norm), "_kvstream_native", False):  # native_ops switched it to the kernel
        weight, eps = norm.weight, norm.variance_epsilon
        return lambda x: kernels.rms_norm(x, weight, eps)
    return norm


def _activation_call(act: nn.Module) -> Kernel:
    """SiLU as the function its module's forward calls (transformers' ``SiLUActivation`` or
    torch's ``nn.SiLU``); any other activation as its module."""
    if type(act) is nn.SiLU or type(act).__name__ == "SiLUActivation":
        return F.silu
    return act


def _rotary_call(attention: nn.Module, kernels: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """What the attention module's forward calls for the rotary embedding (transformers looks
    ``apply_rotary_pos_emb`` up in its modeling module): the kernel where native_ops wrapped it."""
    function = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb")
    return kernels.rotary if hasattr(function, "_kvstream_original") else function


def _why_not_eligible(layer: nn.Module) -> str | None:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if _children(layer) != LAYER_CHILDREN or attention is None or mlp is None:
        return f"{type(layer).__name__} is not a Llama-style decoder layer"
    if _children(attention) != ATTENTION_CHILDREN or not hasattr(attention, "head_dim") or not hasattr(attention, "scaling"):
        return f"{type(attention).__name__} is not Llama-style attention (other submodules)"
    if _children(mlp) != MLP_CHILDREN:
        return f"{type(mlp).__name__} is not a gated MLP (gate/up/down and an activation)"
    if _has_hooks(layer):
        return "hooks on a decoder layer's submodules (the direct path would not run them)"
    return None


def _kernels_for(layer: nn.Module, kernels: Any) -> LayerKernels:
    attention, mlp = layer.self_attn, layer.mlp
    return LayerKernels(
        input_norm=_norm_call(layer.input_layernorm, kernels),
        qkv=projections_call([attention.q_proj, attention.k_proj, attention.v_proj]),
        o=_module_call(attention.o_proj),
        post_norm=_norm_call(layer.post_attention_layernorm, kernels),
        gate_up=projections_call([mlp.gate_proj, mlp.up_proj]),
        act=_activation_call(mlp.act_fn), down=_module_call(mlp.down_proj),
        rotary=_rotary_call(attention, kernels),
        head_dim=attention.head_dim,
        scaling=attention.scaling,
    )


PlanMaker = Callable[[PagedKVCache, list[tuple[list[int], int, int]]], AttentionPlan]


def probe_steps(block_size: int) -> list[list[tuple[int, int]]]:
    """Per probe step, per sequence (tokens in the pool, new tokens): two prompts, a decode
    step, and a decode beside a short chunk; contexts crossing a block boundary."""
    first = block_size + 2
    return [[(0, first), (0, 3)], [(first, 1), (3, 1)], [(first + 1, 1), (4, 2)]]


def _disagreement(model: nn.Module, layers: list[nn.Module], shape: KVShape, dtype: torch.dtype, block_size: int,
                  make_plan: PlanMaker) -> str | None:
    """Run the probe steps on a scratch pool, transformers' forward then the direct one, each
    step's logits compared bit for bit; None when every step agrees, else which did not."""
    steps = probe_steps(block_size)
    blocks = -(-max(c + n for step in steps for c, n in step) // block_size)
    sequences = len(steps[0])
    cache = PagedKVCache(shape, blocks * sequences, block_size, 0, dtype, torch.device("cpu"))
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(sequences)]
    vocab = model.config.vocab_size
    with torch.inference_mode():
        for number, step in enumerate(steps):
            ids, positions, rows = [], [], []
            for s, (cached, new) in enumerate(step):
                ids += [(7919 * (s + 1) * (p + 1)) % vocab for p in range(cached, cached + new)]
                positions += range(cached, cached + new)
                rows.append(len(ids) - 1)
            args = (torch.tensor([ids]), torch.tensor([positions]))
            seqs = [(tables[s], cached, new) for s, (cached, new) in enumerate(step)]
            results = []
            for fast in (False, True):  # both write the same K/V before reading them back
                switch(layers, fast)
                results.append(compat.forward_logits(model, *args, make_plan(cache, seqs), torch.tensor(rows)))
            switch(layers, False)
            if not torch.equal(results[0], results[1]):
                error = float((results[0] - results[1]).abs().max())
                return f"differs from transformers' forward on probe step {number + 1} (by {error:.2g})"
    return None


def install(model: nn.Module, enabled: bool, shape: KVShape, kv_dtype: torch.dtype, block_size: int,
            make_plan: PlanMaker) -> DecoderChoice:
    """Switch ``model``'s decoder layers to the direct path where eligible and the probe
    agrees (``enabled``), or back to transformers' forward (not ``enabled``). ``make_plan``
    builds a step's AttentionPlan as the engine does (its tier); ``shape``, ``kv_dtype`` and
    ``block_size``: the engine's pool, which the probe copies at a few blocks' size."""
    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", None) or [])
    switch(layers, False)
    if not enabled:
        return DecoderChoice(why_not="not requested (matmul backend torch)")
    if not layers:
        return DecoderChoice(why_not="no decoder layers found (model.model.layers)")
    first = next(model.parameters())
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return DecoderChoice(why_not="CPU float32 models only (the native kernels')")
    kernels, how = native_ops.load()
    if kernels is None:
        return DecoderChoice(why_not=f"native ops not built: {how}")
    for layer in layers:
        why = _why_not_eligible(layer)
        if why is not None:
            return DecoderChoice(why_not=why)
    for layer in layers:
        vars(layer)["_kvstream_kernels"] = _kernels_for(layer, kernels)  # a plain attribute, not a submodule
    try:
        why = _disagreement(model, layers, shape, kv_dtype, block_size, make_plan)
    except Exception as exc:  # noqa: BLE001 - a forward of another signature fails in many ways
        switch(layers, False)
        why = f"failed on the probe: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
    if why is not None:
        logger.warning("decoder layers keep transformers' forward: %s", why)
        return DecoderChoice(why_not=why)
    switch(layers, True)
    logger.info("decoder: %d layers on the direct path", len(layers))
    return DecoderChoice(layers=len(layers))
