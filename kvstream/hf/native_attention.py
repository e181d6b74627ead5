"""The ``native`` attention tier's kernel (``paged_decode.cpp``): decode attention on CPU that
reads K/V in place from the paged pool through the block tables.

Why it exists: under ``sdpa`` every layer of every decode step copies each sequence's whole
context out of the pool (``index_select``), pads the batch to its longest context and runs
SDPA with a mask; at SmolLM2's geometry and 16 sequences of ~300 tokens that copy and the
padded SDPA took ~1.3 ms a layer for ~6 MB of K/V. This kernel reads each K and V row once,
where it lies, for all the query heads that share it, and runs each (sequence, KV head) on
its own (no padding). ``flex`` reads in place too, but a compiled call costs ~0.3 ms more
than a gather at short contexts, so it gathers below 4,096 tokens; this one has no such cost.

Float32 queries on CPU only (the engine's dtype on CPU); the pool float32, or float16 /
bfloat16 with ``memory.kv_dtype`` (read widened, in registers); other dtypes and devices
fail the tier probe and run the next tier. Prefill chunks of up to ``attention.NATIVE_CHUNK_MAX`` tokens
run here as one row per token, the kernel taking a chunk's rows in tiles that share each K/V
tile it reads; longer ones gather and run SDPA, whose BLAS-backed kernel is about as fast
there. Built by ``native_build``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from kvstream.hf import native_build

SOURCE = Path(__file__).with_name("paged_decode.cpp")
# What the kernel reads the pool as (queries and outputs are float32): half-precision K/V are
# widened exactly as they are read, so a half pool gives its float32 copy's results bit for bit.
POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Mul and add kept apart in the scalar tails, so that a pool held in half precision and its
# float32 copy give the same bits (the compiler contracted them in one and not the other).
EXTRA_FLAGS = ("-ffp-contract=off",)
# Keys per piece of a long decode context: past it a (sequence, KV head) is cut into pieces
# at multiples of this, each its own unit of work, combined afterwards, so that one
# sequence's three KV heads (SmolLM2) do not leave one of two threads half idle; a row's
# cut depends only on its own length (benchmarks/paged_decode.py: ``unsplit``).
SPLIT_KEYS = 512


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """The compiled kernel and how it was built, or None and why not."""
    return native_build.load_extension("kvstream_paged_decode", SOURCE, extra_flags=EXTRA_FLAGS)


class NativeKernelUnavailable(RuntimeError):
    """The kernel could not be built here (the message says why)."""


def paged_decode(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
    block_size: int, scale: float | None, split_keys: int | None = None,
) -> torch.Tensor:
    """Decode queries ``q`` ``[B, H_q, D]`` against one layer's pool ``[slots, H_kv, D]``:
    sequence b's context is its first ``lengths[b]`` tokens, in the blocks ``tables[b]``
    (int32 ``[B, W]``, padded) -> ``[B, H_q, D]``. A context past ``split_keys`` keys (a
    multiple of 32; None: ``SPLIT_KEYS`` as it is at the call) is attended in pieces of that
    many, combined. Raises RuntimeError on a table or length that does not fit the pool, before
    reading anything."""
    module, why = load()
    if module is None:
        raise NativeKernelUnavailable(f"the native attention kernel is not available: {why}")
    return module.paged_decode(q, k_pool, v_pool, tables, lengths, block_size, scale if scale is not None else q.shape[-1] ** -0.5,
                               SPLIT_KEYS if split_keys is None else split_keys)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write a step's new ``key`` / ``value`` (``[H_kv, T, D]``, float32, any strides with D
    contiguous) into one layer's pools (``[slots, H_kv, D]``) at ``slots`` (int64 ``[T]``):
    ``pool.index_copy_(0, slots, key.transpose(0, 1))`` in one call. Raises RuntimeError on a
    slot outside the pool, before writing anything."""
    module, why = load()
    if module is None:
        raise NativeKernelUnavailable(f"the native attention kernel is not available: {why}")
    module.write_kv(k_pool, v_pool, slots, key, value)
