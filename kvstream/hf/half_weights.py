"""Token embeddings and LM head kept in the checkpoint's half precision under a float32 model.

Why: once an AWQ checkpoint has packed the decoder's projections into 4 bits, most of what is
left is the token embedding matrix, which small models tie to the LM head (SmolLM2-135M:
49152 x 576, 57 MB in float16, 113 MB upcast). Upcasting it at load doubles those resident
bytes and the bytes the head reads at every decode step, where it is memory-bound. Kept as
stored, the embedding lookup widens only the rows it gathers, and the head runs
``native_linear``'s kernel, which widens each weight to float32 in registers: exact for float16
and bfloat16, so the products are those of the upcast matrix (only the summation order is the
kernel's, as for every ``NativeLinear``).

The weight is a buffer, not a parameter: the engine and transformers take the model's dtype
from its first parameter, and it must stay the activations' float32. ``keep_half`` decides at
load and says why not when it cannot (no kernel, or it disagrees with the upcast product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstream.hf import native_linear

HALF_DTYPES = (torch.float16, torch.bfloat16)
# Output rows widened at once when more than ``native_linear.MAX_ROWS`` rows go through the
# head (a prefill chunk asking for every position's logits): a bounded float32 copy.
UPCAST_ROWS = 4096


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


class HalfLinear(nn.Module):
    """``y = x @ W.T (+ b)`` for float32 ``x`` with ``W`` held in half precision."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)
        module, _ = native_linear.load()
        if 0 < rows <= native_linear.MAX_ROWS and module is not None:
            y = module.native_linear(flat if flat.stride(-1) == 1 else flat.contiguous(), self.weight)
        else:  # prefill-sized: BLAS on a bounded block of widened rows at a time
            y = torch.empty(rows, self.out_features, dtype=self.dtype)
            for start in range(0, self.out_features, UPCAST_ROWS):
                y[:, start : start + UPCAST_ROWS] = F.linear(flat, self.weight[start : start + UPCAST_ROWS].to(self.dtype))
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stored {self.weight.dtype}"


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


def disagreement(weight: torch.Tensor, rows: int = 256) -> float:
    """Largest difference between the kernel and the upcast product on the first ``rows``
    rows of ``weight``, relative to the largest output, for 1, 5 and MAX_ROWS inputs."""
    module, _ = native_linear.load()
    sample = weight[:rows].contiguous()
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for count in (1, 5, native_linear.MAX_ROWS):
        x = torch.randn(count, weight.shape[1], generator=generator)
        want = F.linear(x, sample.float())
        got = module.native_linear(x, sample)
        worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    return worst
