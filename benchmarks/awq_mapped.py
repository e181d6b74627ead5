"""Warm ``mapped`` streaming against the resident model, in one process, forwards alternating:
what staging costs once the checkpoint is in the page cache.

    python benchmarks/awq_mapped.py [--folder AWQ_DIR] [--layers 96] [--rounds 6] [--engine]

Three models from one AWQ checkpoint, all on the native kernel: resident; streamed with
``staging="mapped"`` at K = 2 (the product: the stager faults a layer's pages in only where
``mincore`` finds one missing from the page cache); and the same with every layer's pages
populated on every forward whether cached or not (``MADV_POPULATE_READ`` on mapped pages
still walks each one: what the stager did before). Each round times 8 one-token forwards of
each (no KV cache: the projections dominate), best and median per forward over the rounds.
With ``--engine``, each is an ``HFEngine`` instead, and a round times one decode of 48
tokens at batch 1 after a 256-token prompt (the engine's direct decoder path, with its paged
KV cache: what a served model runs), per token. Without ``--folder`` the synthetic model of
``awq_streaming.py`` (SmolLM2's architecture, ``--layers`` layers, random weights, RTN) is
made in a temporary folder first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import scratch_dir  # noqa: E402

import torch  # noqa: E402

from kvstream.hf.awq import streaming  # noqa: E402
from kvstream.hf.awq.model import load_awq_model  # noqa: E402
from kvstream.hf.awq.streaming import StreamingConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="an AWQ checkpoint folder (default: make the synthetic one)")
    parser.add_argument("--layers", type=int, default=96, help="layers of the synthetic model")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--engine", action="store_true", help="time engine decodes, not bare forwards")
    args = parser.parse_args()
    torch.set_num_threads(2)
    folder = args.folder
    if folder is None:
        from awq_streaming import quantize, synthetic

        work = scratch_dir("kvstream-awq-mapped-")
        source = synthetic(work / f"synthetic-{args.layers}", args.layers)
        folder = str(work / f"synthetic-{args.layers}-awq")
        quantize(str(source), Path(folder), False)  # RTN: random weights have no text to calibrate on
    configs = {"resident": None, "mapped": StreamingConfig("partial_resident", 2, 2, 2, staging="mapped"),
               "mapped, populate always": StreamingConfig("partial_resident", 2, 2, 2, staging="mapped")}
    checks_cache = streaming.pages_cached
    checks = {"resident": checks_cache, "mapped": checks_cache, "mapped, populate always": lambda start, end, vector=None: False}
    if args.engine:
        from kvstream.hf import HFEngine

        engines = {name: HFEngine.from_pretrained(folder, device="cpu", dtype="float32", streaming=config,
                                                  max_cache_bytes=256 * 2**20, max_batch_size=8)
                   for name, config in configs.items()}
        tokenizer = engines["resident"].tokenizer
        prompt = tokenizer.decode(engines["resident"].encode(" ".join(f"word{i}" for i in range(400)))[:256])
        reports = [engine.loaded.weights for engine in engines.values()]
    else:
        loaded = {name: load_awq_model(folder, torch.float32, config) for name, config in configs.items()}
        reports = [report for _, report in loaded.values()]
    streamed_bytes = reports[1].streamed_bytes
    ids = torch.tensor([[42]])

    # Time inside the streamer's per-layer hook (LayerStreamer.before), per forward or token:
    # its own cost, which the noise of a shared machine hides in the totals.
    in_hooks = {"seconds": 0.0}
    hook = streaming.LayerStreamer.before

    def timed_hook(self, layer: int) -> None:
        started = time.perf_counter()
        hook(self, layer)
        in_hooks["seconds"] += time.perf_counter() - started

    streaming.LayerStreamer.before = timed_hook
    hook_ms: dict[str, list[float]] = {name: [] for name in configs}

    def per_forward_ms(name: str, forwards: int = 8) -> float:
        streaming.pages_cached = checks[name]
        try:
            if args.engine:
                in_hooks["seconds"] = 0.0
                result = engines[name].generate(prompt, max_new_tokens=48 if forwards > 2 else 2)
                steps = len(result.token_ids)  # forwards: the prompt's (a prefix-cache hit) and each decode's
                ms = (result.total_ms - result.ttft_ms) / (steps - 1)
            else:
                in_hooks["seconds"], started = 0.0, time.perf_counter()
                with torch.no_grad():
                    for _ in range(forwards):
                        loaded[name][0](ids, use_cache=False)
                steps, ms = forwards, (time.perf_counter() - started) / forwards * 1e3
            hook_ms[name].append(in_hooks["seconds"] / steps * 1e3)
            return ms
        finally:
            streaming.pages_cached = checks_cache

    for name in configs:  # the first forwards fault the checkpoint in
        per_forward_ms(name, 2)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name in configs:
            times[name].append(per_forward_ms(name))
    for report in reports:
        if report.streamer is not None:
            report.streamer.close()
    base = min(times["resident"])
    what = "engine decodes of 48 tokens (ms per token)" if args.engine else "8 forwards (ms per forward)"
    print(f"{folder}: {streamed_bytes / 2**20:.0f} MB streamed per forward, {args.rounds} rounds of {what}")
    print(f"{'model':>24} {'best ms':>8} {'median ms':>10} {'resident/this (best)':>21} {'in streamer hooks ms (median)':>30}")
    for name, values in times.items():
        print(f"{name:>24} {min(values):>8.1f} {statistics.median(values):>10.1f} {base / min(values):>20.2f}x "
              f"{statistics.median(hook_ms[name]):>30.2f}")


if __name__ == "__main__":
    main()
