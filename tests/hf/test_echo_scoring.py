"""Completions' ``echo``, token-id prompts and batches of prompts on the in-process engine:
the prompt comes back before the completion and, with ``logprobs``, each prompt token's
log-probability under the model (what evaluation harnesses score a text by), equal to plain
transformers' over the whole prompt, however the prefill is chunked and whatever the prefix
cache holds; a batch answers each prompt as a request of its own would."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from kvstream.hf.prompt_scores import PromptScores  # noqa: E402
from kvstream.hf.sampling import SamplingParams, TokenLogprobs  # noqa: E402
from kvstream.scheduler import Sequence  # noqa: E402

TEXT = "The knight rode through the forest and met a dragon who spoke in riddles. " * 4


def reference_scores(smollm2, ids: list[int]) -> list[float]:
    """log p(ids[i + 1] | ids[: i + 1]) from plain transformers, one forward over the prompt."""
    _, reference_model, _ = smollm2
    with torch.no_grad():
        logits = reference_model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def test_prompt_scores_survive_chunked_prefill_and_ignore_the_prefix_cache(smollm2):
    tokenizer = smollm2[2]
    ids = list(tokenizer(TEXT).input_ids)
    assert len(ids) > 60
    engine = ModelRunner(smollm2[0], tokenizer, RunnerConfig(
        block_size=8, num_blocks=64, num_cpu_blocks=0, max_num_batched_tokens=16, debug_invariants=True))
    engine.generate_sync([list(ids)], SamplingParams(max_tokens=1, temperature=0))  # the prompt is now cached

    events: list = []
    scored = Sequence(list(ids), 0)
    engine.add_request(scored, SamplingParams(max_tokens=0, prompt_logprobs=2), events.extend)
    while engine.has_work():
        engine.step()
    assert scored.num_cached_tokens == 0  # computed whole, in chunks of 16
    [prompt] = [e for e in events if e.kind == "prompt"]
    assert [e.kind for e in events if e.kind != "admitted"] == ["prompt", "token"]
    assert events[-1].token_id is None and events[-1].finish_reason == "length"
    expected = reference_scores(smollm2, ids)
    got = [entry.logprob for entry in prompt.prompt_logprobs]
    assert got == pytest.approx(expected, abs=1e-3)
    assert all(len(entry.top) == 2 and entry.top[0][1] >= entry.logprob - 1e-6 for entry in prompt.prompt_logprobs)

    # Its blocks were cached as they were computed: the next plain request reuses them.
    again = Sequence(list(ids), 1)
    engine.add_request(again, SamplingParams(max_tokens=1, temperature=0), lambda _: None)
    engine.step()
    assert again.num_cached_tokens >= len(ids) - 8
    while engine.has_work():
        engine.step()
    assert engine.is_idle()


def test_kept_scores_cover_whole_blocks_and_the_next_blocks_first_token():
    store = PromptScores(block_size=4, salt=b"model", max_blocks=3)
    prompt = list(range(100, 114))  # 3 full blocks of 4, and 2 tokens
    store.keep(prompt, None, [TokenLogprobs(-float(t), []) for t in prompt[1:]])  # entry i: token i + 1
    assert len(store) == 3
    # Blocks 0 and 1 shared, block 2 not: reuse block 0, scores of tokens 1..4 (token 4 from block 1).
    other = prompt[:9] + [7, 7, 7, 7, 7]
    assert [e.logprob for e in store.known_prefix(other, None)] == [-float(t) for t in prompt[1:5]]
    assert len(store.known_prefix(prompt, None)) == 8  # three kept: two reused
    assert len(store.known_prefix(prompt[:8], None)) == 4  # the prompt's last token is always computed
    assert store.known_prefix(prompt[:5], None) == [] and store.known_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9], None) == []
    assert store.known_prefix(prompt, b"\x02" * 16) == []  # another tenant's chain
    store.keep([5] * 8, None, [TokenLogprobs(-1.0, [])] * 7)  # two more blocks: the least recent go
    assert len(store) == 3 and len(store.known_prefix(prompt, None)) == 0


def test_a_scored_prompt_reuses_a_prefix_whose_scores_are_kept(smollm2):
    """Few-shot evaluation: every question shares a long prefix. The first scored prompt
    keeps its blocks' scores; the next takes the shared blocks' KV from the prefix cache and
    their scores from what was kept (all but the last kept block: the token after the
    reused prefix is scored from that block's kept entry), and its scores are still plain
    transformers' over the whole prompt."""
    tokenizer = smollm2[2]
    shared = list(tokenizer(TEXT).input_ids)
    first, second = shared + list(tokenizer(" Is it a dragon?").input_ids), shared + list(tokenizer(" Who rode?").input_ids)
    engine = ModelRunner(smollm2[0], tokenizer, RunnerConfig(
        block_size=8, num_blocks=64, num_cpu_blocks=0, max_num_batched_tokens=32, debug_invariants=True))

    def score(prompt: list[int], k: int) -> tuple[Sequence, list]:
        events: list = []
        seq = Sequence(list(prompt), 0)
        engine.add_request(seq, SamplingParams(max_tokens=0, prompt_logprobs=k), events.extend)
        while engine.has_work():
            engine.step()
        [scores] = [e.prompt_logprobs for e in events if e.kind == "prompt"]
        return seq, scores

    seq, scores = score(first, 0)
    assert seq.num_cached_tokens == 0 and len(engine.prompt_scores) == len(first) // 8
    assert all(s.top == [] for s in scores)  # five alternatives are kept, none asked for
    computed = engine.counters.prefill_tokens
    seq, scores = score(second, 3)
    kept_blocks = len(shared) // 8  # the blocks wholly inside the shared prefix
    assert seq.num_cached_tokens == (kept_blocks - 1) * 8
    assert engine.counters.prefill_tokens - computed == len(second) - seq.num_cached_tokens
    assert [s.logprob for s in scores] == pytest.approx(reference_scores(smollm2, second), abs=1e-3)
    assert all(len(s.top) == 3 for s in scores)
    # Another tenant's chain shares nothing: computed whole.
    events: list = []
    other = Sequence(list(second), 0, cache_root=b"\x01" * 16)
    engine.add_request(other, SamplingParams(max_tokens=0, prompt_logprobs=0), events.extend)
    while engine.has_work():
        engine.step()
    assert other.num_cached_tokens == 0
    assert engine.is_idle()


def test_scoring_rows_per_step_are_bounded_and_shared(smollm2):
    """Each scored position holds a row of logits: one step scores at most ``score_rows`` of
    them across its requests (the rest wait for later steps), and the scores do not change."""
    tokenizer = smollm2[2]
    ids = list(tokenizer(TEXT).input_ids)
    engine = ModelRunner(smollm2[0], tokenizer, RunnerConfig(
        block_size=8, num_blocks=64, num_cpu_blocks=0, max_num_batched_tokens=256, debug_invariants=True))
    engine.score_rows = 24
    prompts = [list(ids), list(ids[:40])]
    events: list[list] = [[], []]
    for prompt, sink in zip(prompts, events, strict=True):
        engine.add_request(Sequence(prompt, 2), SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0), sink.extend)
    steps = 0
    while engine.has_work():
        before = engine.counters.prefill_tokens
        engine.step()
        assert engine.counters.prefill_tokens - before <= 24
        steps += 1
    assert steps >= (len(ids) + 40) // 24
    for prompt, sink in zip(prompts, events, strict=True):
        [scores] = [e.prompt_logprobs for e in sink if e.kind == "prompt"]
        assert [s.logprob for s in scores] == pytest.approx(reference_scores(smollm2, prompt), abs=1e-3)
        assert all(s.top == [] for s in scores)
        assert len([e for e in sink if e.kind == "token"]) == 2
    assert engine.is_idle()


async def test_echo_returns_the_prompt_with_its_scores(oa, smollm2):
    tokenizer = smollm2[2]
    ids = list(tokenizer(TEXT).input_ids)
    await oa.completions.create(model="smollm2", prompt=TEXT, max_tokens=1)  # caches the prompt
    scored = await oa.completions.create(model="smollm2", prompt=TEXT, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert "".join(lp.tokens) == TEXT and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(reference_scores(smollm2, ids), abs=1e-3)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]

    # The same prompt as token ids (bare, and as the API's batch of one): the same scores,
    # most of them kept from the first time (the status says how many).
    for prompt in (ids, [ids]):
        by_ids = await oa.completions.create(model="smollm2", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        assert by_ids.choices[0].text == TEXT
        assert by_ids.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)
    async with aiohttp.ClientSession() as http, http.get(str(oa.base_url).removesuffix("/v1/") + "/status") as resp:
        kept = (await resp.json())["backend"]["prompt_scores"]
    assert kept["kept_blocks"] == len(ids) // 16 and kept["kept_score_tokens"] >= 2 * (len(ids) // 16 - 1) * 16
    assert kept["scored_tokens"] >= len(ids) - 1

    # Echo and a completion: the prompt, then what a plain request generates (greedy).
    plain = await oa.completions.create(model="smollm2", prompt=TEXT, max_tokens=4, temperature=0, logprobs=0)
    both = await oa.completions.create(model="smollm2", prompt=TEXT, max_tokens=4, temperature=0, echo=True, logprobs=0)
    assert both.choices[0].text == TEXT + plain.choices[0].text
    assert both.usage.completion_tokens == plain.usage.completion_tokens == 4
    assert both.choices[0].logprobs.tokens == lp.tokens + plain.choices[0].logprobs.tokens
    assert both.choices[0].logprobs.text_offset[len(ids)] == len(TEXT)
    echo_only = await oa.completions.create(model="smollm2", prompt=ids[:5], max_tokens=3, temperature=0, echo=True)
    assert echo_only.choices[0].logprobs is None and echo_only.choices[0].text.startswith(tokenizer.decode(ids[:5]))

    # Streamed: the prompt first, then the tokens; joined, the same text and scores.
    stream = await oa.completions.create(
        model="smollm2", prompt=TEXT, max_tokens=4, temperature=0, echo=True, logprobs=0, stream=True)
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].text == TEXT
    assert "".join(c.choices[0].text for c in chunks if c.choices) == both.choices[0].text
    assert [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs] == \
        both.choices[0].logprobs.token_logprobs


async def test_echo_with_several_choices_echoes_each(oa):
    reply = await oa.completions.create(model="smollm2", prompt="Roses are red,", max_tokens=3, n=2, echo=True, seed=7)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert all(c.text.startswith("Roses are red,") for c in reply.choices)
    assert reply.usage.completion_tokens == 6


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1, 2, 10**9]}, "prompt"),  # past the vocabulary
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["x"] * 129}, "prompt"),  # at most 128 prompts
        ({"prompt": ["x"] * 64, "n": 3}, ""),  # and at most 128 choices in all
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"prompt": "hi", "max_tokens": 0, "echo": True, "n": 2}, "n"),
        ({"prompt": "hi", "echo": "yes"}, "echo"),
    ],
)
async def test_bad_prompts_and_echo_values_are_400s_naming_the_field(hf_proxy, body, param):
    async with aiohttp.ClientSession() as http, http.post(hf_proxy.v1 + "/completions", json={"model": "smollm2", **body}) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400, error
        assert error["param"].startswith(param) and error["type"] == "invalid_request_error"


async def test_chat_does_not_echo(oa):
    with pytest.raises(openai.BadRequestError, match="echo"):
        await oa.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"echo": True})


async def test_a_batch_of_prompts_answers_each_as_alone(oa, smollm2):
    """The API's batch form: choices numbered prompt by prompt (i * n + j), each prompt's the
    same as its own request's, usage summed; streamed or not; token ids and echo too (what
    lm-eval's local-completions sends with batch_size > 1)."""
    tokenizer = smollm2[2]
    texts = ["The sky is", "Roses are red,", "1, 2, 3,"]
    alone = [await oa.completions.create(model="smollm2", prompt=t, max_tokens=5, temperature=0) for t in texts]
    batch = await oa.completions.create(model="smollm2", prompt=texts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)

    stream = await oa.completions.create(model="smollm2", prompt=texts, max_tokens=5, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)}
    assert streamed == {i: a.choices[0].text for i, a in enumerate(alone)}
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finishes) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    ids = [list(tokenizer(t).input_ids) for t in texts]
    scored = await oa.completions.create(model="smollm2", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    for choice, prompt in zip(scored.choices, ids, strict=True):
        own = await oa.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
        assert choice.text == own.choices[0].text
        assert choice.logprobs.token_logprobs == pytest.approx(own.choices[0].logprobs.token_logprobs, abs=1e-4)


async def test_a_batch_with_one_bad_prompt_is_a_400_and_holds_nothing(hf_proxy):
    """The second prompt is refused after the first was submitted: the first is released."""
    body = {"model": "smollm2", "prompt": [[1, 2, 3], [1, 10**9]], "max_tokens": 2}
    async with aiohttp.ClientSession() as http, http.post(hf_proxy.v1 + "/completions", json=body) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "prompt"
    assert hf_proxy.engine.scheduler.bm.is_idle() and not hf_proxy.engine._generations
