"""Greedy outputs of the paged engine are token-identical to ``model.generate`` on the real
SmolLM2: alone, batched with mixed lengths, with prefix-cache hits, chunked prefill, and
after swap and recompute preemptions. Every invariant is checked after every step."""

from __future__ import annotations

import pytest

from tests.conftest import require_import

from tests.hf.conftest import chat_prompts

torch = require_import("torch")

from kvstream.hf.model_runner import RunnerConfig, ModelRunner  # noqa: E402
from kvstream.hf.sampling import SamplingParams  # noqa: E402

@pytest.fixture(autouse=True)
def in_place_at_every_context(monkeypatch):
    """auto runs native here (it reads the pool in place at every step); flex, asked for by
    name below, is made to read in place at every step too, not only past
    IN_PLACE_MIN_CONTEXT tokens of decode context (which these prompts never reach); the
    sdpa tier test checks the gather."""
    from kvstream.hf import flex

    monkeypatch.setattr(flex, "IN_PLACE_MIN_CONTEXT", 0)


NEW_TOKENS = 20
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)


@pytest.fixture(scope="session")
def prompts(smollm2):
    return chat_prompts(smollm2[2])


@pytest.fixture(scope="session")
def golden(smollm2, prompts):
    """model.generate's greedy continuation of each prompt, cut after the first EOS."""
    _, reference, tokenizer = smollm2
    eos = reference.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )[0, len(ids) :].tolist()
            cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
            outputs.append(out[:cut])
    return outputs


def make_engine(smollm2, **overrides) -> ModelRunner:
    config = RunnerConfig(block_size=4, num_blocks=512, num_cpu_blocks=128, max_num_seqs=32, debug_invariants=True)
    for key, value in overrides.items():
        setattr(config, key, value)
    return ModelRunner(smollm2[0], smollm2[2], config)


def test_alone_each_prompt_matches_generate(smollm2, prompts, golden):
    engine = make_engine(smollm2, enable_prefix_caching=False)
    for ids, expected in zip(prompts, golden, strict=True):
        assert engine.generate_sync([ids], GREEDY) == [expected]
    assert engine.is_idle()


def test_batch_of_mixed_lengths_matches_generate(smollm2, prompts, golden):
    engine = make_engine(smollm2, enable_prefix_caching=False)
    assert engine.generate_sync(prompts, GREEDY) == golden
    assert engine.counters.steps <= NEW_TOKENS + 1, "the batch ran one request after another"
    assert engine.is_idle()


def test_prefix_cache_hits_give_the_same_tokens(smollm2, prompts, golden):
    engine = make_engine(smollm2)
    engine.generate_sync(prompts, GREEDY)
    before = engine.counters.cached_tokens
    assert engine.generate_sync(prompts, GREEDY) == golden
    hit = engine.counters.cached_tokens - before
    # Every prompt's full blocks, short of the last token, come from the cache.
    assert hit == sum((len(p) - 1) // 4 * 4 for p in prompts)
    assert engine.is_idle()


def test_chunked_prefill_gives_the_same_tokens(smollm2, prompts, golden):
    engine = make_engine(smollm2, max_num_batched_tokens=37, enable_prefix_caching=False)
    assert engine.generate_sync(prompts, GREEDY) == golden
    assert engine.is_idle()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_round_trip_gives_the_same_tokens(smollm2, prompts, golden, mode):
    # Room for the longest prompt and its output, not for all twenty at once.
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    engine = make_engine(smollm2, num_blocks=longest // 4 + 24, preemption_mode=mode, num_cpu_blocks=1024)
    assert engine.generate_sync(prompts, GREEDY) == golden
    stats = engine.scheduler.stats
    assert stats.preemptions > 0
    if mode == "swap":
        assert stats.swap_outs > 0 and stats.swap_ins == stats.swap_outs
    assert engine.is_idle()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_engine_matches_generate(prompts, golden):
    from kvstream.hf.loader import load_model

    loaded = load_model(None, dtype="float32", device="cuda")
    engine = ModelRunner(loaded.model, loaded.tokenizer, RunnerConfig(block_size=16, num_blocks=256, num_cpu_blocks=64, max_num_seqs=32))
    outs = engine.generate_sync(prompts, GREEDY)
    # Different kernels on another device: compare the first tokens, where ties are rare.
    assert sum(o[:4] == g[:4] for o, g in zip(outs, golden, strict=True)) >= len(golden) - 1
    assert engine.is_idle()


@pytest.mark.parametrize("tier", ["native", "flex", "sdpa", "eager"])
def test_each_attention_tier_gives_the_same_tokens(smollm2, prompts, golden, tier):
    """The tests above run auto (native where the C++ kernel builds, reading in place); each tier
    by name here, with chunked prefills mixed into decode steps."""
    engine = make_engine(smollm2, attention=tier, max_num_batched_tokens=64)
    assert engine.attention.name == tier
    assert engine.generate_sync(prompts[:8], GREEDY) == golden[:8]


def test_prompts_that_share_a_document_and_arrive_together_compute_it_once(smollm2):
    """The second and third prompt wait while the first computes the document they share,
    then read it from the prefix cache: the same tokens as model.generate, the document's
    blocks computed once."""
    _, reference, tokenizer = smollm2
    document = tokenizer("The harbour records list every ship, its cargo, its crew and the weather. " * 8)["input_ids"]
    prompts = [document + tokenizer(f" Question {i}: which ship sailed first?")["input_ids"] for i in range(3)]
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            expected.append(out[0, len(ids) :].tolist())
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine = make_engine(smollm2, max_num_batched_tokens=64)  # the document takes several chunks
    assert engine.generate_sync(prompts, params) == expected
    shared = len(document) // 4 * 4  # full blocks of the document (block size 4)
    assert engine.counters.cached_tokens >= 2 * shared
    assert engine.counters.prefill_tokens <= sum(map(len, prompts)) - 2 * shared
    alone = make_engine(smollm2, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert alone.generate_sync(prompts, params) == expected and alone.counters.cached_tokens == 0
