"""Paged attention over the engine's KV pool, as an attention function transformers calls.

One engine step packs every scheduled sequence into a single row of tokens (decodes of
running sequences and prefill chunks of new ones, any lengths). The model's own layers
compute Q, K, V and rotary embeddings; for each layer transformers then calls
``paged_attention`` with the new K/V, which this function:

1. writes into the pool at each token's slot (``slot = block_id * block_size + offset``);
2. reads each sequence's whole context back through its block table, and
3. runs scaled-dot-product attention per prefill chunk (causal mask aligned bottom-right:
   a chunk's queries sit at the *end* of its keys, which SDPA's ``is_causal`` gets wrong
   when they differ in length) and once for all decodes together (padded, masked).

Under the ``flash`` tier (CUDA) every row skips steps 2 and 3: one Triton kernel (flash.py)
reads each sequence's context in place for its decode or chunk. Under the ``native`` tier
the decodes skip step 2: a C++ kernel (native_attention.py) reads their K/V in place
through their block tables. Under ``flex`` they skip it once they hold
enough context together (flex.IN_PLACE_MIN_CONTEXT): flex.py's compiled kernel reads the
pool through a BlockMask made from the tables. The copy in step 2 is what grows with
context. Prefill chunks gather under every tier (flex.py says why), but for those of up to
``NATIVE_CHUNK_MAX`` tokens under ``native`` (a follow-up turn after a cached conversation,
a short prompt): such a chunk runs as that many rows of the kernel, row t over its own causal
context, the kernel reading each K/V tile once for many rows.

The index tensors are built once per step in ``AttentionPlan`` and reused by every layer, so
the Python work per layer is a fixed handful of tensor ops plus one SDPA per prefill chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvstream.hf import flash, flex, native_attention
from kvstream.hf.kv_cache import PagedKVCache

# Longest prefill chunk the native tier reads in place, one kernel row per token (the kernel
# takes a chunk's rows 16 at a time, reading each K/V tile once for all of them). At SmolLM2's
# geometry (9 query heads over 3 KV heads, head dim 64), one layer of a T-token chunk after L
# cached tokens, gather + SDPA time / in place, 2 threads, over several runs: 1.6-6.3x at
# T <= 32 for L <= 2,000 (0.7-0.9x at T=32, L=2,000 in some runs), 1.4-2.9x for a whole
# prompt of 16-256 tokens, 0.97-1.23x at T=64..128, L=2,000, 0.9-1.4x at T=64, L=8,000. Past
# 128 tokens SDPA's BLAS-backed kernel keeps them (0.85-1.4x either way: no case for the
# kernel). benchmarks/paged_decode.py, its second table.
NATIVE_CHUNK_MAX = 128


@dataclass
class PrefillChunk:
    """Queries ``[start, end)`` of the packed row attend to ``read_slots`` (the sequence's
    whole context so far, this chunk included)."""

    start: int
    end: int
    read_slots: torch.Tensor
    # Bool [q, k] (True = attend) when the chunk follows cached tokens; None when the chunk is
    # the whole context, where plain causal masking is right.
    mask: torch.Tensor | None


@dataclass
class AttentionPlan:
    """Everything the attention function needs for one step, shared by all layers."""

    cache: PagedKVCache
    write_slots: torch.Tensor  # [T] slot of every token in the packed row
    # "flash" (every row in place, one Triton kernel, flash.py) |
    # "native" (decodes and short chunks read the pool in place, native_attention.py; longer
    # prefill chunks as sdpa) |
    # "flex" (the same through compiled flex_attention, flex.py) | "sdpa" (torch's fused
    # kernels over gathered K/V) | "eager" (plain matmul-softmax, the reference)
    kernel: str = "sdpa"
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None  # [B] positions in the packed row
    decode_slots: torch.Tensor | None = None  # [B, L] context slots, padded
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L] bool, None when no padding
    decode_block_mask: flex.BlockMask | None = None  # flex: the decodes' blocks, read in place
    decode_tables: torch.Tensor | None = None  # native: [B, W] int32 block ids, padded
    decode_lengths: torch.Tensor | None = None  # native: [B] int32 context lengths
    flash: flash.FlashPlan | None = None  # flash: every row, read in place (flash.py)

    @classmethod
    def build(
        cls, cache: PagedKVCache, seqs: list[tuple[list[int], int, int]], kernel: str = "sdpa", query_heads: int = 0,
        in_place_from: int = 0,
    ) -> AttentionPlan:
        """``seqs``: per sequence (block ids, tokens already in the pool, new tokens this step),
        in packed-row order. Under ``flex`` the decodes read the pool in place when they hold
        at least ``in_place_from`` tokens of context together (the engine passes
        flex.IN_PLACE_MIN_CONTEXT), and gather below that. ``query_heads``: the model's."""
        device = cache.device
        bs = cache.block_size
        offsets = torch.arange(bs, device=device)
        if kernel == "flash":
            if query_heads <= 0:
                raise ValueError("the flash kernel needs the model's query_heads")
            rows = flash.build(seqs, bs, query_heads, cache.shape.num_kv_heads, device)
            return cls(cache, rows.write_slots, kernel, flash=rows)
        writes: list[torch.Tensor] = []
        decode_writes: list[int] = []  # decodes' slots since the last chunk, kept in row order
        prefills: list[PrefillChunk] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []  # per decode row (the gather tiers and flex)
        table_runs: list[tuple[list[int], int]] = []  # native: (table, how many rows in a row use it)
        lengths: list[int] = []  # each decode's context, its new token included
        row = 0
        for block_ids, computed, new in seqs:
            total = computed + new
            table = block_ids[: -(-total // bs)]
            if new == 1 or (kernel == "native" and new <= NATIVE_CHUNK_MAX):
                # Decode rows, each over its own context (the gather tiers list it below).
                for position in range(computed, total):
                    decode_writes.append(table[position // bs] * bs + position % bs)
                    decode_rows.append(row + position - computed)
                    lengths.append(position + 1)
                if kernel == "native":
                    table_runs.append((table, new))
                else:
                    decode_tables.append(table)
            else:
                if decode_writes:
                    writes.append(torch.tensor(decode_writes, dtype=torch.long, device=device))
                    decode_writes = []
                slots = _context_slots(table, total, offsets)
                writes.append(slots[computed:])
                mask = None
                if computed:
                    q_pos = torch.arange(computed, total, device=device)[:, None]
                    mask = torch.arange(total, device=device)[None, :] <= q_pos
                prefills.append(PrefillChunk(row, row + new, slots, mask))
            row += new
        if decode_writes:
            writes.append(torch.tensor(decode_writes, dtype=torch.long, device=device))
        plan = cls(cache, torch.cat(writes), kernel, prefills)
        if decode_rows and kernel == "native":
            plan.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
            # Each table padded once, then repeated for its chunk's rows (a 128-token chunk
            # after 2,000 cached tokens would otherwise list 128 x 134 ids in Python).
            width = max(len(t) for t, _ in table_runs)
            padded = torch.tensor([t + [0] * (width - len(t)) for t, _ in table_runs], dtype=torch.int32)
            repeats = [n for _, n in table_runs]
            plan.decode_tables = padded if max(repeats) == 1 else padded.repeat_interleave(torch.tensor(repeats), dim=0)
            plan.decode_lengths = torch.tensor(lengths, dtype=torch.int32)
        elif decode_rows and kernel == "flex" and sum(lengths) >= in_place_from:
            if query_heads <= 0:
                raise ValueError("the flex kernel needs the model's query_heads")
            plan.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
            kv_heads = cache.shape.num_kv_heads
            sizes = (query_heads, kv_heads, query_heads // kv_heads, cache.shape.head_dim, bs)
            plan.decode_block_mask = flex.decode_mask(decode_tables, lengths, bs, cache.num_blocks, device, sizes, query_heads // kv_heads)
        elif decode_rows:
            longest = max(lengths)
            padded = torch.zeros(len(lengths), longest, dtype=torch.long, device=device)
            for i, (table, length) in enumerate(zip(decode_tables, lengths, strict=True)):
                padded[i, :length] = _context_slots(table, length, offsets)
            plan.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
            plan.decode_slots = padded
            if min(lengths) != longest:
                context = torch.tensor(lengths, device=device)
                plan.decode_mask = (torch.arange(longest, device=device)[None, :] < context[:, None])[:, None, None, :]
        return plan


def _context_slots(table: list[int], total: int, offsets: torch.Tensor) -> torch.Tensor:
    """The pool slots of a sequence's first ``total`` tokens, whose blocks are ``table``
    (``offsets``: 0 .. block_size - 1 on the pool's device)."""
    blocks = torch.tensor(table, dtype=torch.long, device=offsets.device)
    return (blocks[:, None] * len(offsets) + offsets).reshape(-1)[:total]


def scattered_plan(cache: PagedKVCache, block_ids: list[int], positions: list[int], kernel: str = "sdpa") -> AttentionPlan:
    """A plan for one sequence computing the tokens at ``positions`` (ascending, any gaps):
    each query attends to every slot at or before its own position (blend prefills, where
    the slots in the gaps already hold moved KV)."""
    device = cache.device
    bs = cache.block_size
    total = positions[-1] + 1
    slots = _context_slots(block_ids[: -(-total // bs)], total, torch.arange(bs, device=device))
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    mask = torch.arange(total, device=device)[None, :] <= pos[:, None]
    return AttentionPlan(cache, slots[pos], kernel, [PrefillChunk(0, len(positions), slots, mask)])


def _gather(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V of ``slots`` (any shape S) from a ``[slots, H_kv, D]`` pool -> ``[*S', H_kv, L, D]``.

    index_select on the flat slots is several times faster than advanced indexing on CPU.
    KV heads are not repeated for their query groups: SDPA's ``enable_gqa`` does that
    without copying (and gives bit-identical results).
    """
    picked = pool.index_select(0, slots.reshape(-1)).view(*slots.shape, *pool.shape[1:])
    return picked.transpose(-3, -2).to(dtype)


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float | None
) -> torch.Tensor:
    """The reference kernel: matmul, mask, softmax in fp32, matmul. ``q`` ``[B, H_q, T, D]``,
    ``k``/``v`` ``[B, H_kv, L, D]``; KV heads are repeated for their query groups."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        t, length = scores.shape[-2:]
        mask = torch.arange(length, device=q.device)[None, :] <= torch.arange(length - t, length, device=q.device)[:, None]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v.dtype) @ v


def _attend(plan: AttentionPlan, q, k, v, mask, causal: bool, scale: float | None, gqa: bool) -> torch.Tensor:
    """One gathered attention: the reference kernel under eager, torch's SDPA otherwise."""
    if plan.kernel == "eager":
        return eager_attention(q, k, v, mask, causal, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered with transformers (see compat.py).

    ``query`` is ``[1, H_q, T, D]`` and ``key``/``value`` ``[1, H_kv, T, D]`` for the packed
    row; returns ``[1, T, H_q, D]`` as transformers' own attention functions do.
    """
    plan: AttentionPlan | None = kwargs.get("kvstream_plan")
    if plan is None:
        # Not an engine step (an embedding: one sequence, causal, no KV kept): transformers'
        # own SDPA attention on the call's K/V.
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layer = module.layer_idx
    k_pool = plan.cache.flat_k[layer]
    v_pool = plan.cache.flat_v[layer]
    if (plan.kernel == "native" and k_pool.dtype in native_attention.POOL_DTYPES and key.dtype == value.dtype == torch.float32
            and key.stride(-1) == value.stride(-1) == 1):
        native_attention.write_kv(k_pool, v_pool, plan.write_slots, key[0], value[0])  # one call, not six ops
    else:
        k_pool.index_copy_(0, plan.write_slots, key[0].transpose(0, 1).to(k_pool.dtype))
        v_pool.index_copy_(0, plan.write_slots, value[0].transpose(0, 1).to(v_pool.dtype))

    q = query[0]  # [H_q, T, D]
    if plan.flash is not None:
        o = flash.attention(q.transpose(0, 1), k_pool, v_pool, plan.flash, plan.cache.block_size, scaling)
        return o.unsqueeze(0), None
    if plan.decode_tables is not None and not plan.prefills:
        # Every row is a decode, in row order: no picking rows out and putting them back.
        o = native_attention.paged_decode(q.transpose(0, 1), k_pool, v_pool, plan.decode_tables, plan.decode_lengths,
                                          plan.cache.block_size, scaling)
        return o.unsqueeze(0), None
    gqa = q.shape[0] != key.shape[1]
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, H_q, D]
    for chunk in plan.prefills:
        k = _gather(k_pool, chunk.read_slots, q.dtype)  # [H_kv, L, D]
        v = _gather(v_pool, chunk.read_slots, q.dtype)
        # 4D on purpose: with 3D inputs the CPU kernel falls back to the math path (6x slower).
        o = _attend(plan, q[None, :, chunk.start : chunk.end], k[None], v[None], chunk.mask, chunk.mask is None, scaling, gqa)
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    if plan.decode_tables is not None:
        qd = q[:, plan.decode_rows].transpose(0, 1)  # [B, H_q, D]
        o = native_attention.paged_decode(qd, k_pool, v_pool, plan.decode_tables, plan.decode_lengths, plan.cache.block_size, scaling)
        out[plan.decode_rows] = o
    elif plan.decode_block_mask is not None:
        # Contiguous: the compiled kernel guards on strides (flex.py compiles it on one layout).
        qd = q[:, plan.decode_rows].transpose(0, 1).unsqueeze(2).contiguous()  # [B, H_q, 1, D]
        o = flex.flex_paged(qd, k_pool, v_pool, plan.decode_block_mask, scaling)
        out[plan.decode_rows] = o[:, :, 0, :]
    elif plan.decode_rows is not None:
        qd = q[:, plan.decode_rows].transpose(0, 1).unsqueeze(2)  # [B, H_q, 1, D]
        k = _gather(k_pool, plan.decode_slots, q.dtype)  # [B, H_kv, L, D]
        v = _gather(v_pool, plan.decode_slots, q.dtype)
        o = _attend(plan, qd, k, v, plan.decode_mask, False, scaling, gqa)
        out[plan.decode_rows] = o[:, :, 0, :]
    return out.unsqueeze(0), None
