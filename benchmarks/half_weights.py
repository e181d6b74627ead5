"""A bfloat16 checkpoint on a float32 CPU engine: weights held as stored (``half_weights``)
against the same checkpoint upcast at load, same run.

    python benchmarks/half_weights.py [--model DIR] [--tokens 32] [--rounds 4]

``--model``: a bfloat16 / float16 HF folder; by default the embedded SmolLM2 is saved once as
a bfloat16 checkpoint (under the kvstream cache) and measured. Two ``HFEngine`` s on that
folder, one with ``half_weights=True`` (the default) and one with ``False``; both run the
native linear kernel (the upcast one on float32 weights: its best mode here), the same
attention tier and ops. Rounds alternate between them, best round of each: decode tokens/s
of one sequence and of eight together, the first token of a 256-token prompt (prefill widens
blocks of the half weights for BLAS), resident weight bytes. Greedy tokens are compared.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvstream.hf import HFEngine  # noqa: E402
from kvstream.hf.loader import cache_dir, load_model  # noqa: E402

PROMPT = "Once upon a time, in a village by the sea, there lived"
LONG = "The meeting covered budgets, hiring plans and the product roadmap for next year. " * 16


def bf16_checkpoint() -> Path:
    """The embedded SmolLM2 saved as a bfloat16 folder (once)."""
    folder = cache_dir() / "models" / "smollm2-bf16-bench"
    if not (folder / "config.json").is_file():
        loaded = load_model(None, device="cpu", half_weights=False)
        loaded.model.to(torch.bfloat16).save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
    return folder


def decode_tps(engine: HFEngine, batch: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s (first token excluded) of ``batch`` sequences generated together."""
    results = engine.generate_batch([f"{PROMPT} {i}" for i in range(batch)], max_new_tokens=tokens)
    wall_s = max((r.total_ms - r.ttft_ms) for r in results) / 1000
    return sum(len(r.token_ids) - 1 for r in results) / wall_s, [r.token_ids for r in results]


def ttft_ms(engine: HFEngine, round_index: int) -> float:
    """First token of a ~256-token prompt nobody cached (a new prefix every round)."""
    started = time.perf_counter()
    engine.generate(f"Round {round_index}. {LONG}", max_new_tokens=1)
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a bfloat16 / float16 HF folder (default: SmolLM2 saved as bfloat16)")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = args.model or str(bf16_checkpoint())
    engines = {
        held: HFEngine.from_pretrained(folder, device="cpu", dtype="float32", max_cache_bytes=256 * 2**20, max_batch_size=8, half_weights=held)
        for held in (True, False)
    }
    try:
        for held, engine in engines.items():
            print(f"{'as stored' if held else 'upcast':<10} {engine.loaded.weights_snapshot()['stored']}; "
                  f"{engine.loaded.weights_snapshot()['resident_bytes'] / 2**20:.0f} MiB of weights", flush=True)
            engine.generate("warm up", max_new_tokens=4)
        best: dict[tuple[str, bool], float] = {}
        outputs: dict[tuple[int, bool], list[list[int]]] = {}
        for index in range(args.rounds):
            for held, engine in engines.items():
                for batch in (1, 8):
                    tps, ids = decode_tps(engine, batch, args.tokens)
                    best[(f"b{batch}", held)] = max(best.get((f"b{batch}", held), 0.0), tps)
                    outputs[(batch, held)] = ids
                first = ttft_ms(engine, index)
                best[("ttft", held)] = min(best.get(("ttft", held), float("inf")), first)
        for batch in (1, 8):
            same = "same tokens" if outputs[(batch, True)] == outputs[(batch, False)] else "TOKENS DIFFER"
            a, b = best[(f"b{batch}", True)], best[(f"b{batch}", False)]
            print(f"decode batch {batch}: as stored {a:6.1f} tok/s   upcast {b:6.1f} tok/s   {a / b:.2f}x   ({same})", flush=True)
        a, b = best[("ttft", True)], best[("ttft", False)]
        print(f"first token of a 256-token prompt: as stored {a:.0f} ms   upcast {b:.0f} ms   {b / a:.2f}x", flush=True)
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == "__main__":
    main()
