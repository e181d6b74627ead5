"""Warm ``mapped`` streaming against the resident model, in one process, forwards alternating:
what staging costs once the checkpoint is in the page cache.

    python benchmarks/awq_mapped.py [--folder AWQ_DIR] [--layers 96] [--rounds 6]

Three models from one AWQ checkpoint, all on the native kernel: resident; streamed with
``staging="mapped"`` at K = 2 (the product: the stager faults a layer's pages in only where
``mincore`` finds one missing from the page cache); and the same with every layer's pages
populated on every forward whether cached or not (``MADV_POPULATE_READ`` on mapped pages
still walks each one: what the stager did before). Each round times 8 one-token forwards of
each (no KV cache: the projections dominate), best and median per forward over the rounds.
Without ``--folder`` the synthetic model of ``awq_streaming.py`` (SmolLM2's architecture,
``--layers`` layers, random weights, RTN) is made in a temporary folder first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvstream.hf.awq import streaming  # noqa: E402
from kvstream.hf.awq.model import load_awq_model  # noqa: E402
from kvstream.hf.awq.streaming import StreamingConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="an AWQ checkpoint folder (default: make the synthetic one)")
    parser.add_argument("--layers", type=int, default=96, help="layers of the synthetic model")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(2)
    folder = args.folder
    if folder is None:
        from awq_streaming import quantize, synthetic

        work = Path(tempfile.mkdtemp(prefix="kvstream-awq-mapped-"))
        source = synthetic(work / f"synthetic-{args.layers}", args.layers)
        folder = str(work / f"synthetic-{args.layers}-awq")
        quantize(str(source), Path(folder), False)  # RTN: random weights have no text to calibrate on
    resident, _ = load_awq_model(folder, torch.float32)
    mapped, report = load_awq_model(folder, torch.float32, StreamingConfig("partial_resident", 2, 2, 2, staging="mapped"))
    always, report_always = load_awq_model(folder, torch.float32, StreamingConfig("partial_resident", 2, 2, 2, staging="mapped"))
    checks_cache = streaming.pages_cached
    models = {"resident": (resident, checks_cache), "mapped": (mapped, checks_cache),
              "mapped, populate always": (always, lambda start, end: False)}
    ids = torch.tensor([[42]])

    def per_forward_ms(name: str, forwards: int = 8) -> float:
        model, check = models[name]
        streaming.pages_cached = check
        try:
            started = time.perf_counter()
            with torch.no_grad():
                for _ in range(forwards):
                    model(ids, use_cache=False)
            return (time.perf_counter() - started) / forwards * 1e3
        finally:
            streaming.pages_cached = checks_cache

    for name in models:  # the first forwards fault the checkpoint in
        per_forward_ms(name, 2)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name in models:
            times[name].append(per_forward_ms(name))
    report.streamer.close()
    report_always.streamer.close()
    base = min(times["resident"])
    print(f"{folder}: {report.streamed_bytes / 2**20:.0f} MB streamed per forward, {args.rounds} rounds of 8 forwards")
    print(f"{'model':>24} {'best ms':>8} {'median ms':>10} {'resident/this (best)':>21}")
    for name, values in times.items():
        print(f"{name:>24} {min(values):>8.1f} {statistics.median(values):>10.1f} {base / min(values):>20.2f}x")


if __name__ == "__main__":
    main()
