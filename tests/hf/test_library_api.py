"""``kvstream.hf.HFEngine``: the engine as a library, with honest timings and reuse."""

from __future__ import annotations

import pytest

from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf.model_runner import RunnerConfig  # noqa: E402
from kvstream.hf.loader import LoadedModel  # noqa: E402
from kvstream.hf import HFEngine  # noqa: E402

SYSTEM = "You are the assistant of a small museum by the sea. Answer in one short sentence. " * 5


@pytest.fixture
def engine(smollm2):
    model, _, tokenizer = smollm2
    return HFEngine(LoadedModel(model, tokenizer, "smollm2", "hf:test"), RunnerConfig(block_size=16, num_blocks=512, num_cpu_blocks=0))


def test_warm_then_generate_reuses_the_prefix_and_answers_as_cold(engine):
    cold = engine.generate(SYSTEM + "Q: When do you open?\nA:", max_new_tokens=12)
    assert cold.cached_tokens == 0 and cold.output_text and 0 < cold.ttft_ms <= cold.total_ms
    warmed = engine.warm(SYSTEM)
    assert warmed >= 16
    hot = engine.generate(SYSTEM + "Q: When do you open?\nA:", max_new_tokens=12)
    assert hot.token_ids == cold.token_ids
    assert hot.cached_tokens >= warmed and hot.kv_reuse_ratio > 0.8


def test_chat_messages_and_batches(engine):
    messages = [{"role": "user", "content": "Name a colour."}]
    one = engine.generate(messages, max_new_tokens=8)
    batch = engine.generate_batch([messages, [{"role": "user", "content": "Name a fruit."}]], max_new_tokens=8)
    assert batch[0].token_ids == one.token_ids and len(batch) == 2  # greedy by default, as generate
    sampled = engine.generate_batch([messages] * 2, max_new_tokens=8, temperature=1.5, seed=3)
    assert sampled[0].token_ids == sampled[1].token_ids != one.token_ids  # a seed, not greedy


def test_verify_correctness_reports_exact_agreement_with_real_reuse(engine):
    report = engine.verify_correctness([SYSTEM + "Q: Is there a café?\nA:", "Write a haiku about tides."], max_new_tokens=10)
    assert report[0]["kv_reuse_ratio"] > 0.8  # reuse really happened (KVBoost's check ran at 0%)
    for row in report:
        assert row["token_agreement"] == 1.0 and row["first_divergence"] is None
        assert row["first_token_kl"] < 1e-6
