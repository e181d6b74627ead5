"""The kernels' plain C++ branches, the code a CPU without AVX2 runs, built here without vector
instructions (``native_build.load_extension(..., vector=False)``) and checked against the same
references and the same batch invariance as the AVX2 builds. Each build takes ~30-40 s once
per machine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.conftest import REQUIRE_REAL, require_import

torch = require_import("torch")

import torch.nn.functional as F  # noqa: E402

from kvstream.hf import native_attention, native_build, native_linear  # noqa: E402
from kvstream.hf.awq import native as awq_native  # noqa: E402
from kvstream.hf.awq.format import dequantize, quantize_rtn  # noqa: E402
from kvstream.hf.awq.linear import AWQLinear  # noqa: E402
from tests.hf.test_native_attention import make_case, reference  # noqa: E402


def plain_build(stem: str, source, extra_flags: tuple[str, ...] = ()):
    module, how = native_build.load_extension(stem, source, vector=False, extra_flags=extra_flags)
    if module is None:
        if REQUIRE_REAL:
            pytest.fail(f"{source.name} did not build without vector instructions: {how}")
        pytest.skip(f"{source.name} did not build here: {how}")
    assert how == "scalar C++"
    return module


def test_the_plain_awq_kernel_matches_the_reference_and_a_row_ignores_its_batch():
    module = plain_build("kvstream_awq_gemv", awq_native.SOURCE)
    generator = torch.Generator().manual_seed(7)
    for group_size, out in ((64, 328), (128, 320)):
        layer = AWQLinear(quantize_rtn(torch.randn(out, 256, generator=generator), group_size))
        tensors = (layer.qweight, layer.qzeros, layer.scales, layer.packed_order)
        weight = dequantize(layer.packed())
        x = torch.randn(9, 256, generator=generator)
        batched = module.awq_gemv(x, *tensors, group_size)
        assert torch.allclose(batched, x @ weight, atol=1e-4, rtol=1e-4)
        for i in (0, 4, 8):
            assert torch.equal(module.awq_gemv(x[i : i + 1], *tensors, group_size), batched[i : i + 1])
        narrow = AWQLinear(quantize_rtn(torch.randn(72, 256, generator=generator), group_size))
        together = module.awq_gemv_many(x, *([t, n] for t, n in zip(tensors, (narrow.qweight, narrow.qzeros, narrow.scales, narrow.packed_order))), group_size)
        assert torch.equal(together[0], batched)
        assert torch.equal(together[1], module.awq_gemv(x, narrow.qweight, narrow.qzeros, narrow.scales, narrow.packed_order, group_size))
        buffer = torch.empty(256 * out)
        assert torch.equal(module.awq_dequantize(*tensors, group_size, 0, out // 8, buffer), weight)
        assert torch.equal(module.awq_dequantize(*tensors, group_size, 2, 5, buffer), weight[:, 16:40])


def test_the_plain_linear_kernel_matches_f_linear_and_a_row_ignores_its_batch():
    module = plain_build("kvstream_native_linear", native_linear.SOURCE)
    generator = torch.Generator().manual_seed(8)
    for n, k in ((576, 576), (7, 64), (5, 20), (192, 40)):  # K a multiple of 8 or not
        w = torch.randn(n, k, generator=generator)
        x = torch.randn(11, k, generator=generator)
        batched = module.native_linear(x, w)
        want = F.linear(x, w)
        assert float((batched - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
        for i in (0, 5, 10):
            assert torch.equal(module.native_linear(x[i : i + 1], w)[0], batched[i])
        for half in (torch.float16, torch.bfloat16):  # widened exactly: the upcast matrix's bits
            assert torch.equal(module.native_linear(x, w.to(half)), module.native_linear(x, w.to(half).float()))


@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (8, 8, 128, 4), (2, 1, 20, 5)])
def test_the_plain_decode_attention_kernel_matches_eager(heads, kv_heads, dim, block_size):
    """With contexts split at 32 keys (the smallest split the kernel takes), so that these
    short contexts also run as pieces combined afterwards."""
    built = plain_build("kvstream_paged_decode", native_attention.SOURCE, native_attention.EXTRA_FLAGS)
    module = SimpleNamespace(paged_decode=lambda *args: built.paged_decode(*args, 32))
    lengths = [1, 7, block_size, block_size + 1, 70]
    q, k_pool, v_pool, tables, lens = make_case(heads, kv_heads, dim, block_size, lengths)
    out = module.paged_decode(q, k_pool, v_pool, tables, lens, block_size, dim**-0.5)
    assert torch.allclose(out, reference(q, k_pool, v_pool, tables, lens, block_size, dim**-0.5), atol=1e-5, rtol=1e-5)
    alone = module.paged_decode(q[2:3], k_pool, v_pool, tables[2:3], lens[2:3], block_size, dim**-0.5)
    assert torch.equal(alone[0], out[2])
    # A prefill chunk's rows (one table, lengths one apart), tiled 16 at a time by the kernel.
    rows = 20
    chunk_tables, chunk_lens = tables[4:5].expand(rows, -1).contiguous(), torch.arange(51, 71, dtype=torch.int32)
    chunk = module.paged_decode(q[:1].expand(rows, -1, -1).contiguous(), k_pool, v_pool, chunk_tables, chunk_lens, block_size, dim**-0.5)
    want = reference(q[:1].expand(rows, -1, -1), k_pool, v_pool, chunk_tables, chunk_lens, block_size, dim**-0.5)
    assert torch.allclose(chunk, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(module.paged_decode(q[:1], k_pool, v_pool, chunk_tables[17:18], chunk_lens[17:18], block_size, dim**-0.5)[0], chunk[17])
    for half in (torch.float16, torch.bfloat16):  # a half pool reads as its float32 copy, bit for bit
        k_half, v_half = k_pool.to(half), v_pool.to(half)
        assert torch.equal(module.paged_decode(q, k_half, v_half, tables, lens, block_size, dim**-0.5),
                           module.paged_decode(q, k_half.float(), v_half.float(), tables, lens, block_size, dim**-0.5))


def test_the_plain_kv_write_matches_index_copy():
    module = plain_build("kvstream_paged_decode", native_attention.SOURCE, native_attention.EXTRA_FLAGS)
    generator = torch.Generator().manual_seed(9)
    k_pool, v_pool = torch.randn(24, 2, 32, generator=generator), torch.randn(24, 2, 32, generator=generator)
    key, value = (torch.randn(1, 4, 2, 32, generator=generator).transpose(1, 2)[0] for _ in range(2))
    slots = torch.tensor([3, 23, 0, 9])
    want_k = k_pool.clone().index_copy_(0, slots, key.transpose(0, 1))
    want_v = v_pool.clone().index_copy_(0, slots, value.transpose(0, 1))
    module.write_kv(k_pool, v_pool, slots, key, value)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
