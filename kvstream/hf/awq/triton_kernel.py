"""The CUDA AWQ kernel: ``x @ W`` with ``W`` unpacked from AutoAWQ's GEMM layout in registers.

Its own module, imported on first use (``triton_matmul.py`` launches it), so that Triton is
needed only where it runs. With ``TRITON_INTERPRET=1`` set before Triton is first imported,
Triton's interpreter runs it on the CPU: how the tests check it without a GPU.

One program: ``BLOCK_M`` input rows x ``BLOCK_N`` output columns over one split of the input
features, ``BLOCK_K`` at a time. Each K tile lies inside one quantization group (``BLOCK_K``
divides the group size), so a tile's zero points and scales are one row of ``qzeros`` /
``scales``. A column ``n`` reads int32 word ``n // 8`` of its input row and the nibble AWQ's
interleave put it in (``AWQ_REVERSE_ORDER[n % 8]``: ``n % 8 // 2 + 4 * (n % 2)``); the weights
are ``(q - zero) * scale`` in the activations' precision, then one ``tl.dot`` per tile. No
dequantized weight ever reaches memory: the kernel reads 4.25 bits a weight.

Decode-sized inputs (a few rows) cannot fill a GPU with output tiles alone, so the input
features are split over ``program_id(2)`` (split-K); each split writes its float32 partial
sums and the launcher adds them (deterministic, unlike atomics).
"""

import triton
import triton.language as tl


# The row count and split length change from call to call: not specialized on (Triton would
# compile a variant per value of 1 and per divisibility by 16).
@triton.jit(do_not_specialize=["rows", "split_features"])
def awq_matmul(
    X, QWEIGHT, QZEROS, SCALES, OUT, rows, out_features, split_features, stride_x, stride_out_split, stride_out,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """``OUT[split, m, n] = sum over the split's features k of X[m, k] * W[k, n]`` (float32)."""
    row_tile = tl.program_id(0)
    column_tile = tl.program_id(1)
    split = tl.program_id(2)
    m = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    n = column_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = m < rows
    column_ok = n < out_features
    words = n // 8
    shifts = (n % 8 // 2 + 4 * (n % 2)) * 4
    packed_width = out_features // 8
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = split * split_features
    for k_start in range(first, first + split_features, BLOCK_K):
        k = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(X + m.to(tl.int64)[:, None] * stride_x + k[None, :], mask=row_ok[:, None], other=0.0)
        q = tl.load(QWEIGHT + k.to(tl.int64)[:, None] * packed_width + words[None, :], mask=column_ok[None, :], other=0)
        q = (q >> shifts[None, :]) & 0xF
        group = k_start // GROUP_SIZE
        zero = (tl.load(QZEROS + group * packed_width + words, mask=column_ok, other=0) >> shifts) & 0xF
        scale = tl.load(SCALES + group * out_features + n, mask=column_ok, other=0.0).to(tl.float32)
        w = ((q - zero[None, :]).to(tl.float32) * scale[None, :]).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    out = OUT + split.to(tl.int64) * stride_out_split + m.to(tl.int64)[:, None] * stride_out + n[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & column_ok[None, :])
