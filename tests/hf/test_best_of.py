"""Completions' ``best_of`` on the in-process engine, through the openai client: best_of
candidates generated (the prompt computed once and forked, as for n), the n with the highest
log-probability per token returned, best first; usage counts every candidate; what OpenAI
refuses is a 400 naming the field, and nothing is left held."""

from __future__ import annotations

import pytest

from tests.conftest import require_import

torch = require_import("torch")

from openai import BadRequestError  # noqa: E402

from kvstream.hf.best_of import Candidates  # noqa: E402
from kvstream.types import Token, TokenLogprob, Usage  # noqa: E402

PROMPT = "My favourite animal is"
MAX_TOKENS = 6


def mean_logprob(choice) -> float:
    scores = choice.logprobs.token_logprobs
    return sum(scores) / len(scores)


async def test_best_of_returns_the_candidates_most_likely_per_token(hf_proxy, oa):
    # The same seed draws the same candidates whether they are asked for as n or as best_of
    # (test_choices.py): all four, with their log-probabilities, are the reference. ignore_eos
    # keeps every candidate's tokens in sight (an end-of-turn token's log-probability scores
    # a candidate too, but no client sees it).
    sampling = dict(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.3, seed=11, extra_body={"ignore_eos": True})
    everyone = await oa.completions.create(model="smollm2", n=4, logprobs=0, **sampling)
    assert len({c.text for c in everyone.choices}) > 1  # they differ, so the choice is a real one
    ranked = sorted(everyone.choices, key=lambda c: (-mean_logprob(c), c.index))

    best = await oa.completions.create(model="smollm2", n=2, best_of=4, logprobs=0, **sampling)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.finish_reason for c in best.choices] == ["length", "length"]
    assert [round(mean_logprob(c), 4) for c in best.choices] == [round(mean_logprob(c), 4) for c in ranked[:2]]
    assert best.usage.completion_tokens == 4 * MAX_TOKENS  # every candidate was generated
    assert best.usage.prompt_tokens == everyone.usage.prompt_tokens
    # The answer came back whole, at the end: no first token or generation rate to time (the
    # replayed tokens would have made a rate of thousands of tokens a second).
    _, ttft, _, rate = hf_proxy.engine.stats.recent[-1]
    assert ttft is None and rate is None

    # n defaults to 1: the single best; no logprobs asked for, none returned (they were
    # computed to rank the candidates).
    one = await oa.completions.create(model="smollm2", best_of=4, **sampling)
    assert [c.text for c in one.choices] == [ranked[0].text] and one.choices[0].logprobs is None
    assert hf_proxy.engine.backend.runner.is_idle()


async def test_best_of_over_a_batch_of_prompts_picks_within_each_prompt(oa):
    prompts = ["1, 2, 3,", "The sky is"]
    sampling = dict(max_tokens=4, temperature=1.3, seed=5, extra_body={"ignore_eos": True})
    alone = [await oa.completions.create(model="smollm2", prompt=p, best_of=3, **sampling) for p in prompts]
    batch = await oa.completions.create(model="smollm2", prompt=prompts, best_of=3, **sampling)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.completion_tokens == 2 * 3 * 4


async def test_best_of_equal_to_n_streams_as_n_does(oa):
    stream = await oa.completions.create(model="smollm2", prompt="1, 2, 3,", n=2, best_of=2, max_tokens=3, temperature=0,
                                         stream=True)
    texts = {0: "", 1: ""}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1] and texts[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 3, "best_of": 2}, "at least n"),
        ({"best_of": 2, "stream": True}, "cannot be streamed"),
        ({"best_of": 0}, "best_of"),
        ({"best_of": 129}, "best_of"),
        ({"best_of": 65, "prompt": ["a", "b"]}, "prompts x best_of"),
        ({"best_of": 2, "max_tokens": 0, "echo": True}, "one choice"),
    ],
)
async def test_what_openai_refuses_of_best_of_is_a_400(hf_proxy, oa, kwargs, message):
    body = {"model": "smollm2", "prompt": "x", "max_tokens": 2} | kwargs
    with pytest.raises(BadRequestError) as err:
        await oa.completions.create(**body)
    assert err.value.status_code == 400 and message in err.value.message
    assert err.value.param in ("best_of", "prompt")
    assert hf_proxy.engine.backend.runner.is_idle() and hf_proxy.engine.scheduler.bm.is_idle()


async def test_best_of_is_a_completions_field(oa):
    with pytest.raises(BadRequestError) as err:
        await oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                         extra_body={"best_of": 2})
    assert err.value.param == "best_of" and "completions" in err.value.message


def _token(index: int, text: str = "", **fields) -> Token:
    return Token(text=text, index=index, token_logprobs=[TokenLogprob(text, -1.0, list(text.encode()))], **fields)


def test_candidates_rank_by_mean_not_total_and_end_the_stream_with_its_usage():
    """Pinned without the model: a short candidate with a lower total but a higher mean wins;
    ties go to the earlier candidate; the kept ones are reindexed, each ended; the last
    token (of a candidate not kept) gives its usage to the last kept one."""
    candidates = Candidates(keep=2, with_logprobs=False)
    for index, scores in ((0, [-1.0, -1.0, -1.0]), (1, [-0.5]), (2, [-2.0, -0.5]), (3, [-0.5])):
        for score in scores:
            candidates.score(index, score)
    for index in range(4):
        candidates.add(_token(index, f"c{index}"))
    for index in (1, 0, 3):
        candidates.add(Token(index=index, choice_finish_reason="stop" if index != 0 else "length"))
    usage = Usage(5, 7)
    out = candidates.best(Token(index=2, finish_reason="stop", usage=usage))
    assert candidates.ranking() == [1, 3, 0, 2]
    assert [(t.index, t.text, t.choice_finish_reason, t.finish_reason) for t in out] == [
        (0, "c1", None, None), (0, "", "stop", None), (1, "c3", None, None), (1, "", None, "stop")]
    assert out[-1].usage is usage
    assert [t.replayed for t in out] == [True, False, True, False]  # the ends are the engine's to count
    assert all(t.token_logprobs is None for t in out)  # not asked for: left out


async def test_a_client_leaving_while_the_candidates_run_frees_them_all(hf_proxy):
    """No answer goes out until every candidate ends: a client that leaves before then
    (its timeout) cancels all of them, and their forked blocks and slots are released."""
    import asyncio

    import aiohttp

    from tests.conftest import wait_released

    # 4 x 900 tokens fit the test pool (4,096 tokens) and take far longer than the client waits.
    body = {"model": "smollm2", "prompt": PROMPT, "best_of": 4, "n": 2, "max_tokens": 900, "temperature": 1.0,
            "ignore_eos": True}
    cancelled = hf_proxy.engine.stats.requests_cancelled
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(hf_proxy.v1 + "/completions", json=body) as response:
                await response.read()
    runner = hf_proxy.engine.backend.runner
    await wait_released(hf_proxy)
    assert hf_proxy.engine.stats.requests_cancelled == cancelled + 1  # it was running, and was cancelled
    for _ in range(100):
        if runner.is_idle():
            break
        await asyncio.sleep(0.05)
    assert runner.is_idle() and hf_proxy.engine.scheduler.bm.is_idle()
