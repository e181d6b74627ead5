"""The native RMSNorm and rotary kernels (``kvstream/hf/native_ops.py``) in the engine's decode,
against the same engine running transformers' own ops for them, same model, same run.

    python benchmarks/native_ops.py [--model DIR] [--tokens 32] [--rounds 4]

For each model (the embedded SmolLM2 fp32, and an AWQ checkpoint when ``--model`` names one,
e.g. from ``kvstream awq quantize``), one ``HFEngine``: decode tokens/s of one sequence and of
eight together, the ops switched (``native_ops.install``) between the two on every round,
alternating, best round of each. Everything else (linear layers, attention tier, the AWQ
kernel) is the same in both. Prints tokens/s and the ratio; greedy tokens are compared too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvstream.hf import HFEngine, native_ops  # noqa: E402

PROMPT = "Once upon a time, in a village by the sea, there lived"


def decode_tps(engine: HFEngine, batch: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s (first token excluded) of ``batch`` sequences generated together."""
    results = engine.generate_batch([f"{PROMPT} {i}" for i in range(batch)], max_new_tokens=tokens)
    wall_s = max((r.total_ms - r.ttft_ms) for r in results) / 1000
    return sum(len(r.token_ids) - 1 for r in results) / wall_s, [r.token_ids for r in results]


def measure(label: str, folder: str | None, tokens: int, rounds: int) -> None:
    engine = HFEngine.from_pretrained(folder, device="cpu", dtype="float32", max_cache_bytes=256 * 2**20, max_batch_size=8)
    model = engine.loaded.model
    try:
        engine.generate("warm up", max_new_tokens=4)
        for batch in (1, 8):
            best = {True: 0.0, False: 0.0}
            outputs = {}
            for _ in range(rounds):
                for native in (True, False):
                    native_ops.install(model, native)
                    tps, ids = decode_tps(engine, batch, tokens)
                    best[native] = max(best[native], tps)
                    outputs[native] = ids
            same = "same tokens" if outputs[True] == outputs[False] else "TOKENS DIFFER"
            print(f"{label:<16} batch {batch}: native ops {best[True]:6.1f} tok/s   torch ops {best[False]:6.1f} tok/s"
                  f"   {best[True] / best[False]:.2f}x   ({same})", flush=True)
    finally:
        native_ops.install(model, True)
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="an AWQ (or any HF) checkpoint folder, measured after SmolLM2 fp32")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if native_ops.load()[0] is None:
        sys.exit(f"the native ops are not built here: {native_ops.load()[1]}")
    measure("SmolLM2 fp32", None, args.tokens, args.rounds)
    if args.model:
        measure(Path(args.model).name, args.model, args.tokens, args.rounds)


if __name__ == "__main__":
    main()
