"""The ``flash`` attention tier: one FlashAttention-style Triton kernel over the paged pool (CUDA).

Every row of a step, decode or prefill chunk, runs in one kernel per layer that reads K/V in
place through the block tables: no gather, no padding to the longest context. The algorithm
is FlashAttention-2's forward: a program takes a tile of one sequence's queries for one KV
head, walks that sequence's context ``BLOCK_N`` keys at a time (each key's slot looked up in
its block table), and keeps a running max and sum so that the softmax never materializes.
Queries of a KV head's group are packed together in the tile (``BLOCK_M`` rows = tokens x
group), so each K/V tile is read once for all of them (GQA without repeating heads). The
causal mask is aligned bottom-right: query ``t`` of a chunk after ``c`` cached tokens reads
keys ``0 .. c + t``.

Why Triton, not flash-attn or FlashInfer (the issue's names): flash-attn's paged KV cache
takes blocks of a multiple of 256 tokens only ("Paged KV cache block size must be divisible by
256", its C++ check), the engine's are 16; FlashInfer takes any page size but is a separate
CUDA build. Triton ships with every CUDA build of torch, and its interpreter
(``TRITON_INTERPRET=1``) runs the same kernel on CPU, so its arithmetic is tested where there
is no GPU (tests/hf/test_flash_tier.py), and Triton's compiler turns it into cubins for
NVIDIA GPUs with no GPU present (tests/hf/triton_aot.py). Its speed on a GPU is measured by
``benchmarks/gpu_check.sh``, not here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

# Query rows per program for steps' prefill chunks (tokens x the KV head's query group) and
# keys per inner iteration: FlashAttention-2's tile sizes for head dims up to 128.
CHUNK_ROWS = 64
KEYS_PER_TILE = 64
# tl.dot's smallest operand side.
MIN_ROWS = 16
# Decodes split their keys over several programs when (sequences x KV heads) programs would
# leave the GPU's multiprocessors idle (flash-decoding): up to this many programs per
# multiprocessor, each split at least this many keys, at most MAX_SPLITS splits.
PROGRAMS_PER_PROCESSOR = 2
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 32
# split_keys for a launch that does not split: past any context.
UNSPLIT_KEYS = 2**30
NUM_WARPS = 4


def num_stages(dtype: torch.dtype) -> int:
    """Software-pipelining stages of the key loop for queries of ``dtype``: K/V tiles double-
    buffered in half precision. float32 tiles are twice the bytes: single-buffered, the largest
    variant (head dim 128, chunk rows) asks for 80 KiB of shared memory instead of 112, under
    the 99 KiB a block may have on sm_86/sm_89 GPUs (tests/hf/triton_aot.py compiles every
    variant and checks)."""
    return 1 if dtype == torch.float32 else 2


def available() -> str | None:
    """Why the kernel cannot be built here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "needs triton (it ships with torch's CUDA builds)"
    return None


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def processors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (no split pays there)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def key_splits(programs: int, longest: int, device_processors: int) -> int:
    """Splits per decode so that ``programs`` (decodes x KV heads) fill the device, each split
    keeping at least MIN_SPLIT_KEYS of the ``longest`` context: a power of two, 1 when no split
    pays."""
    wanted = _next_pow2(-(-PROGRAMS_PER_PROCESSOR * device_processors // programs))
    most = longest // MIN_SPLIT_KEYS
    splits = 1
    while splits * 2 <= min(wanted, most, MAX_SPLITS):
        splits *= 2
    return splits


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a step: programs of ``rows`` query rows, program i on sequence
    ``seqs[i]`` from its query ``firsts[i]``; decodes' keys cut into ``splits`` pieces of
    ``split_keys``."""

    rows: int
    seqs: torch.Tensor
    firsts: torch.Tensor
    splits: int = 1
    split_keys: int = UNSPLIT_KEYS


@dataclass
class FlashPlan:
    """One step's rows as the kernel reads them, built once and used by every layer.

    Where each new token's K/V goes (``write_slots``). Per sequence, in packed-row order: its
    block table (``tables``, padded), the tokens it had in the pool before this step
    (``cached``), where its queries start in the packed row (``starts``) and how many it has
    (``lengths``). Per launch: the query rows per program and, per program, its sequence and
    its first query within the sequence's chunk.
    """

    write_slots: torch.Tensor  # [T] int64: the pool slot of every new token, in row order
    tables: torch.Tensor  # [S, W] int32
    cached: torch.Tensor  # [S] int32
    starts: torch.Tensor  # [S] int32
    lengths: torch.Tensor  # [S] int32
    launches: list[Launch]
    group: int  # query heads per KV head


def build(seqs: list[tuple[list[int], int, int]], block_size: int, query_heads: int, kv_heads: int,
          device: torch.device) -> FlashPlan:
    """The plan for ``seqs`` (block ids, tokens already in the pool, new tokens), in row order.

    Decodes (one new token) get a program each of ``MIN_ROWS`` rows (more for a group past 16),
    their keys split over several where they are too few to fill the device (``key_splits``);
    prefill chunks programs of ``CHUNK_ROWS`` rows, ``CHUNK_ROWS // group`` queries each.
    Everything, the new tokens' slots included, goes to the device in one copy (one per
    sequence would be a host-to-device copy each on a GPU).
    """
    if query_heads % kv_heads:
        raise ValueError(f"{query_heads} query heads do not split into {kv_heads} KV heads")
    group = query_heads // kv_heads
    decode_rows = max(MIN_ROWS, _next_pow2(group))
    chunk_rows = max(CHUNK_ROWS, _next_pow2(group))
    per_chunk_tile = chunk_rows // group
    width = max(-(-(computed + new) // block_size) for _, computed, new in seqs)
    slots: list[int] = []
    tables: list[int] = []
    cached, starts, lengths = [], [], []
    decode_tiles: list[int] = []
    chunk_seqs: list[int] = []
    chunk_firsts: list[int] = []
    row = 0
    for index, (block_ids, computed, new) in enumerate(seqs):
        table = block_ids[: -(-(computed + new) // block_size)]
        tables += table + [0] * (width - len(table))
        for block in range(computed // block_size, len(table)):  # the new tokens' slots, a block's run at a time
            first_slot = table[block] * block_size
            slots.extend(range(first_slot + max(computed - block * block_size, 0),
                               first_slot + min(computed + new - block * block_size, block_size)))
        cached.append(computed)
        starts.append(row)
        lengths.append(new)
        if new == 1:
            decode_tiles.append(index)
        else:
            for first in range(0, new, per_chunk_tile):
                chunk_seqs.append(index)
                chunk_firsts.append(first)
        row += new
    segments = [tables, cached, starts, lengths, decode_tiles, [0] * len(decode_tiles), chunk_seqs, chunk_firsts, slots]
    # Each segment starts 16 bytes into the copy (4 int32s): Triton specializes a kernel on
    # whether each pointer is 16-byte aligned, so unaligned parts would compile new variants
    # as the segments' lengths change from step to step.
    padded = [segment + [0] * (-len(segment) % 4) for segment in segments]
    flat = torch.tensor([value for segment in padded for value in segment], dtype=torch.int32).to(device)
    parts = [part[:len(segment)] for part, segment in zip(torch.split(flat, [len(p) for p in padded]), segments, strict=True)]
    count = len(seqs)
    launches = []
    if decode_tiles:
        longest = max(cached[i] + 1 for i in decode_tiles)
        splits = key_splits(len(decode_tiles) * kv_heads, longest, processors(torch.device(device)))
        split_keys = UNSPLIT_KEYS if splits == 1 else -(-longest // (splits * KEYS_PER_TILE)) * KEYS_PER_TILE
        launches.append(Launch(decode_rows, parts[4], parts[5], splits, split_keys))
    if chunk_seqs:
        launches.append(Launch(chunk_rows, parts[6], parts[7]))
    return FlashPlan(parts[8].long(), parts[0].view(count, width), parts[1], parts[2], parts[3], launches, group)


def warm_up(query_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, pool_dtype: torch.dtype,
            device: torch.device, block_size: int) -> None:
    """Compile every variant the engine can launch for this geometry (decode programs at
    each split count, chunk programs, the combine) before the first request waits for it:
    Triton compiles a variant on its first launch (on a GPU, about a second each; cached on
    disk for later starts)."""
    pool = torch.zeros(2 * block_size, kv_heads, head_dim, dtype=pool_dtype, device=device)
    q = torch.zeros(2, query_heads, head_dim, dtype=dtype, device=device)
    decode = build([([0, 1], block_size, 1)], block_size, query_heads, kv_heads, device)
    chunk = build([([0, 1], 0, 2)], block_size, query_heads, kv_heads, device)
    splits = [1 << n for n in range(MAX_SPLITS.bit_length())]  # 1, 2, 4 ... MAX_SPLITS
    for plan in [dataclasses.replace(decode, launches=[dataclasses.replace(decode.launches[0], splits=n, split_keys=KEYS_PER_TILE)])
                 for n in splits] + [chunk]:
        attention(q[: plan.write_slots.numel()], pool, pool, plan, block_size, None)


def attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: FlashPlan, block_size: int,
              scale: float | None) -> torch.Tensor:
    """Attention of the packed queries ``q`` ``[T, H_q, D]`` over a layer's pool ``k_pool`` /
    ``v_pool`` ``[slots, H_kv, D]`` (this step's K/V already written) -> ``[T, H_q, D]``."""
    head_dim, kv_heads = q.shape[-1], k_pool.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    scale = head_dim**-0.5 if scale is None else scale
    paged_flash, combine_splits = _kernels()
    padded_dim = _next_pow2(max(head_dim, MIN_ROWS))
    for launch in plan.launches:
        partial_out = partial_lse = out  # unread unless the launch splits
        if launch.splits > 1:
            programs = launch.seqs.numel()  # one decode each: the partials are per decode, not per token
            partial_out = torch.empty(programs, q.shape[1], launch.splits, padded_dim, dtype=torch.float32, device=q.device)
            partial_lse = torch.empty(programs, q.shape[1], launch.splits, dtype=torch.float32, device=q.device)
        paged_flash[(launch.seqs.numel(), kv_heads, launch.splits)](
            q, k_pool, v_pool, out, partial_out, partial_lse, plan.tables, plan.cached, plan.starts, plan.lengths,
            launch.seqs, launch.firsts,
            scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
            launch.split_keys, q.shape[1],
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
            out.stride(0), out.stride(1), plan.tables.stride(0),
            GROUP=plan.group, BLOCK_M=launch.rows, BLOCK_N=KEYS_PER_TILE, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=padded_dim, IEEE=q.dtype == torch.float32, SPLITS=launch.splits,
            num_warps=NUM_WARPS, num_stages=num_stages(q.dtype),
        )
        if launch.splits > 1:
            combine_splits[(launch.seqs.numel(), q.shape[1])](
                partial_out, partial_lse, out, plan.starts, launch.seqs, q.shape[1], out.stride(0), out.stride(1),
                SPLITS=launch.splits, HEAD_DIM=head_dim, HEAD_DIM_PADDED=padded_dim,
            )
    return out


def _kernels():
    """The Triton kernels, imported on first use: importing this module needs no triton."""
    from kvstream.hf.flash_kernel import combine_splits, paged_flash

    return paged_flash, combine_splits
