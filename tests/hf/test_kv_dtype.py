"""A half-precision KV pool under a float32 model (``memory.kv_dtype``): the native kernel
reads it widened exactly, so it gives what it gives on the pool's float32 copy bit for bit;
K/V are rounded once, as written; the engine, the tier probe, the pool's sizing and the
prefix cache's identity follow the setting."""

from __future__ import annotations

import pytest

from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf import native_attention  # noqa: E402
from tests.hf.conftest import PROMPTS, built_kernel  # noqa: E402
from tests.hf.test_native_attention import make_case, reference  # noqa: E402

HALF = [torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def kernel():
    built_kernel(native_attention.load, "the native attention kernel")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (2, 1, 20, 5)])
def test_a_half_pool_reads_as_its_float32_copy_bit_for_bit(kernel, dtype, heads, kv_heads, dim, block_size):
    """Decodes and a prefill chunk's tiled rows; head dim 20 takes the scalar path."""
    q, k_pool, v_pool, tables, lens = make_case(heads, kv_heads, dim, block_size, [1, 7, 33, 70, 70, 71])
    k_half, v_half = k_pool.to(dtype), v_pool.to(dtype)
    got = native_attention.paged_decode(q, k_half, v_half, tables, lens, block_size, None)
    assert torch.equal(got, native_attention.paged_decode(q, k_half.float(), v_half.float(), tables, lens, block_size, None))
    expected = reference(q, k_half.float(), v_half.float(), tables, lens, block_size, dim**-0.5)
    assert float((got - expected).abs().max()) < 1e-5


@pytest.mark.parametrize("dtype", HALF)
def test_writing_into_a_half_pool_rounds_as_to_does(kernel, dtype):
    generator = torch.Generator().manual_seed(2)
    key, value = torch.randn(3, 5, 64, generator=generator) * 300, torch.randn(3, 5, 64, generator=generator)
    slots = torch.tensor([3, 9, 0, 39, 12])
    k_pool, v_pool = torch.zeros(40, 3, 64, dtype=dtype), torch.zeros(40, 3, 64, dtype=dtype)
    native_attention.write_kv(k_pool, v_pool, slots, key, value)
    assert torch.equal(k_pool, torch.zeros_like(k_pool).index_copy_(0, slots, key.transpose(0, 1).to(dtype)))
    assert torch.equal(v_pool, torch.zeros_like(v_pool).index_copy_(0, slots, value.transpose(0, 1).to(dtype)))
    with pytest.raises(RuntimeError, match="K and V alike"):
        native_attention.write_kv(k_pool, v_pool.float(), slots, key, value)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_engine_runs_a_half_pool_under_each_tier_with_the_same_tokens(smollm2, kernel, dtype):
    """The native tier (in place) and sdpa (gathered, upcast) read the same half-precision
    K/V: greedy tokens agree; the pool is half-precision and the cache identity says so."""
    from kvstream.hf.model_runner import ModelRunner, RunnerConfig
    from kvstream.hf.sampling import SamplingParams

    model, _, tokenizer = smollm2
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:4]]
    outputs = {}
    for tier in ("native", "sdpa"):
        runner = ModelRunner(model, tokenizer, RunnerConfig(block_size=16, num_blocks=64, num_cpu_blocks=0, attention=tier,
                                                            kv_dtype=dtype, model_identity="hf:test"))
        assert runner.attention.name == tier and runner.cache.k.dtype == getattr(torch, dtype)
        assert runner.config.model_identity == f"hf:test:kv={dtype}"
        outputs[tier] = runner.generate_sync(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert outputs["native"] == outputs["sdpa"] and all(outputs["native"])
    with pytest.raises(ValueError, match="kv_dtype 'int8' is not one of float32, float16, bfloat16"):
        ModelRunner(model, tokenizer, RunnerConfig(block_size=16, num_blocks=64, num_cpu_blocks=0, kv_dtype="int8"))


def test_a_kv_dtype_that_is_not_one_is_refused_before_the_model_loads(monkeypatch):
    from kvstream.hf import library

    monkeypatch.setattr(library, "load_model", lambda *a, **k: pytest.fail("loaded a model for a bad kv_dtype"))
    for bad in ("int8", "half", "Float16"):
        with pytest.raises(ValueError, match=f"kv_dtype '{bad}' is not one of float32, float16, bfloat16"):
            library.HFEngine.from_pretrained(kv_dtype=bad)


async def test_the_setting_halves_the_pool_s_bytes_per_token_and_status_says_so(kernel):
    from kvstream.hf.backend import HFBackend
    from tests.conftest import make_settings

    described = {}
    for kv in ("auto", "float16"):
        settings = make_settings(backend={"type": "hf", "device": "cpu"}, memory={"kv_cache_bytes": 64 * 2**20, "kv_dtype": kv})
        backend = HFBackend(None, None, settings)
        await backend.start()
        try:
            described[kv] = backend.describe() | {"blocks": backend.runner.config.num_blocks}
        finally:
            await backend.close()
    assert described["auto"]["kv_dtype"] == "float32" and described["float16"]["kv_dtype"] == "float16"
    assert described["float16"]["dtype"] == described["auto"]["dtype"] == "float32"
    assert described["float16"]["blocks"] == 2 * described["auto"]["blocks"]
    assert described["float16"]["kv_device_bytes"] == described["auto"]["kv_device_bytes"]
    assert described["float16"]["attention_backend"] == "native"
