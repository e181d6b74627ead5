"""Token embeddings and LM head kept in the checkpoint's half precision under a float32 model.

Why: once an AWQ checkpoint has packed the decoder's projections into 4 bits, most of what is
left is the token embedding matrix, which small models tie to the LM head (SmolLM2-135M:
49152 x 576, 57 MB in float16, 113 MB upcast). Upcasting it at load doubles those resident
bytes and the bytes the head reads at every decode step, where it is memory-bound. Kept as
stored, the embedding lookup widens only the rows it gathers, and the head is a
``native_linear.HalfLinear``, whose kernel widens each weight to float32 in registers: exact
for float16 and bfloat16, so the products are those of the upcast matrix (only the summation
order is the kernel's, as for every ``NativeLinear``).

The same holds for a dense checkpoint stored in bfloat16 or float16 (most HF checkpoints),
which a CPU engine computes in float32: ``compact`` puts every linear layer and the
embeddings whose float32 values are exactly half values back into half storage after
loading, so the model holds and reads half the bytes (a decode step is memory-bound) and
computes exactly what the upcast model computes at decode.

The weight is a buffer, not a parameter: the engine and transformers take the model's dtype
from its first parameter, and it must stay the activations' float32. Callers decide at load
and say why not when it cannot (no kernel, or it disagrees with the upcast product).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvstream.hf import native_linear
from kvstream.hf.native_linear import HalfLinear

HALF_DTYPES = (torch.float16, torch.bfloat16)


class HalfEmbedding(nn.Module):
    """``nn.Embedding`` over a half-precision table, returning ``dtype`` rows."""

    def __init__(self, weight: torch.Tensor, padding_idx: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx, self.dtype = padding_idx, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, stored {self.weight.dtype}"


def why_not_half(weight_dtype: torch.dtype, dtype: torch.dtype) -> str | None:
    """Why a table stored as ``weight_dtype`` cannot stay so under a ``dtype`` model; None if it can."""
    if weight_dtype not in HALF_DTYPES:
        return f"stored as {weight_dtype}"
    if dtype != torch.float32:
        return f"the model computes in {dtype}"
    module, how = native_linear.load()
    if module is None:
        return f"the native kernel is not built: {how}"
    return None


def disagreement(weight: torch.Tensor) -> float:
    """How far the kernel is from the upcast product on ``weight`` (relative)."""
    module, _ = native_linear.load()
    return native_linear.disagreement(module, weight)


@dataclass
class Compaction:
    """What ``compact`` kept in half precision, for /status."""

    dtype: str | None = None  # "bfloat16" / "float16" (both: "bfloat16+float16"), None when nothing was
    linear_layers: int = 0
    embeddings: bool = False
    saved_bytes: int = 0
    why_not: str | None = None

    def describe(self) -> str:
        if self.dtype is None:
            return f"float32 (upcast: {self.why_not})"
        parts = [f"{self.linear_layers} linear layers"] + (["the embeddings"] if self.embeddings else [])
        return f"{self.dtype} as stored: {' and '.join(parts)} ({self.saved_bytes / 2**20:.0f} MiB saved)"


# Values checked before a whole tensor is converted: a float32 model (most are not half
# values) is turned down after a few thousand values per layer, not a copy of each.
SAMPLE = 4096


def exact_half(weight: torch.Tensor, order: tuple[torch.dtype, ...]) -> torch.Tensor | None:
    """``weight`` in the first half dtype of ``order`` that holds every value exactly, or None."""
    sample = weight.reshape(-1)[:SAMPLE]
    for half in order:
        if not torch.equal(sample.to(half).to(weight.dtype), sample):
            continue
        narrow = weight.to(half)
        if torch.equal(narrow.to(weight.dtype), weight):
            return narrow
    return None


def compact(model: nn.Module) -> Compaction:
    """Put ``model``'s float32 CPU ``nn.Linear`` layers and input embeddings whose values are
    exactly bfloat16 or float16 (any exact form computes the same products) back into half
    storage, as ``HalfLinear`` / ``HalfEmbedding`` modules in their place (a head tied to the
    embeddings keeps sharing one table). Layers with any value a half dtype cannot hold stay
    as they are. Returns what was done."""
    kernel, how = native_linear.load()
    if kernel is None:
        return Compaction(why_not=f"the native kernel is not built: {how}")
    order = (torch.bfloat16, torch.float16)
    names = {id(m): n for n, m in model.named_modules()}
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    narrowed: dict[int, torch.Tensor] = {}  # id(float32 weight) -> its half copy (tied weights once)

    def narrow(weight: torch.Tensor) -> torch.Tensor | None:
        if id(weight) not in narrowed:
            if id(weight) in shared or weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
                return None
            half = exact_half(weight.detach(), order)
            if half is None:
                return None
            narrowed[id(weight)] = half
        return narrowed[id(weight)]

    done = Compaction()
    targets = [m for m in model.modules() if type(m) is nn.Linear or type(m) is native_linear.NativeLinear]
    if type(embed) is nn.Embedding:
        targets.append(embed)
    # A weight some other module holds too (a head tied to an embedding subclass that scales
    # its rows, which is not replaced) stays float32: a half copy for one holder would keep
    # both copies alive.
    target_ids = {id(m) for m in targets}
    shared = {id(p) for m in model.modules() if id(m) not in target_ids for p in m.parameters(recurse=False)}
    for module in targets:
        half = narrow(module.weight)
        if half is None:
            continue
        if done.dtype is None:  # the kernel against the upcast product, once, on real weights
            error = disagreement(half)
            if error > 1e-5:
                return Compaction(why_not=f"the native kernel disagrees with the upcast product by {error:.2e} (relative)")
        kind = str(half.dtype).removeprefix("torch.")
        done.dtype = kind if done.dtype in (None, kind) else "bfloat16+float16"
        if module is embed:
            replacement: nn.Module = HalfEmbedding(half, embed.padding_idx, torch.float32)
            done.embeddings = True
        else:
            replacement = HalfLinear(half, module.bias.detach() if module.bias is not None else None, torch.float32)
            done.linear_layers += 1
        parent, _, child = names[id(module)].rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, replacement)
    done.saved_bytes = sum(h.numel() * (4 - h.element_size()) for h in narrowed.values())
    if done.dtype is None:
        done.why_not = "no weight is exactly representable in bfloat16 or float16"
    return done
