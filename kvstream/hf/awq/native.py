"""The native AWQ kernel (``awq_gemv.cpp``): int4 x float for a few rows, read straight from
the packed weights, compiled here on first use with torch's extension builder.

It exists because decoding reads each weight once per step: the pure-torch ``dequant``
kernel writes and rereads a float copy of every weight (several passes over 8 bytes per
weight for the 0.5 it reads), so a decode step spent ~7x longer in an AWQ projection than
in the fp32 one. This kernel reads the packed words once (AVX2 + FMA where the CPU has them,
plain C++ otherwise). Above ``MAX_ROWS`` rows (prefill chunks, large batches) it loses to
dequantize + BLAS, which ``AWQLinear`` then uses.

Built by ``native_build`` (a C++ compiler and ninja); where either is missing ``load`` says
why and the probe keeps the pure-torch kernels.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from kvstream.hf import native_build

SOURCE = Path(__file__).with_name("awq_gemv.cpp")
# Most rows it takes. On SmolLM2's projections here (576x1536, 1536x576, 576x576), against
# dequantize + BLAS: 1 row 0.07-0.33 vs 0.49-1.34 ms, 8 rows 0.37-1.23 vs 0.69-1.49, 16 rows
# about even, 32 rows 1.5-4x slower (its accumulators stop fitting in L1).
MAX_ROWS = 8


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """The compiled kernel and how it was built, or None and why not (native_build.py)."""
    return native_build.load_extension("kvstream_awq_gemv", SOURCE)


def gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, logical: torch.Tensor,
         group_size: int) -> torch.Tensor:
    """``[rows, in]`` float32 times the weights of a checkpoint's ``qweight`` / ``qzeros`` /
    ``scales`` -> ``[rows, out]`` in column order; ``logical[p]`` is the column of packed
    column ``p`` (``AWQLinear.packed_order``)."""
    module, why = load()
    if module is None:
        raise RuntimeError(f"the native AWQ kernel is not available: {why}")
    return module.awq_gemv(x, qweight, qzeros, scales, logical, group_size)
