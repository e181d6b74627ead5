"""The flash tier's Triton kernel (kvstream/hf/flash.py) against the eager reference.

Without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``: the same
program, each block's operations done with numpy on the CPU), so what is tested here is its
arithmetic: the block-table lookups, the bottom-right causal mask, GQA packing, the online
softmax, padding of head dims and of tiles, split decodes. Its compiled form is checked by
compiling every variant to cubins for two GPU architectures (tests/hf/triton_aot.py, no GPU
needed); its numerics on tensor cores and its speed only on a CUDA machine: the ``gpu``
tests below (skipped without one), the random Llama's test (which runs compiled there) and
``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import require_import

torch = require_import("torch")
require_import("triton")

from kvstream.hf import attention_tiers, flash  # noqa: E402
from kvstream.hf.attention import AttentionPlan, eager_attention, paged_attention  # noqa: E402
from kvstream.hf.kv_cache import KVShape, PagedKVCache  # noqa: E402
from tests.hf.tiny_models import tiny_llama  # noqa: E402

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def interpreted():
    """Without a GPU the kernel runs under Triton's interpreter, which tests/conftest.py turns
    on before anything imports Triton."""
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)")


def device() -> torch.device:
    return torch.device("cuda" if CUDA else "cpu")


def step(rows, block_size, num_heads, kv_heads, head_dim, dtype, seed=0):
    """A pool with random cached K/V and a packed step over it: per sequence (tokens in the
    pool, new tokens), tables shuffled over the pool. Returns the pool, the sequences and the
    step's q/k/v as transformers passes them ([1, H, T, D])."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-(cached + new) // block_size) for cached, new in rows]
    cache = PagedKVCache(KVShape(1, kv_heads, head_dim), sum(blocks) + 3, block_size, 0, dtype, device())
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator).to(dtype))
    order = torch.randperm(cache.num_blocks, generator=generator).tolist()
    seqs, used = [], 0
    for (cached, new), count in zip(rows, blocks, strict=True):
        seqs.append((order[used : used + count], cached, new))
        used += count
    tokens = sum(new for _, new in rows)

    def rand(heads):
        return torch.randn(1, heads, tokens, head_dim, generator=generator).to(dtype).to(device())

    return cache, seqs, rand(num_heads), rand(kv_heads), rand(kv_heads)


def reference(cache, seqs, q, k_new, v_new):
    """Eager attention, fp32, per sequence over its context gathered in Python from the
    tables (the new K/V placed at their positions): nothing shared with the kernel's path."""
    bs = cache.block_size
    k_pool = cache.k[0].reshape(-1, *cache.k.shape[-2:]).float().cpu().clone()
    v_pool = cache.v[0].reshape(-1, *cache.v.shape[-2:]).float().cpu().clone()
    q, k_new, v_new = q.float().cpu(), k_new.float().cpu(), v_new.float().cpu()
    outputs, row = [], 0
    for table, cached, new in seqs:
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(cached + new)])
        k_pool[slots[cached:]] = k_new[0, :, row : row + new].transpose(0, 1)
        v_pool[slots[cached:]] = v_new[0, :, row : row + new].transpose(0, 1)
        keys = k_pool[slots].transpose(0, 1)[None]
        values = v_pool[slots].transpose(0, 1)[None]
        out = eager_attention(q[:, :, row : row + new], keys, values, None, True, None)
        outputs.append(out[0].transpose(0, 1))
        row += new
    return torch.cat(outputs)


class _Layer(torch.nn.Module):
    """What paged_attention reads of a decoder layer's attention module."""

    layer_idx = 0


MIXED = ((19, 5), (1, 70), (0, 6), (33, 1), (15, 1), (2, 1), (0, 1))


@pytest.mark.parametrize("num_heads, kv_heads, head_dim, block_size", [
    (9, 3, 64, 16),  # SmolLM2-135M
    (8, 8, 128, 4),  # no GQA, head dim 128, small blocks
    (4, 1, 64, 8),  # one KV head for four query heads
    (14, 2, 96, 16),  # a group of 7 and a head dim that is not a power of two (padded)
])
def test_mixed_prefill_and_decode_rows_match_eager(num_heads, kv_heads, head_dim, block_size):
    """One packed step holding a chunk after cached tokens, a longer chunk spanning several
    key tiles, a whole prompt and decodes whose contexts end mid-block, at a block's end and
    in the first block; tables shuffled over the pool."""
    cache, seqs, q, k, v = step(MIXED, block_size, num_heads, kv_heads, head_dim, torch.float32)
    expected = reference(cache, seqs, q, k, v)
    plan = AttentionPlan.build(cache, seqs, "flash", num_heads)
    with torch.inference_mode():
        out = paged_attention(_Layer(), q, k, v, None, None, kvstream_plan=plan)[0][0]
    assert out.shape == (q.shape[2], num_heads, head_dim)
    torch.testing.assert_close(out.float().cpu(), expected.cpu(), atol=1e-5, rtol=1e-5)


def test_long_contexts_over_many_key_tiles_and_decodes_alone():
    """A decode-only step (one program per sequence) over contexts of several key tiles."""
    rows = ((300, 1), (129, 1), (64, 1), (63, 1))
    cache, seqs, q, k, v = step(rows, 16, 9, 3, 64, torch.float32, seed=1)
    plan = AttentionPlan.build(cache, seqs, "flash", 9)
    assert [(launch.rows, launch.splits) for launch in plan.flash.launches] == [(16, 1)]  # decodes only: 16-row programs
    with torch.inference_mode():
        out = paged_attention(_Layer(), q, k, v, None, None, kvstream_plan=plan)[0][0]
    torch.testing.assert_close(out.cpu(), reference(cache, seqs, q, k, v).cpu(), atol=1e-5, rtol=1e-5)


def test_how_many_splits_decodes_take():
    """Enough programs to fill the device, never splits of fewer than MIN_SPLIT_KEYS keys."""
    assert flash.key_splits(programs=24, longest=2000, device_processors=132) == 4  # 2,000 keys: 4 x 500
    assert flash.key_splits(programs=24, longest=20000, device_processors=132) == 16  # 264 programs wanted
    assert flash.key_splits(programs=48, longest=300, device_processors=132) == 1  # too short to split
    assert flash.key_splits(programs=512, longest=8000, device_processors=132) == 1  # the device is full
    assert flash.key_splits(programs=1, longest=10**6, device_processors=132) == flash.MAX_SPLITS
    assert flash.key_splits(programs=3, longest=8000, device_processors=1) == 1  # a CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_decodes_match_eager(monkeypatch, dtype):
    """Decodes whose keys are split over several programs and combined (flash-decoding), some
    splits reading no key at all (contexts shorter than the longest), beside a prefill chunk
    that does not split."""
    monkeypatch.setattr(flash, "processors", lambda device: 64)
    monkeypatch.setattr(flash, "MIN_SPLIT_KEYS", 16)
    rows = ((300, 1), (129, 1), (64, 1), (5, 1), (40, 20))
    cache, seqs, q, k, v = step(rows, 16, 9, 3, 64, dtype, seed=4)
    plan = AttentionPlan.build(cache, seqs, "flash", 9)
    decodes, chunk = plan.flash.launches
    assert (decodes.splits, decodes.split_keys, chunk.splits) == (16, 64, 1)
    with torch.inference_mode():
        out = paged_attention(_Layer(), q, k, v, None, None, kvstream_plan=plan)[0][0]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), reference(cache, seqs, q, k, v).cpu(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.float32])
def test_half_precision_queries_and_pools(pool_dtype):
    """float16 queries over a float16 or float32 pool (kv_dtype apart from the model's): the
    kernel reads the pool's dtype and computes in the queries'."""
    cache, seqs, q, k, v = step(MIXED, 16, 9, 3, 64, pool_dtype, seed=2)
    q = q.half()
    expected = reference(cache, seqs, q, k, v)
    plan = AttentionPlan.build(cache, seqs, "flash", 9)
    with torch.inference_mode():
        out = paged_attention(_Layer(), q, k.half(), v.half(), None, None, kvstream_plan=plan)[0][0]
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float().cpu(), expected.cpu(), atol=2e-2, rtol=2e-2)


def test_the_plan_tiles_chunks_by_the_group_and_writes_every_new_token():
    cache = PagedKVCache(KVShape(1, 3, 64), 32, 16, 0, torch.float32, torch.device("cpu"))
    seqs = [([5, 6, 7], 30, 1), ([1, 2], 0, 22), ([9], 3, 1)]
    plan = AttentionPlan.build(cache, seqs, "flash", 9)
    decodes, chunks = plan.flash.launches
    assert (decodes.rows, decodes.seqs.tolist(), decodes.splits) == (16, [0, 2], 1)
    # 64-row programs hold 21 queries of a group of three: the 22-token prompt takes two.
    assert (chunks.rows, chunks.seqs.tolist(), chunks.firsts.tolist()) == (64, [1, 1], [0, 21])
    assert plan.flash.starts.tolist() == [0, 1, 23] and plan.flash.cached.tolist() == [30, 0, 3]
    assert plan.write_slots.tolist() == [6 * 16 + 14, *range(16, 38), 9 * 16 + 3]
    with pytest.raises(ValueError, match="query_heads"):
        AttentionPlan.build(cache, seqs, "flash")


def test_the_plans_index_tensors_start_16_bytes_apart_and_warm_up_runs_every_variant(monkeypatch):
    """Triton specializes a kernel on each pointer's 16-byte alignment: the plan's tensors,
    one copy cut in parts, all start aligned whatever the step's sizes, so that steps do not
    compile new variants. ``warm_up`` launches every split count and a chunk."""
    cache = PagedKVCache(KVShape(1, 3, 64), 32, 16, 0, torch.float32, torch.device("cpu"))
    for seqs in ([([1, 2, 3], 33, 1)], [([5, 6, 7], 30, 1), ([1, 2], 0, 22), ([9], 3, 1)], [([4], 0, 7)]):
        plan = AttentionPlan.build(cache, seqs, "flash", 9).flash
        tensors = [plan.tables, plan.cached, plan.starts, plan.lengths] + [t for launch in plan.launches
                                                                            for t in (launch.seqs, launch.firsts)]
        assert all(tensor.data_ptr() % 16 == 0 for tensor in tensors)
    launched = []
    real = flash.attention
    monkeypatch.setattr(flash, "attention", lambda q, k, v, plan, *rest: launched.append(
        [(launch.rows, launch.splits) for launch in plan.launches]) or real(q, k, v, plan, *rest))
    flash.warm_up(9, 3, 64, torch.float32, torch.float32, device(), 16)
    assert launched == [[(16, n)] for n in (1, 2, 4, 8, 16, 32)] + [[(64, 1)]]


def test_the_tier_is_chosen_by_its_probe_where_it_runs(monkeypatch):
    """The probe that picks tiers at start runs the kernel like any other candidate; here the
    interpreter stands in for a GPU (flash is CUDA only in a real engine)."""
    monkeypatch.setattr(attention_tiers, "unsupported", lambda name, dtype, dev: None)
    choice = attention_tiers.choose_tier("auto", 9, KVShape(2, 3, 64), torch.float32, device(), 16)
    assert choice.name == "flash" and choice.why_not == {}
    # On a GPU the probe's longest decode splits its keys: the split path is checked at start too.
    decodes = [cached + 1 for cached, new in attention_tiers.probe_rows(16) if new == 1]
    assert flash.key_splits(len(decodes) * 3, max(decodes), 132) > 1


def test_without_triton_the_tier_says_so(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "triton":
            raise ImportError("No module named 'triton'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    assert flash.available() == "needs triton (it ships with torch's CUDA builds)"
    assert attention_tiers.unsupported("flash", torch.float16, torch.device("cuda")) == flash.available()


def test_greedy_tokens_match_generate_through_the_engine(smollm2, monkeypatch):
    """SmolLM2 through the engine with the flash tier (interpreted on CPU): the same greedy
    tokens as ``model.generate``, with a prompt prefilled in two chunks beside a decode."""
    from kvstream.hf.model_runner import ModelRunner, RunnerConfig
    from kvstream.hf.sampling import SamplingParams

    model, reference_model, tokenizer = smollm2
    monkeypatch.setattr(attention_tiers, "unsupported", lambda name, dtype, dev: None)
    prompts = [tokenizer("The capital of France is")["input_ids"],
               tokenizer("List three colours of the rainbow, then name one fruit of each colour:")["input_ids"]]
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = reference_model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                                           pad_token_id=tokenizer.eos_token_id)
            expected.append(out[0, len(ids):].tolist())
    config = RunnerConfig(block_size=4, num_blocks=64, num_cpu_blocks=0, max_num_seqs=4, attention="flash",
                          max_num_batched_tokens=12, enable_prefix_caching=False, debug_invariants=True)
    engine = ModelRunner(model, tokenizer, config)
    assert engine.attention.name == "flash"
    assert engine.generate_sync(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_compiled_on_the_gpu_matches_eager(dtype):
    tolerance = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4}[dtype]
    rows = ((2000, 1), (1500, 1), (700, 1), (0, 300), (511, 129), (17, 1))
    cache, seqs, q, k, v = step(rows, 16, 32, 8, 128, dtype, seed=3)
    expected = reference(cache, seqs, q, k, v)
    plan = AttentionPlan.build(cache, seqs, "flash", 32)
    with torch.inference_mode():
        out = paged_attention(_Layer(), q, k, v, None, None, kvstream_plan=plan)[0][0]
    torch.testing.assert_close(out.float().cpu(), expected.cpu(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if CUDA else [torch.float32])
def test_a_random_llama_through_the_engine_matches_generate(dtype, monkeypatch):
    """Greedy tokens of the engine under the flash tier equal ``model.generate``'s, prompts of
    several lengths batched with chunked prefill; on a GPU, ``auto`` picks flash by itself."""
    from kvstream.hf.model_runner import ModelRunner, RunnerConfig
    from kvstream.hf.sampling import SamplingParams

    model, tokenizer = tiny_llama(device(), dtype)
    if not CUDA:
        monkeypatch.setattr(attention_tiers, "unsupported", lambda name, dtype, dev: None)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (length,), generator=generator).tolist() for length in (3, 17, 40, 90)]
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids], device=device()), max_new_tokens=6, do_sample=False, pad_token_id=1)
            expected.append(out[0, len(ids):].tolist())
    config = RunnerConfig(block_size=16, num_blocks=64, num_cpu_blocks=0, max_num_seqs=8, attention="auto",
                          max_num_batched_tokens=48, enable_prefix_caching=False, debug_invariants=True)
    engine = ModelRunner(model, tokenizer, config)
    assert engine.attention.name == "flash", engine.attention.why_not
    outputs = engine.generate_sync(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    if dtype == torch.float32:
        assert outputs == expected
    else:  # other kernels in half precision: the first tokens, where ties are rare
        assert sum(o[:3] == e[:3] for o, e in zip(outputs, expected, strict=True)) >= len(expected) - 1


def test_every_kernel_variant_compiles_for_hopper_and_ampere_gpus():
    """The kernels through Triton's whole compiler, ptxas included, to cubins for sm_90 (the
    H100/H200) and sm_86 (consumer Ampere, the least shared memory a block may have), with no
    GPU: each variant compiles and fits its block's shared memory."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, said outright (it warns otherwise)
    done = subprocess.run([sys.executable, "-m", "tests.hf.triton_aot", "--flash", "90", "86"], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(compiled) == 2 * 24
    assert {row["arch"] for row in compiled} == {90, 86}
    for row in compiled:
        assert 0 < row["cubin_bytes"] and row["shared_bytes"] <= row["shared_limit"], row
