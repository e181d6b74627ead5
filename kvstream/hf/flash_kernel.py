"""The flash tier's Triton kernel (the rest of the tier, and why Triton: flash.py).

Its own module, imported on first use, so that Triton is needed only where the tier runs and
``TRITON_INTERPRET=1`` (read when ``triton.jit`` runs, and applied to the ``tl`` this module's
globals hold) can run it on the CPU in the tests.

One program: a tile of ``BLOCK_M`` query rows (``BLOCK_M // GROUP`` tokens of one sequence x the
``GROUP`` query heads of KV head ``program_id(1)``) against that sequence's context, ``BLOCK_N``
keys at a time, with FlashAttention-2's running max and sum.
"""

import triton
import triton.language as tl


@triton.jit
def paged_flash(
    Q, K, V, O, tables, cached, starts, lengths, tile_seqs, tile_firsts, scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_table,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
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
    # Finite start: a row whose keys in a tile are all masked keeps exp2(-inf - m) = 0.
    running_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    for key_start in range(0, end, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        inside = keys < end
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
    o_offsets = (start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(O + o_offsets, out.to(O.dtype.element_ty), mask=valid[:, None] & dim_ok[None, :])

