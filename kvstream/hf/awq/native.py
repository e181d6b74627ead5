"""The native AWQ kernel (``awq_gemv.cpp``): int4 x float for a few rows, read straight from
the packed weights, compiled here on first use with torch's extension builder.

It exists because decoding reads each weight once per step: the pure-torch ``dequant``
kernel writes and rereads a float copy of every weight (several passes over 8 bytes per
weight for the 0.5 it reads), so a decode step spent ~7x longer in an AWQ projection than
in the fp32 one. This kernel reads the packed words once and unpacks them in registers
(AVX2 + FMA + F16C where the CPU has them, plain C++ otherwise): at one row it is 1.5-2x
faster than the same layer in float32, which reads eight times the bytes. Above ``MAX_ROWS``
rows (prefill chunks, large batches) ``AWQLinear`` dequantizes and runs BLAS instead.

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
# Most rows it takes. On SmolLM2's projections here (576x576, 576->1536, 1536->576), against
# dequantize + BLAS (benchmarks/awq_kernel.py): 1 row 10-14x faster, 8 rows 6-6.5x, 32 rows
# 2.3-2.8x, 64 rows 1.8-2.6x, 96 rows 1.35-1.8x: the margin shrinks as the kernel's time grows
# with the rows and BLAS's barely; larger batches and prefill chunks take ``dequant``.
MAX_ROWS = 96


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
