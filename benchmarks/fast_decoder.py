"""The direct decoder path (kvstream/hf/fast_decoder.py) against transformers' own layers, same
engine, same run, rounds alternating: decode milliseconds per token at batch 1 and 8.

    python benchmarks/fast_decoder.py [--folder AWQ_OR_HF_DIR ...] [--rounds 4] [--tokens 32]

Models: the embedded SmolLM2-135M in float32 (its projections half-stored, ``HalfLinear``),
SmolLM2 as a round-to-nearest AWQ checkpoint made here, and any ``--folder`` (an AWQ
checkpoint such as the 96-layer one ``benchmarks/awq_streaming.py`` makes, optionally streamed
with ``--mapped K``). Both paths run the same kernels (the direct path gives the same tokens,
checked); what differs is the Python around them. Best and median per path, and the ratio of
the bests (> 1: the direct path is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvstream.hf import HFEngine, fast_decoder  # noqa: E402
from kvstream.hf.awq.streaming import StreamingConfig  # noqa: E402


def rtn_checkpoint(out: Path) -> Path:
    from kvstream.hf.awq import quantize as awq
    from kvstream.hf.loader import load_model

    loaded = load_model(None, device="cpu", half_weights=False)
    size = awq.choose_group_size(loaded.model, None)
    state = awq.quantize_model(loaded.model, loaded.tokenizer, size, "", activation_aware=False)
    awq.save_checkpoint(out, loaded.model, loaded.tokenizer, state, size, None)
    return out


def measure(label: str, engine: HFEngine, rounds: int, tokens: int) -> None:
    layers = list(engine.loaded.model.model.layers)
    if engine.engine.decoder.layers != len(layers):
        print(f"{label}: the direct path is not installed: {engine.engine.decoder.why_not}")
        return
    prompt = "Once upon a time there was a"
    batch = [f"Story {i}: once upon a time" for i in range(8)]
    engine.generate("warm up", max_new_tokens=4)
    times: dict[tuple[bool, int], list[float]] = {(fast, b): [] for fast in (False, True) for b in (1, 8)}
    outputs: dict[bool, list] = {}
    try:
        for _ in range(rounds):
            for fast in (False, True):
                fast_decoder.switch(layers, fast)
                one = engine.generate(prompt, max_new_tokens=tokens)
                times[fast, 1].append((one.total_ms - one.ttft_ms) / (len(one.token_ids) - 1))
                many = engine.generate_batch(batch, max_new_tokens=tokens)
                wall = max(r.total_ms for r in many) - max(r.ttft_ms for r in many)
                times[fast, 8].append(wall / (sum(len(r.token_ids) for r in many) - len(many)))
                outputs[fast] = [one.token_ids] + [r.token_ids for r in many]
    finally:
        fast_decoder.switch(layers, True)
    same = "same tokens" if outputs[False] == outputs[True] else "TOKENS DIFFER"
    for b in (1, 8):
        old, new = times[False, b], times[True, b]
        print(f"{label:<28} b{b}: transformers' layers {min(old):7.2f} ms/token (median {statistics.median(old):6.2f}), "
              f"direct {min(new):7.2f} (median {statistics.median(new):6.2f}): {min(old) / min(new):.2f}x  [{same}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", action="append", default=[], help="more models (HF or AWQ folders)")
    parser.add_argument("--mapped", type=int, default=None, help="stream --folder models mapped, keeping K first/last layers")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"decode ms per token, {torch.get_num_threads()} threads, {args.rounds} rounds alternating, {args.tokens} tokens a request")
    work = Path(tempfile.mkdtemp(prefix="kvstream-fast-decoder-"))
    models = [("smollm2-135m fp32", None, None), ("smollm2-135m awq (rtn)", str(rtn_checkpoint(work / "rtn")), None)]
    streaming = None if args.mapped is None else StreamingConfig("partial_resident", args.mapped, args.mapped, 2, staging="mapped")
    models += [(Path(f).name + ("" if streaming is None else f" mapped K={args.mapped}"), f, streaming) for f in args.folder]
    for label, folder, stream in models:
        engine = HFEngine.from_pretrained(folder, device="cpu", dtype="float32", max_cache_bytes=256 * 2**20,
                                          max_batch_size=8, streaming=stream)
        try:
            measure(label, engine, args.rounds, args.tokens)
        finally:
            engine.close()


if __name__ == "__main__":
    main()
