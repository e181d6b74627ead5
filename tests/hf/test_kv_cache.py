"""The KV pool moves bytes exactly: swap out and back in, and copy-on-write copies."""

from __future__ import annotations

import pytest

from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf.kv_cache import KVShape, PagedKVCache  # noqa: E402

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8)


def filled(device: str = "cpu", dtype=torch.float32) -> PagedKVCache:
    cache = PagedKVCache(SHAPE, num_blocks=8, block_size=4, num_cpu_blocks=4, dtype=dtype, device=torch.device(device))
    generator = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator).to(dtype))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swap_round_trip_is_bit_for_bit(dtype):
    cache = filled(dtype=dtype)
    before_k, before_v = cache.k[:, [1, 5]].clone(), cache.v[:, [1, 5]].clone()
    cache.swap_out([(1, 3), (5, 0)])
    cache.k[:, [1, 5]] = 0  # the freed device blocks are reused by someone else
    cache.v[:, [1, 5]] = 0
    cache.swap_in([(3, 6), (0, 2)])  # and the sequence comes back into other blocks
    assert torch.equal(cache.k[:, [6, 2]], before_k) and torch.equal(cache.v[:, [6, 2]], before_v)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_swap_is_within_the_kivi_bound_and_keeps_partial_blocks_exact(bits):
    cache = PagedKVCache(SHAPE, num_blocks=8, block_size=4, num_cpu_blocks=4, dtype=torch.float32, device=torch.device("cpu"), swap_bits=bits)
    generator = torch.Generator().manual_seed(1)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    before_k, before_v = cache.k[:, [1, 5]].clone(), cache.v[:, [1, 5]].clone()
    full_bytes = 2 * cache.k[:, :4].numel() * 4
    cache.swap_out([(1, 3), (5, 0)], exact={0})  # block 5 is a sequence's partial last block
    cache.k[:, [1, 5]] = 0
    cache.v[:, [1, 5]] = 0
    cache.swap_in([(3, 6), (0, 2)])
    assert torch.equal(cache.k[:, 2], before_k[:, 1]) and torch.equal(cache.v[:, 2], before_v[:, 1])  # exact
    k_err = (cache.k[:, 6] - before_k[:, 0]).abs()
    v_err = (cache.v[:, 6] - before_v[:, 0]).abs()
    levels = (1 << bits) - 1
    k_range = before_k[:, 0].amax(dim=1, keepdim=True) - before_k[:, 0].amin(dim=1, keepdim=True)  # per channel, over tokens
    v_range = before_v[:, 0].amax(dim=-1, keepdim=True) - before_v[:, 0].amin(dim=-1, keepdim=True)  # per token
    assert torch.all(k_err <= k_range / levels / 2 * 1.01 + 2e-3)  # + fp16 rounding of the range
    assert torch.all(v_err <= v_range / levels / 2 * 1.01 + 2e-3)
    assert not cache.host_exact  # taken back on swap-in
    assert cache.host_bytes < full_bytes * (0.6 if bits == 8 else 0.4)


def test_a_reused_host_block_never_serves_a_stale_exact_copy():
    cache = PagedKVCache(SHAPE, num_blocks=8, block_size=4, num_cpu_blocks=4, dtype=torch.float32, device=torch.device("cpu"), swap_bits=8)
    cache.k[:, 1] = 1.0
    cache.swap_out([(1, 0)], exact={0})  # swapped, then its sequence was aborted: never swapped in
    cache.k[:, 2] = 5.0
    cache.swap_out([(2, 0)])  # host block 0 reused, quantized this time
    cache.swap_in([(0, 3)])
    assert torch.allclose(cache.k[:, 3], torch.full_like(cache.k[:, 3], 5.0), atol=0.05)


def test_copy_on_write_copies_every_layer_and_leaves_the_source():
    cache = filled()
    source = cache.k[:, 2].clone()
    cache.copy_blocks([(2, 7)])
    assert torch.equal(cache.k[:, 7], source) and torch.equal(cache.k[:, 2], source)
    assert torch.equal(cache.v[:, 7], cache.v[:, 2])


def test_flat_view_addresses_slots_by_block_and_offset():
    cache = filled()
    assert torch.equal(cache.flat_k[1, 5 * 4 + 3], cache.k[1, 5, 3])


def test_bytes_per_token_matches_smollm2_geometry():
    # 30 layers x 3 KV heads x 64 dims x K and V x 4 bytes = 45 KiB per token in fp32.
    assert KVShape(30, 3, 64).bytes_per_token(torch.float32) == 46080


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_swap_round_trip_between_gpu_and_pinned_host_memory():
    cache = filled("cuda", torch.bfloat16)
    assert cache.host_k.is_pinned()
    before = cache.k[:, [0, 4]].clone()
    cache.swap_out([(0, 1), (4, 2)])
    cache.k[:, [0, 4]] = 0
    cache.swap_in([(1, 3), (2, 5)])
    torch.cuda.synchronize()
    assert torch.equal(cache.k[:, [3, 5]], before)
