"""What a thread running pure Python does to the engine's steps, and what giving turns buys.

A stand-in for a decode step (the same number of small torch calls as SmolLM2's step here,
each letting go of the interpreter's lock and taking it back) is timed alone, beside a thread
looping in pure Python (the worst case), then beside a thread reading 300-property schemas into the constraint machine (the work a request with a
large schema puts on a worker thread), without and with ``yielding_to_engine()``
(kvstream/hf/engine_turns.py), same run, with the server's garbage collector settings. Prints each case's median and longest step, the
ratio to the step alone, and how long the reading took. Then, with no engine stepping, how long
a small schema (10 properties) takes to read beside a large one's reading (300), both within
``yielding_to_engine()``: the working lock is taken only while an engine steps, so the small
one does not wait the large one out (when it was held from the context's entry, it did).

    python benchmarks/engine_turns.py [--steps 40] [--calls 210]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvstream.api.server import tune_gc  # noqa: E402
from kvstream.hf import engine_turns  # noqa: E402
from kvstream.hf.json_schema import schema_pattern  # noqa: E402
from kvstream.hf.pattern_machine import Machine, _Reader  # noqa: E402


def step(calls: int, x: torch.Tensor, w: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        x @ w
    return time.perf_counter() - start


def schema_of(properties: int, tag: str) -> dict:
    """A schema of ``properties`` enum properties of 50 words, named with ``tag`` (each its own: nothing cached)."""
    return {"type": "object", "properties": {f"key_{tag}_{k}": {"enum": [f"v{v}" for v in range(50)]}
                                             for k in range(properties)}}


def reading(stop: threading.Event, yielding: bool, spent: list[float]) -> None:
    """Schemas of 300 enum properties, each its own (nothing cached), until ``stop``."""
    i = 0
    while not stop.is_set():
        schema = schema_of(300, str(i))
        start = time.perf_counter()
        if yielding:
            with engine_turns.yielding_to_engine():
                Machine(_Reader(schema_pattern(schema)).read()[0]).matches_something()
        else:
            Machine(_Reader(schema_pattern(schema)).read()[0]).matches_something()
        spent.append(time.perf_counter() - start)
        i += 1


def busy_loop(stop: threading.Event, yielding: bool, spent: list[float]) -> None:
    """Pure Python that never lets go of the lock by itself (the worst case), until ``stop``."""
    while not stop.is_set():
        total = 0
        for i in range(10_000):
            total += i


_one_at_a_time = threading.Lock()


def read_within(schema: dict, serialized: bool = False) -> float:
    """Seconds to read ``schema`` into its machine within ``yielding_to_engine()``;
    ``serialized``: within a lock held for the whole reading as well (the baseline: the
    working lock as it was taken before, from the context's entry, engine idle or not)."""
    start = time.perf_counter()
    with _one_at_a_time if serialized else contextlib.nullcontext(), engine_turns.yielding_to_engine():
        Machine(_Reader(schema_pattern(schema)).read()[0]).matches_something()
    return time.perf_counter() - start


def idle_readers(rounds: int = 5) -> None:
    """A small schema read alone, and beside a large one's reading (started 5 ms before it),
    no engine stepping, now and with the readings one at a time: the medians of ``rounds``."""
    print(f"\nno engine stepping ({rounds} rounds, medians): a 10-property schema read beside a 300-property one's reading")
    print(f"{'readers':<30} {'small alone ms':>15} {'beside ms':>10} {'x alone':>8} {'large ms':>9}")
    for serialized in (True, False):
        alone, beside, large_s = [], [], []
        for r in range(rounds):
            tag = f"{serialized}{r}"
            alone.append(read_within(schema_of(10, f"a{tag}"), serialized))
            thread = threading.Thread(target=lambda t=tag: large_s.append(read_within(schema_of(300, f"l{t}"), serialized)))
            thread.start()
            time.sleep(0.005)
            beside.append(read_within(schema_of(10, f"b{tag}"), serialized))
            thread.join()
        small, near = statistics.median(alone), statistics.median(beside)
        name = "one at a time (before)" if serialized else "side by side (engine idle)"
        print(f"{name:<30} {small * 1e3:>15.1f} {near * 1e3:>10.1f} {near / small:>8.2f} "
              f"{statistics.median(large_s) * 1e3:>9.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--calls", type=int, default=210, help="torch calls in a step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tune_gc()  # as the server does once started: else a full collection (~160 ms here) shows in the steps
    x, w = torch.randn(1, 576), torch.randn(576, 1536)
    engine = object()
    results = {}
    for case in ("alone", "beside a busy loop", "beside a reading thread", "beside it, giving turns"):
        stop, spent = threading.Event(), []
        thread = None
        if case != "alone":
            work = busy_loop if case.endswith("loop") else reading
            thread = threading.Thread(target=work, args=(stop, case.endswith("turns"), spent))
            thread.start()
            time.sleep(0.05)
        engine_turns.set_busy(engine, True)
        steps = [step(args.calls, x, w) for _ in range(args.steps)]
        engine_turns.set_busy(engine, False)
        stop.set()
        if thread is not None:
            thread.join()
        results[case] = (steps, spent)
    alone = statistics.median(results["alone"][0])
    print(f"a step of {args.calls} torch calls, {args.steps} steps a case (same run)\n")
    print(f"{'case':<26} {'median ms':>10} {'max ms':>8} {'x alone':>8} {'schema read, median s':>22}")
    for case, (steps, spent) in results.items():
        median = statistics.median(steps)
        read = f"{statistics.median(spent):.3f}" if spent else "-"
        print(f"{case:<26} {median * 1e3:>10.1f} {max(steps) * 1e3:>8.1f} {median / alone:>8.2f} {read:>22}")
    idle_readers()


if __name__ == "__main__":
    main()
