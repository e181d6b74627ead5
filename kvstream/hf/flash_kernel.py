"""The flash tier's Triton kernel (the rest of the tier, and why Triton: flash.py).

Its own module, imported on first use, so that Triton is needed only where the tier runs.
With ``TRITON_INTERPRET=1`` in the environment before Triton is first imported (Triton's own
``tl`` functions are made then), Triton's interpreter runs these kernels on the CPU, patching
the ``tl`` this module's globals hold: how the tests run them without a GPU.

One program: a tile of ``BLOCK_M`` query rows (``BLOCK_M // GROUP`` tokens of one sequence x the
``GROUP`` query heads of KV head ``program_id(1)``) against that sequence's context, ``BLOCK_N``
keys at a time, with FlashAttention-2's running max and sum. Decodes too few to fill the GPU
split their keys over several programs (flash-decoding), combined by ``combine_splits``.
"""

import triton
import triton.language as tl


# Integers that change from step to step are not specialized on (Triton compiles a variant per
# value of 1 and per divisibility by 16 otherwise): a step's table width, the keys per split.
@triton.jit(do_not_specialize=["split_keys", "stride_table"])
def paged_flash(
    Q, K, V, O, partial_out, partial_lse, tables, cached, starts, lengths, tile_seqs, tile_firsts, scale_log2,
    split_keys, query_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_table,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr,
):
    """With ``SPLITS`` > 1 (decodes only) program (tile, head, split) reads keys
    ``[split * split_keys, (split + 1) * split_keys)`` and writes its normalized partial output
    and log2-sum-exp to ``partial_out`` / ``partial_lse`` (``[programs, H_q, SPLITS,
    HEAD_DIM_PADDED]`` / ``[programs, H_q, SPLITS]``, float32) for ``combine_splits``; with 1 it
    writes ``O``."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seqs + tile)
    first = tl.load(tile_firsts + tile)
    start = tl.load(starts + seq)
    length = tl.load(lengths + seq)
    past = tl.load(cached + seq)
    # Row r is query token first + r // GROUP of the chunk, head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    valid = (rows < (BLOCK_M // GROUP) * GROUP) & (token < length)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_ok = dims < HEAD_DIM
    q_offsets = (start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(Q + q_offsets, mask=valid[:, None] & dim_ok[None, :], other=0.0)
    last_key = past + token  # causal, bottom-right: the last key each row reads
    end = past + tl.minimum(first + BLOCK_M // GROUP, length)  # keys the tile reads
    key_lo = split * split_keys
    key_hi = tl.minimum(end, key_lo + split_keys)
    # Finite start: a row whose keys in a tile are all masked keeps exp2(-inf - m) = 0.
    running_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    for key_start in range(key_lo, key_hi, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        inside = keys < key_hi
        block = tl.load(tables + seq * stride_table + keys // BLOCK_SIZE, mask=inside, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
        kv_mask = inside[:, None] & dim_ok[None, :]
        k = tl.load(K + slot[:, None] * stride_kt + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k.to(q.dtype)))
        scores = tl.where(keys[None, :] <= last_key[:, None], scores * scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        p = tl.exp2(scores - new_max[:, None])
        alpha = tl.exp2(running_max - new_max)
        running_sum = running_sum * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        running_max = new_max
    out = acc / tl.maximum(running_sum, 1e-30)[:, None]
    row_ok = valid[:, None] & dim_ok[None, :]
    if SPLITS == 1:
        o_offsets = (start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(O + o_offsets, out.to(O.dtype.element_ty), mask=row_ok)
    else:
        # A split that read no key (a context shorter than the step's longest) has a sum of 0:
        # its log2-sum-exp is -inf and it weighs nothing in the combine.
        partial = (tile.to(tl.int64) * query_heads + head) * SPLITS + split  # a decode per program: its tile's rows
        lse = tl.where(running_sum > 0, running_max + tl.log2(tl.maximum(running_sum, 1e-30)), float("-inf"))
        tl.store(partial_lse + partial, lse, mask=valid)
        tl.store(partial_out + partial[:, None] * HEAD_DIM_PADDED + dims[None, :], out, mask=row_ok)


@triton.jit
def combine_splits(
    partial_out, partial_lse, O, starts, tile_seqs, query_heads, stride_ot, stride_oh,
    SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
):
    """Program (decode, query head): its splits' partial outputs weighted by their share of
    the softmax's sum, ``exp2(lse_i - max lse)``."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(starts + tl.load(tile_seqs + tile)).to(tl.int64)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    base = (tile.to(tl.int64) * query_heads + head) * SPLITS
    lse = tl.load(partial_lse + base + splits)
    weights = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(partial_out + (base + splits)[:, None] * HEAD_DIM_PADDED + dims[None, :])
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(O + row * stride_ot + head * stride_oh + dims, out.to(O.dtype.element_ty), mask=dims < HEAD_DIM)
