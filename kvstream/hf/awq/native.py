"""The native AWQ kernel (``awq_gemv.cpp``): int4 x float for a few rows, read straight from
the packed weights, compiled here on first use with torch's extension builder.

It exists because decoding reads each weight once per step: the pure-torch ``dequant``
kernel writes and rereads a float copy of every weight (several passes over 8 bytes per
weight for the 0.5 it reads), so a decode step spent ~7x longer in an AWQ projection than
in the fp32 one. This kernel reads the packed words once and unpacks them in registers
(AVX2 + FMA + F16C where the CPU has them, plain C++ otherwise): at one row it is 1.25-2.7x
faster than the same layer in float32, which reads eight times the bytes. Above ``MAX_ROWS``
rows (prefill chunks, large batches) ``AWQLinear`` runs BLAS on weights ``dequantize`` (the
same source's one-pass dequantizer) writes, a bounded block of columns at a time.

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
# what takes more rows, ``dequantize`` + BLAS (benchmarks/awq_kernel.py): 1 row 3.7-6.7x
# faster, 8 rows 2.1-3.7x, 32 rows 1.5-1.9x, 48 rows 1.2-1.6x, 64 rows 0.8-1.35x (its time
# grows with the rows, BLAS's barely).
MAX_ROWS = 48


# Where torch reports AVX-512, the kernel is built with it: its nibbles then become floats
# without a conversion (awq_gemv.cpp, ``one_plus_sixteenth``).
AVX512_FLAGS = ("-mavx512f", "-mavx512vl")


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """The compiled kernel and how it was built, or None and why not (native_build.py)."""
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    module, how = native_build.load_extension("kvstream_awq_gemv", SOURCE, extra_flags=AVX512_FLAGS if avx512 else ())
    return module, f"{how} + AVX-512VL" if module is not None and avx512 else how


def _built() -> ModuleType:
    module, why = load()
    if module is None:
        raise RuntimeError(f"the native AWQ kernel is not available: {why}")
    return module


def gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, logical: torch.Tensor,
         group_size: int) -> torch.Tensor:
    """``[rows, in]`` float32 times the weights of a checkpoint's ``qweight`` / ``qzeros`` /
    ``scales`` -> ``[rows, out]`` in column order; ``logical[p]`` is the column of packed
    column ``p`` (``AWQLinear.packed_order``)."""
    return _built().awq_gemv(x, qweight, qzeros, scales, logical, group_size)


def gemv_many(x: torch.Tensor, projections: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
              group_size: int) -> list[torch.Tensor]:
    """``gemv`` of one input through several projections (``(qweight, qzeros, scales,
    logical)`` each, the same input width and group size) in one call, one output each: the
    threads split all their words together (awq_gemv.cpp, ``awq_gemv_many``)."""
    qweights, qzeros, scales, logicals = ([parts[i] for parts in projections] for i in range(4))
    return _built().awq_gemv_many(x, qweights, qzeros, scales, logicals, group_size)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, logical: torch.Tensor, group_size: int,
               first_word: int, last_word: int, buffer: torch.Tensor) -> torch.Tensor:
    """The float32 weights of packed words ``[first_word, last_word)`` (columns ``8 *
    first_word`` up to ``8 * last_word``), ``[in, columns]`` in column order, written into
    ``buffer`` (float32, contiguous, at least that many elements) and returned as a view of it."""
    return _built().awq_dequantize(qweight, qzeros, scales, logical, group_size, first_word, last_word, buffer)
