"""A row whose constraint judges candidates slowly (a client's expression the regex module
follows, a lazy grammar's trigger patterns) has its tokens decided beside the engine's
steps: the other rows go on meanwhile, and its answer is the one it gets decided inside the
step."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import regex

from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from kvstream.hf.pattern_constraint import PatternConstraint  # noqa: E402
from kvstream.hf.sampling import SamplingParams  # noqa: E402
from kvstream.scheduler import Sequence  # noqa: E402

# A lookahead: the machine cannot read it, so the regex module follows it (and anything goes).
EXPRESSION = r"(?=[ A-Za-z])[^\n]{0,400}"


class Gate:
    """The regex module's expression, with its first match held until ``open`` (or 5 s): a
    match that takes long. Records the thread each match ran on: its name, torch's thread
    count there and its niceness (Linux)."""

    def __init__(self, pattern) -> None:
        self.inner, self.pattern = pattern, pattern.pattern
        self.opened = threading.Event()
        self.threads: set[tuple[str, int, int | None]] = set()  # (name, torch threads, niceness)

    def fullmatch(self, *args, **kwargs):
        first = not self.threads
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if sys.platform.startswith("linux") else None
        self.threads.add((threading.current_thread().name, torch.get_num_threads(), nice))
        if first:
            self.opened.wait(5)
        return self.inner.fullmatch(*args, **kwargs)


def engine_for(smollm2) -> ModelRunner:
    return ModelRunner(smollm2[0], smollm2[2], RunnerConfig(block_size=16, num_blocks=64, max_num_seqs=4, debug_invariants=True))


def held_params(**sampling) -> SamplingParams:
    return SamplingParams(max_tokens=12, pattern=EXPRESSION, logprobs=2, **sampling)


def assert_same_logprobs(got: list, expected: list) -> None:
    """Tokens' logprobs alike to float noise: the top tokens exactly, the values approximately."""
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert [token for token, _ in mine.top] == [token for token, _ in theirs.top]
        assert [mine.logprob, *(value for _, value in mine.top)] == pytest.approx(
            [theirs.logprob, *(value for _, value in theirs.top)], abs=1e-3)


def run_to_end(engine: ModelRunner) -> None:
    deadline = time.monotonic() + 120
    while engine.has_work():
        assert time.monotonic() < deadline
        engine.step()
        engine._await_decision()


def gated(engine: ModelRunner, req) -> Gate:
    """``req``'s constraint made slow to judge: its first match waits for the gate (and its
    budget is wide enough for the wait)."""
    constraint: PatternConstraint = req.constraint
    assert constraint.slow_to_judge  # the regex module follows it
    gate = Gate(constraint.pattern.compiled() if hasattr(constraint.pattern, "compiled") else constraint.pattern)
    constraint.pattern = gate
    constraint.budget_s = constraint._token_left_s = constraint._left_s = 60.0
    return gate


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_a_slow_row_is_decided_aside_while_the_others_step_on(smollm2, sampling, monkeypatch):
    tokenizer = smollm2[2]
    prompt = list(tokenizer("Write a sentence about the sea:").input_ids)
    other = list(tokenizer("The capital of France is").input_ids)

    # The held answer decided inside the steps (the way before), as the reference.
    with monkeypatch.context() as patch:
        patch.setattr(PatternConstraint, "slow_to_judge", property(lambda self: False))
        inline = engine_for(smollm2)
        events: list = []
        inline.add_request(Sequence(list(prompt), 12), held_params(**sampling), events.extend)
        run_to_end(inline)
        inline.close()
    expected = [(e.token_id, e.text, e.finish_reason) for e in events if e.kind == "token"]
    expected_logprobs = [e.logprobs for e in events if e.kind == "token" and e.token_id is not None]
    assert len(expected) >= 2

    engine = engine_for(smollm2)
    threads = torch.get_num_threads()
    held_events: list = []
    plain_events: list = []
    held = engine.add_request(Sequence(list(prompt), 12), held_params(**sampling), held_events.extend)
    engine.add_request(Sequence(list(other), 10), SamplingParams(max_tokens=10, temperature=0), plain_events.extend)
    gate = gated(engine, held)
    # While the held row's first token is being judged (the gate shut), the other answers whole.
    for _ in range(40):
        engine.step()
        if any(e.finish_reason for e in plain_events):
            break
    assert sum(e.kind == "token" for e in plain_events) == 10 and plain_events[-1].finish_reason == "length"
    assert not any(e.kind == "token" for e in held_events)
    gate.opened.set()
    run_to_end(engine)
    got = [(e.token_id, e.text, e.finish_reason) for e in held_events if e.kind == "token"]
    assert got == expected
    # (the same to float noise: the first token's prompt was computed beside another here)
    assert_same_logprobs([e.logprobs for e in held_events if e.kind == "token" and e.token_id is not None], expected_logprobs)
    # Never on the engine's thread; on one that runs torch's kernels on one OpenMP thread, at a
    # lower CPU priority, and leaves the others' counts as they were.
    expected_nice = min(19, 10 + os.getpriority(os.PRIO_PROCESS, 0)) if sys.platform.startswith("linux") else None
    assert {(name.split("_")[0], count, nice) for name, count, nice in gate.threads} == {("kvstream-decide", 1, expected_nice)}
    assert torch.get_num_threads() == threads
    fresh: list[int] = []
    later = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert fresh == [threads]
    assert engine.is_idle()
    engine.check_invariants()
    engine.close()


def test_a_request_aborted_while_its_token_is_decided_ends_and_frees_its_blocks(smollm2):
    engine = engine_for(smollm2)
    events: list = []
    prompt = list(smollm2[2]("Write a sentence about the sea:").input_ids)
    held = engine.add_request(Sequence(prompt, 12), held_params(temperature=0), events.extend)
    gate = gated(engine, held)
    for _ in range(3):
        engine.step()
        engine._await_decision()
    assert held.seq.seq_id in engine._deciding
    engine.abort(held.seq.seq_id)
    engine.step()  # the abort taken while the decision is out
    gate.opened.set()
    run_to_end(engine)
    deadline = time.monotonic() + 10
    while engine._deciding and time.monotonic() < deadline:  # the decision comes back, and is dropped
        engine.step()
        engine._await_decision()
    assert not engine._deciding and not any(e.kind == "token" for e in events)
    assert engine.is_idle()
    engine.close()


def test_the_engine_thread_waits_for_a_decision_instead_of_spinning(smollm2):
    """With only a row out being decided, the engine's thread sleeps until it is back: a few
    steps, not thousands (a busy loop would take the core the decision needs)."""
    engine = engine_for(smollm2)
    events: list = []
    done = threading.Event()

    def sink(batch):
        events.extend(batch)
        if any(e.finish_reason or e.kind == "error" for e in batch):
            done.set()

    prompt = list(smollm2[2]("Write a sentence about the sea:").input_ids)
    held = engine.add_request(Sequence(prompt, 4), SamplingParams(max_tokens=4, temperature=0, pattern=EXPRESSION), sink)
    gate = gated(engine, held)
    steps = []
    step = engine.step
    engine.step = lambda: (steps.append(1), step())  # (what the engine's loop calls)
    engine.start()
    try:
        time.sleep(1.0)  # the first token out, behind the shut gate
        behind_the_gate = len(steps)
        gate.opened.set()
        assert done.wait(60)
    finally:
        engine.close()
    assert behind_the_gate <= 1.0 / 0.05 + 5, behind_the_gate  # a wake-up each 50 ms at most
    assert sum(e.kind == "token" for e in events) == 4


def test_a_token_back_within_the_grace_rejoins_the_next_step(smollm2, monkeypatch):
    """Each step waits for the tokens out on the side thread (up to a share of the last step's
    time): a row whose token comes back within it sits out no step. With a wide grace, the
    held row keeps pace with a plain one, a token behind (the one out); without any, it
    falls further behind."""
    from kvstream.hf import model_runner

    prompt = list(smollm2[2]("Write a sentence about the sea:").input_ids)

    def tokens_when_plain_ends(grace: float) -> tuple[int, int]:
        monkeypatch.setattr(model_runner, "DECISION_GRACE_SHARE", grace)
        monkeypatch.setattr(model_runner, "DECISION_GRACE_MAX_S", grace)
        engine = engine_for(smollm2)
        held_events: list = []
        plain_events: list = []
        engine.add_request(Sequence(list(prompt), 16), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                                      pattern=EXPRESSION), held_events.extend)
        engine.add_request(Sequence(list(prompt), 16), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                           plain_events.extend)
        while not any(e.finish_reason for e in plain_events):
            engine.step()
        counts = sum(e.kind == "token" for e in held_events), sum(e.kind == "token" for e in plain_events)
        run_to_end(engine)
        engine.close()
        return counts

    # (the held row's last token is still out when the plain one's step ends)
    assert tokens_when_plain_ends(1000.0) == (15, 16)
    held, plain = tokens_when_plain_ends(0.0)
    assert plain == 16 and held < 15


class SearchGate(Gate):
    """A trigger's expression (searched), its first search held as Gate's first match."""

    def search(self, *args, **kwargs):
        first = not self.threads
        self.threads.add((threading.current_thread().name, torch.get_num_threads(), None))
        if first:
            self.opened.wait(5)
        return self.inner.search(*args, **kwargs)


@pytest.mark.parametrize("trigger", [r"\b(the)\b", r"never(q)"], ids=["found", "not-found"])
def test_a_lazy_grammar_searching_a_clients_patterns_is_noted_aside(smollm2, monkeypatch, trigger):
    """A lazy grammar's trigger patterns (llama-server's ``grammar_triggers`` of type 2) are
    searched in all the text at each token: a row waiting for one is decided aside too, the
    other rows stepping on meanwhile, and its answer (held from the trigger on where one is
    found) is the one noted inside the step."""
    from kvstream.hf.lazy_grammar import LazyGrammar, Triggers

    tokenizer = smollm2[2]
    prompt = list(tokenizer("Write a sentence about the sea:").input_ids)
    other = list(tokenizer("The capital of France is").input_ids)

    def params() -> SamplingParams:  # from "the" on: letters and spaces only
        return SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, pattern=r"the[a-z ]{0,200}",
                              triggers=Triggers(patterns=(trigger,)))

    with monkeypatch.context() as patch:
        patch.setattr(LazyGrammar, "slow_to_search", property(lambda self: False))
        inline = engine_for(smollm2)
        events: list = []
        inline.add_request(Sequence(list(prompt), 16), params(), events.extend)
        run_to_end(inline)
        inline.close()
    expected = [(e.token_id, e.text) for e in events if e.kind == "token"]
    assert len(expected) == 16

    engine = engine_for(smollm2)
    held_events: list = []
    plain_events: list = []
    held = engine.add_request(Sequence(list(prompt), 16), params(), held_events.extend)
    engine.add_request(Sequence(list(other), 10), SamplingParams(max_tokens=10, temperature=0), plain_events.extend)
    assert held.lazy is not None and held.lazy.slow_to_search
    gate = SearchGate(held.lazy.patterns[0])
    held.lazy.patterns = [gate]
    held.lazy.budget_s = held.lazy._left_s = 60.0
    for _ in range(40):
        engine.step()
        if any(e.finish_reason for e in plain_events):
            break
    assert sum(e.kind == "token" for e in plain_events) == 10
    assert not any(e.kind == "token" for e in held_events)
    gate.opened.set()
    run_to_end(engine)
    assert [(e.token_id, e.text) for e in held_events if e.kind == "token"] == expected
    assert {name.split("_")[0] for name, _, _ in gate.threads} == {"kvstream-decide"}
    if trigger.startswith(r"\b"):  # held from the trigger on
        text = "".join(text for _, text in expected)
        assert "the" in text and regex.fullmatch(r"the[a-z ]*", text[text.index("the"):]), text
    engine.close()


def test_a_decision_that_fails_ends_its_request_and_the_engine_goes_on(smollm2):
    """An error raised while a token is decided aside ends that request with it (an error
    event, its blocks freed); the other request sharing the steps answers whole."""
    engine = engine_for(smollm2)
    prompt = list(smollm2[2]("Write a sentence about the sea:").input_ids)
    held_events: list = []
    plain_events: list = []
    held = engine.add_request(Sequence(list(prompt), 12), held_params(temperature=0), held_events.extend)
    engine.add_request(Sequence(list(prompt), 10), SamplingParams(max_tokens=10, temperature=0), plain_events.extend)
    gate = gated(engine, held)
    gate.opened.set()

    def broken(*args, **kwargs):
        raise RuntimeError("the matcher broke")

    gate.fullmatch = broken
    run_to_end(engine)
    errors = [e for e in held_events if e.kind == "error"]
    assert len(errors) == 1 and "the matcher broke" in str(errors[0].error)
    assert not any(e.kind == "token" for e in held_events)
    assert sum(e.kind == "token" for e in plain_events) == 10
    assert engine.is_idle() and not engine._deciding
    engine.close()
