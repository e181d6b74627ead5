"""Attention that reads the paged KV pool in place: torch's ``flex_attention`` over block tables.

The ``sdpa`` tier copies every sequence's K/V out of the pool (``index_select``) in every
layer at every step before attending; at long contexts that copy costs more than the
attention itself. Here the whole pool of one layer is the key/value tensor
(``[B, H_kv, slots, D]`` over the pool's own storage: no copy) and a ``BlockMask`` tells the
kernel which pool blocks each query row visits, straight from the sequence's block table:

* a query's *full* blocks (every slot at or before its position) are visited without
  evaluating any mask;
* its *partial* blocks (the one holding its own position, or the sequence's unfinished last
  block) are visited with a ``mask_mod`` that keeps the slots at or before its position.

The kernel is compiled once per model geometry per process (``torch.compile`` with dynamic
shapes, so every batch width, context length and pool size reuses it; compiling takes
seconds, the engine does it at start, and inductor's on-disk cache makes later processes
faster). On CPU inductor needs a C++ compiler: without one the tier probe
(attention_tiers.py) fails to compile it and falls back to ``sdpa``, reporting why.

Decodes (one query per sequence) run as one batch against the pool broadcast over B, with
the query heads of each KV head folded into the query length (``flex_paged``);
``decode_mask`` builds their mask. The kernel's call costs more than a gather at short
contexts, so the engine reads in place only when a step's decodes hold at least
``IN_PLACE_MIN_CONTEXT`` tokens of context, and gathers below that (``attention.py``).
Prefill chunks are not read in place: torch 2.13's CPU flex template failed to compile the
chunk layout (``[1, H_q, T, D]``, a mask per block of queries) when it was tried, so chunks
gather as the ``sdpa`` tier does. A chunk's gather is paid once for all its queries; a
decode's, for one.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - the pinned torch has it
    BlockMask = flex_attention = None  # type: ignore[assignment,misc]


# Decode context (tokens, summed over the step's decodes) from which reading in place beats
# gathering on this 2-core CPU: per layer, SmolLM2's geometry, in place vs gather + SDPA,
# 2 x 2,000 tokens 1.4 vs 2.0 ms, 16 x 300 1.1 vs 1.3, 8 x 1,933 3.2 vs 6.5; but 16 x 150
# 0.67 vs 0.62 and 8 x 300 0.96 vs 0.54 (a fixed cost of ~0.3 ms a call).
IN_PLACE_MIN_CONTEXT = 4096


@functools.cache
def _compiled(geometry: tuple) -> Callable:
    """The compiled kernel for one geometry (heads, head dim, block size, dtype, device).

    Each geometry gets its own copy of ``flex_attention``'s code object, so that dynamo keeps
    a separate cache for it: a second geometry on the same function is a *recompile*, in which
    dynamo turns the sizes that changed into symbols, and torch 2.13's CPU flex template fails
    to compile such a kernel (C++ errors about ``cur_qSplitSize``). dynamic=True: batch width
    and pool size are symbols, so one compile serves every step of a geometry."""
    name = "flex_attention_" + "_".join(str(part).replace(".", "_").replace(":", "_") for part in geometry)
    code = flex_attention.__code__.replace(co_name=name)
    copy = types.FunctionType(code, flex_attention.__globals__, name, flex_attention.__defaults__, flex_attention.__closure__)
    copy.__kwdefaults__ = flex_attention.__kwdefaults__
    return torch.compile(copy, dynamic=True)


def decode_width(rows: int, sizes: tuple[int, ...]) -> int:
    """The batch width a decode batch of ``rows`` runs at: the smallest at least ``rows`` (and
    at least 2) equal to none of the other ``sizes`` of the call (heads, head dim, block size).

    Dynamo gives equal sizes one symbol ("duck shaping"): a kernel compiled on a batch as
    wide as the KV heads keeps the width tied to them, the next width forces a recompile,
    which torch 2.13's CPU flex template fails to compile (see ``_compiled``). A width of
    its own never meets that, and a batch of one padded to two needs no compile of its own
    (dynamo specializes sizes 0 and 1). Padded rows read one slot; their output is dropped."""
    width = max(rows, 2)
    while width in sizes:
        width += 1
    return width


@functools.cache
def warm_up(query_heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device, block_size: int) -> None:
    """Compile the kernel for one geometry before the first request waits for it (the engine
    calls this at start). On synthetic tensors made the way the engine's are, because dynamo
    guards on more than shapes: strides, inference tensor or not, and a storage offset of 0
    (layer 0 of the pool) apart from any other (the other layers), so both are compiled."""
    sizes = (query_heads, kv_heads, query_heads // kv_heads, dim, block_size)
    blocks = next(n for n in (23, 29, 31, 37, 41) if n not in sizes)
    with torch.inference_mode(False):  # normal tensors, laid out as the engine's pool
        shape = (2, blocks, block_size, kv_heads, dim)  # [layers, blocks, block, heads, dim]
        k_all, v_all = (torch.zeros(shape, dtype=dtype, device=device).view(2, -1, kv_heads, dim) for _ in "kv")
    with torch.inference_mode():  # the step's tensors, as the engine makes them
        q = torch.zeros(1, query_heads, 1, dim, dtype=dtype, device=device)
        mask = decode_mask([[0]], [2], block_size, blocks, device, sizes, query_heads // kv_heads)
        for layer in (0, 1):
            flex_paged(q, k_all[layer], v_all[layer], mask, None)


def _pool_view(pool: torch.Tensor, batch: int) -> torch.Tensor:
    """One layer's ``[slots, H_kv, D]`` pool as ``[batch, H_kv, slots, D]`` without a copy.

    Made with ``set_`` on the pool's storage rather than as a view: dynamo guards on a view's
    base (here the whole ``[layers, ...]`` pool), so every pool size would compile anew."""
    slots, heads, dim = pool.shape
    s_slot, s_head, s_dim = pool.stride()
    return pool.new_empty(0).set_(
        pool.untyped_storage(), pool.storage_offset(), (batch, heads, slots, dim), (0, s_head, s_slot, s_dim)
    )


def decode_mask(
    tables: list[list[int]], lengths: list[int], block_size: int, num_blocks: int, device: torch.device,
    sizes: tuple[int, ...], group: int,
) -> BlockMask:
    """The BlockMask of a decode batch: row b's queries (the ``group`` query heads that share
    one KV head, see ``flex_paged``) sit at position ``lengths[b] - 1`` of the sequence whose
    blocks are ``tables[b]`` (at least ``ceil(length / block_size)`` of them). Its full
    blocks are all but an unfinished last one; the last block, when unfinished, is partial
    and masked at the sequence's end (``limit``: the first slot past it). Padded to
    ``decode_width`` rows (``sizes``: the call's heads, head dim, block size)."""
    pad = decode_width(len(tables), sizes) - len(tables)
    tables, lengths = tables + [[0]] * pad, lengths + [1] * pad
    batch = len(tables)
    width = max(len(t) for t in tables)
    padded = torch.zeros(batch, width, dtype=torch.int32)
    for i, table in enumerate(tables):
        padded[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    length = torch.tensor(lengths, dtype=torch.int32)
    full = length // block_size
    last = padded.gather(1, ((length - 1) // block_size).long()[:, None])[:, 0]
    # The kernel's index tensors span the whole pool (it checks the KV length against them);
    # only the first ``num`` entries of each row are read.
    full_idx = torch.zeros(batch, 1, 1, num_blocks, dtype=torch.int32)
    full_idx[:, 0, 0, :width] = padded
    partial_idx = torch.zeros(batch, 1, 1, num_blocks, dtype=torch.int32)
    partial_idx[:, 0, 0, 0] = last
    partial_num = (length % block_size != 0).to(torch.int32)
    limit = (last * block_size + (length - 1) % block_size + 1).to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < limit[b]

    return BlockMask.from_kv_blocks(
        partial_num.view(batch, 1, 1).to(device), partial_idx.to(device), full.view(batch, 1, 1).to(device), full_idx.to(device),
        BLOCK_SIZE=(max(16, group), block_size), mask_mod=mask_mod, seq_lengths=(group, num_blocks * block_size),
        compute_q_blocks=False,
    )


class FlexKernelError(RuntimeError):
    """The compiled kernel failed (to compile, usually) on a shape the probe did not cover."""


def flex_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, mask: BlockMask, scale: float | None) -> torch.Tensor:
    """Decode queries ``q`` ``[B, H_q, 1, D]`` against one layer's pool ``[slots, H_kv, D]``,
    read in place through ``mask`` (``decode_mask``) -> ``[B, H_q, 1, D]``.

    The query heads that share a KV head are folded into the query length
    (``[B, H_kv, H_q / H_kv, D]``): one decode query each, all at the same position, so the
    mask holds for all of them, and each KV head is read once for its whole group instead
    of once per query head (about 30% faster than the kernel's own GQA on this CPU)."""
    rows, heads, _, dim = q.shape
    kv_heads = k_pool.shape[1]
    batch = mask.kv_num_blocks.shape[0]  # decode_mask pads the batch (decode_width)
    if batch > rows:
        q = torch.cat([q, q.new_zeros(batch - rows, *q.shape[1:])])
    try:
        k, v = _pool_view(k_pool, batch), _pool_view(v_pool, batch)
        # The scale is applied here and the kernel always gets 1.0: dynamo specializes on
        # float arguments, and one compiled kernel should serve every model.
        grouped = (q * (scale if scale is not None else dim**-0.5)).reshape(batch, kv_heads, heads // kv_heads, dim)
        kernel = _compiled((heads, kv_heads, dim, mask.BLOCK_SIZE, q.dtype, q.device))
        out = kernel(grouped, k, v, block_mask=mask, scale=1.0)
        return out.reshape(batch, heads, 1, dim)[:rows]
    except Exception as exc:  # noqa: BLE001 - inductor raises many kinds; the caller falls back
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        raise FlexKernelError(f"{type(exc).__name__}: {first_line}") from exc
