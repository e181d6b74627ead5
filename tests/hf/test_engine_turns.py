"""engine_turns.py: pure Python on a request's worker thread pauses for the engine while it
steps, only there and only then, and what it computes is the same."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import require_import

require_import("regex")

from kvstream.hf import engine_turns  # noqa: E402
from kvstream.hf.engine_turns import give_turn, set_busy, yielding_to_engine  # noqa: E402


class Clock:
    """The module's clock and sleep, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(engine_turns, "_resume_at", 0.0)  # (a turn of another test, on another clock)
    monkeypatch.setattr(engine_turns, "_clock", clock.perf_counter)
    monkeypatch.setattr(engine_turns, "_sleep", clock.sleep)
    yield clock
    engine_turns._busy.clear()


ENGINE = object()


def test_a_turn_is_given_once_a_slice_of_work_has_passed_while_an_engine_steps(clock):
    set_busy(ENGINE, True)
    with yielding_to_engine():
        give_turn()  # the first: a slice starts (the working lock taken)
        assert clock.sleeps == [] and engine_turns._working.locked()
        clock.now += engine_turns.SLICE_S / 2
        give_turn()
        assert clock.sleeps == []  # within the slice
        clock.now += engine_turns.SLICE_S
        give_turn()
        assert clock.sleeps == [engine_turns.PAUSE_S]
        give_turn()  # the next slice starts after the turn
        assert clock.sleeps == [engine_turns.PAUSE_S]
        clock.now += engine_turns.SLICE_S
        give_turn()
        assert clock.sleeps == [engine_turns.PAUSE_S] * 2


def test_no_turn_while_no_engine_steps_nor_outside_the_context(clock):
    with yielding_to_engine():
        clock.now += 1.0
        give_turn()  # every engine idle: the work runs at full speed
    set_busy(ENGINE, True)
    clock.now += 1.0
    give_turn()  # a thread that did not ask (the engine's own, the event loop)
    set_busy(ENGINE, False)
    with yielding_to_engine():
        clock.now += 1.0
        give_turn()
    assert clock.sleeps == []


def test_nested_contexts_leave_the_thread_as_they_found_it(clock):
    set_busy(ENGINE, True)
    with yielding_to_engine():
        give_turn()
        with yielding_to_engine():
            pass
        clock.now += 1.0
        give_turn()  # still within the outer one
        assert len(clock.sleeps) == 1
    clock.now += 1.0
    give_turn()
    assert len(clock.sleeps) == 1
    assert "deadline" not in engine_turns._local.__dict__ and not engine_turns._working.locked()


def test_work_that_raises_leaves_the_turns_to_the_others(clock):
    """A reading that fails (a schema refused midway: a 400) leaves the context as it found
    it: the working lock free for the next request, this thread no longer yielding."""
    set_busy(ENGINE, True)
    with pytest.raises(ValueError), yielding_to_engine():
        give_turn()
        clock.now += 1.0
        give_turn()  # a turn given, then the work fails
        raise ValueError("refused")
    assert not engine_turns._working.locked() and "deadline" not in engine_turns._local.__dict__
    clock.now += 1.0
    give_turn()
    assert len(clock.sleeps) == 1


def test_a_slice_starts_after_the_engines_turn_whichever_thread_gave_it(clock):
    """Another thread's turn under way (it gave one 2 ms ago): this thread's slice waits out
    the rest, so that threads reading at once leave the engine the turns one thread does."""
    set_busy(ENGINE, True)
    engine_turns._resume_at = clock.now + engine_turns.PAUSE_S - 0.002
    with yielding_to_engine():
        give_turn()
        assert clock.sleeps == [pytest.approx(engine_turns.PAUSE_S - 0.002)]
    set_busy(ENGINE, False)
    engine_turns._resume_at = clock.now + 1.0
    with yielding_to_engine():  # no engine stepping: nothing to wait for
        give_turn()
        assert len(clock.sleeps) == 1


def test_threads_reading_at_once_take_turns_among_themselves(monkeypatch):
    """While an engine steps, one thread works within the context at a time: a second waits
    at its first turn point until the first leaves or gives a turn (then it has its slice
    while the first sleeps), so that requests read in parallel get the interpreter no more
    often than one does."""
    entered, second_done = threading.Event(), threading.Event()

    def second() -> None:
        with yielding_to_engine():
            give_turn()
            entered.set()
        second_done.set()

    first = threading.current_thread()

    def turn_sleep(seconds: float) -> None:  # the first's turn: the second gets in meanwhile
        if threading.current_thread() is first:
            assert entered.wait(30)

    monkeypatch.setattr(engine_turns, "_sleep", turn_sleep)
    set_busy(ENGINE, True)
    try:
        with yielding_to_engine():
            give_turn()  # the first's slice
            thread = threading.Thread(target=second)
            thread.start()
            assert not entered.wait(0.2)  # the first works: the second waits
            engine_turns._local.deadline = 0.0  # its slice is over
            give_turn()
            assert entered.is_set()  # the second had its slice during the first's turn
        thread.join(30)
        assert second_done.is_set() and not engine_turns._working.locked()
    finally:
        engine_turns._busy.clear()


def test_with_no_engine_stepping_readers_do_not_wait_for_each_other(clock):
    """The engine idle, a second request's reading runs beside a first's (a small schema need
    not wait out a large one); a reader holding the turn when the engine goes idle lets go at
    its next turn point, and takes it again once the engine steps."""
    done = threading.Event()

    def second() -> None:
        with yielding_to_engine():
            give_turn()
        done.set()

    with yielding_to_engine():
        give_turn()
        thread = threading.Thread(target=second)
        thread.start()
        assert done.wait(30)  # not behind the first, which is still reading
        thread.join(30)
        set_busy(ENGINE, True)
        give_turn()
        assert engine_turns._holder == threading.get_ident()
        set_busy(ENGINE, False)
        give_turn()  # the engine went idle: let go
        assert engine_turns._holder is None and not engine_turns._working.locked()
        set_busy(ENGINE, True)
        give_turn()
        assert engine_turns._working.locked()
    assert not engine_turns._working.locked() and engine_turns._holder is None
    assert clock.sleeps == []


def test_a_schema_read_on_a_worker_thread_gives_turns_and_reads_the_same(clock):
    """A 300-property schema (benchmarks/loop_stall.py's), written and read into its machine
    on a worker thread within the context while an engine steps: it pauses (sleeps), and the
    expression and the machine's verdicts are those of the same reading with no engine."""
    from kvstream.hf.json_schema import schema_pattern
    from kvstream.hf.pattern_machine import Machine, _Reader

    schema = {"type": "object", "properties": {f"key_{k}": {"enum": [f"v{v}" for v in range(50)]} for k in range(300)}}
    answer = "{" + ", ".join(f'"key_{k}": "v{k % 50}"' for k in range(300)) + "}"

    def read_all() -> tuple[str, bool, bool]:
        pattern = schema_pattern(schema)
        machine = Machine(_Reader(pattern).read()[0])
        state = machine.start()
        for ch in answer:
            state = machine.step(state, ch)
        return pattern, machine.matches_something(), Machine.whole(state)

    def ticking_give_turn() -> None:  # each piece of work takes the clock a tenth of a ms
        clock.now += 1e-4
        real_give_turn()

    plain = read_all()
    assert plain[1:] == (True, True) and not clock.sleeps
    results = []

    def worker() -> None:
        with yielding_to_engine():
            results.append(read_all())

    set_busy(ENGINE, True)
    real_give_turn = engine_turns.give_turn
    import kvstream.hf.json_schema as json_schema
    import kvstream.hf.pattern_machine as pattern_machine

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pattern_machine, "give_turn", ticking_give_turn)
        patch.setattr(json_schema, "give_turn", ticking_give_turn)
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert results == [plain]
    assert len(clock.sleeps) > 10  # turns given all along the reading


def test_the_engine_is_marked_stepping_while_it_has_work_and_idle_after(smollm2):
    """The runner's loop marks itself while a request runs (give_turn pauses then), and
    unmarks itself before waiting for work (then nothing pauses for it), and on stopping."""
    require_import("torch")
    from kvstream.hf.model_runner import ModelRunner, RunnerConfig
    from kvstream.hf.sampling import SamplingParams
    from kvstream.scheduler import Sequence

    runner = ModelRunner(smollm2[0], smollm2[2], RunnerConfig(block_size=16, num_blocks=64))
    seen_busy, finished = [], threading.Event()

    def sink(events) -> None:
        seen_busy.append(id(runner) in engine_turns._busy)
        if any(e.finish_reason is not None or e.kind == "error" for e in events):
            finished.set()

    runner.start()
    try:
        assert id(runner) not in engine_turns._busy  # waiting for work
        runner.add_request(Sequence(smollm2[2]("Hello").input_ids, 8), SamplingParams(max_tokens=8, temperature=0), sink)
        assert finished.wait(120)
        assert seen_busy and all(seen_busy)
        for _ in range(600):  # back to waiting (a timeout, not a measure)
            if id(runner) not in engine_turns._busy:
                break
            time.sleep(0.05)
        assert id(runner) not in engine_turns._busy
    finally:
        runner.stop()
        runner.close()
    assert id(runner) not in engine_turns._busy
