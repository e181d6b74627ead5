"""n > 1 choices on the in-process engine: the prompt is computed once and its block table
forked (copy-on-write on each choice's first write), every choice sampled from the same
logits; through the proxy, the openai client sees n indexed choices and usage counts them all."""

from __future__ import annotations

import pytest

from tests.conftest import require_import

torch = require_import("torch")

from openai import AsyncOpenAI  # noqa: E402

from kvstream.hf import HFBackend  # noqa: E402
from kvstream.hf.loader import LoadedModel  # noqa: E402
from kvstream.hf.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from kvstream.hf.sampling import SamplingParams  # noqa: E402
from kvstream.scheduler import Sequence  # noqa: E402

PROMPT = list(range(300, 320))  # 2 full blocks of 8 and a partial one of 4


def runner(smollm2, **config) -> ModelRunner:
    return ModelRunner(smollm2[0], smollm2[2], RunnerConfig(block_size=8, num_blocks=32, num_cpu_blocks=0, debug_invariants=True, **config))


def test_the_prompt_is_computed_once_and_forked_copy_on_write(smollm2):
    engine = runner(smollm2)
    events: list = []
    seq = Sequence(list(PROMPT), 6)
    engine.add_request(seq, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), events.extend, n=3)
    bm = engine.scheduler.bm
    engine.step()  # admit, prefill the 20 prompt tokens once, fork, sample 3 first tokens
    assert engine.counters.prefill_tokens == 20
    forks = [f"{seq.seq_id}/1", f"{seq.seq_id}/2"]
    tables = [bm.tables[seq.seq_id]] + [bm.tables[f] for f in forks]
    assert [[b.block_id for b in t.blocks] for t in tables] == [[0, 1, 2]] * 3
    assert [bm.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [3, 3, 3] and bm.pool.num_used == 3
    assert sorted(e.index for e in events if e.kind == "token") == [0, 1, 2]
    engine.step()  # each choice appends its first token into the shared partial block
    # Equal arrivals append in running order: the parent and the first fork copy the shared
    # block before writing (copy-on-write); the last writer has it to itself and writes in place.
    assert [b.block_id for b in bm.tables[seq.seq_id].blocks] == [0, 1, 3]
    assert [b.block_id for b in bm.tables[forks[0]].blocks] == [0, 1, 4]
    assert [b.block_id for b in bm.tables[forks[1]].blocks] == [0, 1, 2]
    assert [bm.pool.blocks[i].ref_cnt for i in range(5)] == [3, 3, 1, 1, 1] and bm.pool.num_used == 5
    while engine.has_work():
        engine.step()
    assert engine.is_idle()
    tokens = [e for e in events if e.kind == "token"]
    per_choice = {i: [e.token_id for e in tokens if e.index == i] for i in range(3)}
    # Greedy: every choice is the one greedy continuation, as with n = 1.
    alone = runner(smollm2).generate_sync([list(PROMPT)], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert per_choice == {0: alone, 1: alone, 2: alone}


def test_choices_sample_apart_and_reproducibly_with_a_seed(smollm2):
    def run() -> dict[int, list[int]]:
        engine = runner(smollm2)
        events: list = []
        engine.add_request(Sequence(list(PROMPT), 12), SamplingParams(max_tokens=12, temperature=1.5, seed=7, ignore_eos=True), events.extend, n=3)
        while engine.has_work():
            engine.step()
        assert engine.is_idle()
        return {i: [e.token_id for e in events if e.kind == "token" and e.index == i] for i in range(3)}

    first = run()
    assert first == run()  # the same seed, the same three choices
    assert len({tuple(v) for v in first.values()}) > 1  # and they are not copies of each other


def test_forks_wait_for_batch_slots_reserved_at_admission(smollm2):
    engine = runner(smollm2, max_num_seqs=3)
    a, b = Sequence(list(PROMPT), 4), Sequence([7] * 12, 4)
    engine.add_request(a, SamplingParams(max_tokens=4, temperature=0), lambda events: None, n=3)
    engine.add_request(b, SamplingParams(max_tokens=4, temperature=0), lambda events: None)
    engine.step()
    running = [s.seq_id for s in engine.scheduler.running]
    assert running == [a.seq_id, f"{a.seq_id}/1", f"{a.seq_id}/2"]  # b waits: the 3 slots are a's
    while engine.has_work():
        engine.step()
    assert engine.is_idle()


def test_more_choices_than_the_batch_run_in_groups_from_the_cached_prompt(smollm2):
    """n past the batch: the choices that fit run at once, the rest as a group of their own
    once lanes free, each later group taking the prompt's full blocks from the prefix cache;
    choice i keeps choice i's seed, so the choices are those of the same request on a batch
    that holds them all."""

    def run(lanes: int) -> tuple[ModelRunner, dict[int, list[int]], list[int]]:
        engine = runner(smollm2, max_num_seqs=lanes)
        events: list = []
        seq = Sequence(list(PROMPT), 12)
        engine.add_request(seq, SamplingParams(max_tokens=12, temperature=1.5, seed=7, ignore_eos=True), events.extend, n=7)
        most_running = 0
        while engine.has_work():
            engine.step()
            most_running = max(most_running, len(engine.scheduler.running))
            assert all(s.seq_id == seq.seq_id or s.seq_id.startswith(seq.seq_id + "/") for s in engine.scheduler.running)
        assert engine.is_idle() and most_running <= lanes
        ended = [e.index for e in events if e.kind == "token" and e.finish_reason is not None]
        return engine, {i: [e.token_id for e in events if e.kind == "token" and e.index == i] for i in range(7)}, ended

    split, choices, ended = run(3)
    assert sorted(ended) == list(range(7)) and all(len(tokens) == 12 for tokens in choices.values())
    # Groups of 3, 3 and 1: the prompt's 2 full blocks computed once; the later groups
    # recompute only its partial last block (4 tokens) to sample their first tokens.
    assert split.counters.prefill_tokens == 20 + 4 + 4 and split.counters.cached_tokens == 16 + 16
    whole, same_request, _ = run(8)
    assert whole.counters.prefill_tokens == 20
    assert choices == same_request
    assert len({tuple(tokens) for tokens in choices.values()}) == 7


def test_a_group_finding_fewer_free_lanes_than_choices_runs_those_it_can_at_once(smollm2):
    """A request of 4 choices behind a long one on 4 lanes: 3 run at once (not after the
    long one ends), the 4th waits at the head of the queue, where a request behind it does
    not pass it, and runs when a lane frees; the seeded choices are those of a batch that
    holds them all."""
    params = SamplingParams(max_tokens=6, temperature=1.5, seed=3, ignore_eos=True)

    def run(lanes: int) -> tuple[ModelRunner, dict[int, list[int]]]:
        engine = runner(smollm2, max_num_seqs=lanes)
        engine.add_request(Sequence([5] * 9, 30), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), lambda events: None)
        engine.step()
        events: list = []
        group, behind = Sequence(list(PROMPT), 6), Sequence([9] * 11, 4)
        engine.add_request(group, params, events.extend, n=4)
        engine.add_request(behind, SamplingParams(max_tokens=4, temperature=0), lambda events: None)
        engine.step()
        if lanes == 4:
            running = {s.seq_id for s in engine.scheduler.running}
            assert {group.seq_id, f"{group.seq_id}/1", f"{group.seq_id}/2"} <= running and len(running) == 4
            assert [s.seq_id for s in engine.scheduler.waiting] == [f"{group.seq_id}/3", behind.seq_id]
        while engine.has_work():
            engine.step()
        assert engine.is_idle() and not any(e.kind == "error" for e in events)
        return engine, {i: [e.token_id for e in events if e.kind == "token" and e.index == i] for i in range(4)}

    _, split = run(4)
    _, whole = run(8)
    assert split == whole and all(len(tokens) == 6 for tokens in split.values())


@pytest.mark.parametrize("cpu_blocks", [0, 16], ids=["recompute", "swap"])
def test_choices_that_outgrow_the_pool_together_are_preempted_one_by_one_and_all_finish(smollm2, cpu_blocks):
    """Three choices of 44 tokens each (a 20-token prompt shared, 24 generated) need 92
    tokens together, more than the 64-token pool: each fits alone, so the request runs, its
    choices preempted and resumed (or recomputed) as the pool fills, and every one finishes
    with the greedy continuation."""
    engine = ModelRunner(smollm2[0], smollm2[2], RunnerConfig(block_size=8, num_blocks=8, num_cpu_blocks=cpu_blocks,
                                                             debug_invariants=True,
                                                             preemption_mode="swap" if cpu_blocks else "recompute"))
    events: list = []
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine.add_request(Sequence(list(PROMPT), 24), params, events.extend, n=3)
    while engine.has_work():
        engine.step()
    assert engine.is_idle() and not any(e.kind == "error" for e in events)
    per_choice = {i: [e.token_id for e in events if e.kind == "token" and e.index == i] for i in range(3)}
    alone = runner(smollm2).generate_sync([list(PROMPT)], params)[0]
    assert per_choice == {0: alone, 1: alone, 2: alone}
    assert engine.scheduler.stats.preemptions > 0


def test_aborting_a_request_ends_its_later_groups_too(smollm2):
    engine = runner(smollm2, max_num_seqs=2)
    events: list = []
    seq = Sequence(list(PROMPT), 50)
    engine.add_request(seq, SamplingParams(max_tokens=50, temperature=1.0, ignore_eos=True), events.extend, n=6)
    engine.step()
    assert len(engine.requests) == 4  # the first group's 2 choices, the other 4 waiting in groups of a batch
    engine.abort(seq.seq_id)
    engine.step()
    assert engine.is_idle() and not engine.requests


@pytest.fixture
async def hf_choices(smollm2, start_proxy):
    model, _, tokenizer = smollm2
    backend = HFBackend(None, None, preloaded=LoadedModel(model, tokenizer, "smollm2", "hf:test"), block_size=16, num_gpu_blocks=128, num_cpu_blocks=0)
    proxy = await start_proxy(backend)
    await proxy.engine.start()
    yield proxy
    await proxy.engine.close()


async def test_the_openai_client_gets_n_choices_with_usage_for_all(hf_choices):
    async with AsyncOpenAI(base_url=hf_choices.v1, api_key="unused", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Name a color."}], n=3, max_tokens=8, temperature=1.0, seed=3
        )
        assert [c.index for c in reply.choices] == [0, 1, 2]
        assert all(c.finish_reason in ("stop", "length") and c.message.content for c in reply.choices)
        assert 3 <= reply.usage.completion_tokens <= 24
        # Each choice may take all the pool (2,048 tokens here) or the context: n of them are n
        # sequences, preempted one by one, not one n times as long (that was a 400; so was
        # n=2 without max_tokens on the default server, "past the context").
        unbounded = await client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                                         n=2, max_tokens=2000, temperature=0, stop=[" "])
        assert [c.finish_reason for c in unbounded.choices] == ["stop", "stop"]
        stream = await client.completions.create(model="smollm2", prompt="1, 2, 3,", n=2, max_tokens=5, temperature=0, stream=True)
        texts: dict[int, str] = {0: "", 1: ""}
        finishes: dict[int, str] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
    assert texts[0] == texts[1] and texts[0]  # greedy: both choices alike
    assert finishes == {0: "length", 1: "length"}
    engine = hf_choices.engine.backend.runner
    assert engine.is_idle()


async def test_more_choices_than_the_batch_all_come_back_through_the_openai_client(hf_choices):
    """The choices of one request are forked together; more than the engine's batch run in
    groups (they waited forever once, then were a 400): the client gets every one."""
    lanes = hf_choices.engine.backend.runner.scheduler.config.max_batch_size
    async with AsyncOpenAI(base_url=hf_choices.v1, api_key="unused", max_retries=0) as client:
        reply = await client.completions.create(model="smollm2", prompt="1, 2, 3,", n=lanes + 3, max_tokens=3, temperature=1.0, seed=5)
        assert sorted(c.index for c in reply.choices) == list(range(lanes + 3))
        assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
        one = await client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=1)
        assert reply.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once, not per group
        assert lanes + 3 <= reply.usage.completion_tokens <= 3 * (lanes + 3)
        echoed = await client.completions.create(model="smollm2", prompt="1, 2, 3,", n=lanes + 1, max_tokens=2,
                                                 temperature=0, echo=True, logprobs=1)
        assert len({(c.text, tuple(c.logprobs.tokens)) for c in echoed.choices}) == 1  # greedy, and the prompt scored once
        assert echoed.choices[-1].text.startswith("1, 2, 3,") and echoed.choices[-1].logprobs.token_logprobs[0] is None
        best = await client.completions.create(model="smollm2", prompt="1, 2, 3,", n=2, best_of=lanes + 1, max_tokens=3,
                                               temperature=1.0, seed=5)
        assert sorted(c.index for c in best.choices) == [0, 1]
        stream = await client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                                      n=lanes + 2, max_tokens=3, temperature=0, stream=True)
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
                if choice.finish_reason:
                    finishes[choice.index] = choice.finish_reason
    assert sorted(finishes) == list(range(lanes + 2))
    assert len(set(texts.values())) == 1 and texts[0]  # greedy: every group's choices alike
    assert hf_choices.engine.backend.runner.is_idle()


async def test_a_client_leaving_a_request_of_several_groups_frees_every_one(hf_choices):
    """A streamed request of more choices than the batch, its later groups still queued,
    left after its first chunk: every group is aborted, the pool and queue empty, and the
    next request is served."""
    import asyncio

    runner = hf_choices.engine.backend.runner
    lanes = runner.scheduler.config.max_batch_size
    async with AsyncOpenAI(base_url=hf_choices.v1, api_key="unused", max_retries=0) as client:
        stream = await client.completions.create(model="smollm2", prompt="Once upon a time", n=2 * lanes + 1,
                                                 max_tokens=200, temperature=1.0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                break
        assert runner.scheduler.waiting or runner._inbox  # the later groups wait their turn
        await stream.close()
        for _ in range(1000):
            if runner.is_idle():
                break
            await asyncio.sleep(0.01)
        assert runner.is_idle() and not runner.requests, (runner.scheduler.running, runner.scheduler.waiting)
        reply = await client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=2, temperature=0)
    assert reply.choices[0].finish_reason == "length"
