"""The direct decoder path (kvstream/hf/fast_decoder.py) against transformers' own layers, same
engine, same run, rounds alternating: decode milliseconds per token at batch 1 and 8.

    python benchmarks/fast_decoder.py [--folder AWQ_OR_HF_DIR ...] [--rounds 4] [--tokens 32]

Models: the embedded SmolLM2-135M in float32 (its projections half-stored, ``HalfLinear``),
SmolLM2 as a round-to-nearest AWQ checkpoint made here, and any ``--folder`` (an AWQ
checkpoint such as the 96-layer one ``benchmarks/awq_streaming.py`` makes, optionally streamed
with ``--mapped K``). Three paths, the same kernels (same tokens, checked): transformers'
layers; the direct path calling each projection on its own; the direct path as installed,
where a layer's Q/K/V and its gate/up are one kernel call each (AWQ: ``awq_gemv_many``, the
threads sharing out all their words). Best and median per path, and the ratios of the bests
(> 1: the direct path is faster; ``fused``: one call against one per projection).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import scratch_dir  # noqa: E402

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


def separate_calls(layer: torch.nn.Module) -> fast_decoder.LayerKernels:
    """The layer's installed kernels with Q/K/V and gate/up called one projection at a time."""
    attention, mlp = layer.self_attn, layer.mlp
    return dataclasses.replace(
        layer._kvstream_kernels,
        qkv=fast_decoder.projections_call([attention.q_proj, attention.k_proj, attention.v_proj], fuse=False),
        gate_up=fast_decoder.projections_call([mlp.gate_proj, mlp.up_proj], fuse=False))


PATHS = ("transformers", "separate", "fused")


def measure(label: str, engine: HFEngine, rounds: int, tokens: int) -> None:
    layers = list(engine.loaded.model.model.layers)
    if engine.engine.decoder.layers != len(layers):
        print(f"{label}: the direct path is not installed: {engine.engine.decoder.why_not}")
        return
    installed = [layer._kvstream_kernels for layer in layers]
    kernels = {"transformers": installed, "separate": [separate_calls(layer) for layer in layers], "fused": installed}
    prompt = "Once upon a time there was a"
    batch = [f"Story {i}: once upon a time" for i in range(8)]
    engine.generate("warm up", max_new_tokens=4)
    times: dict[tuple[str, int], list[float]] = {(path, b): [] for path in PATHS for b in (1, 8)}
    outputs: dict[str, list] = {}
    try:
        for _ in range(rounds):
            for path in PATHS:
                fast_decoder.switch(layers, path != "transformers")
                for layer, chosen in zip(layers, kernels[path]):
                    vars(layer)["_kvstream_kernels"] = chosen
                one = engine.generate(prompt, max_new_tokens=tokens)
                times[path, 1].append((one.total_ms - one.ttft_ms) / (len(one.token_ids) - 1))
                many = engine.generate_batch(batch, max_new_tokens=tokens)
                wall = max(r.total_ms for r in many) - max(r.ttft_ms for r in many)
                times[path, 8].append(wall / (sum(len(r.token_ids) for r in many) - len(many)))
                outputs[path] = [one.token_ids] + [r.token_ids for r in many]
    finally:
        for layer, chosen in zip(layers, installed):
            vars(layer)["_kvstream_kernels"] = chosen
        fast_decoder.switch(layers, True)
    same = "same tokens" if all(outputs[path] == outputs["transformers"] for path in PATHS) else "TOKENS DIFFER"
    for b in (1, 8):
        best = {path: min(times[path, b]) for path in PATHS}
        median = {path: statistics.median(times[path, b]) for path in PATHS}
        print(f"{label:<28} b{b}: transformers' layers {best['transformers']:7.2f} ms/token (median {median['transformers']:6.2f}), "
              f"direct one call a projection {best['separate']:7.2f} ({median['separate']:6.2f}), "
              f"direct {best['fused']:7.2f} ({median['fused']:6.2f}): {best['transformers'] / best['fused']:.2f}x, "
              f"fused {best['separate'] / best['fused']:.2f}x  [{same}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", action="append", default=[], help="more models (HF or AWQ folders)")
    parser.add_argument("--mapped", type=int, default=None, help="stream --folder models mapped, keeping K first/last layers")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"decode ms per token, {torch.get_num_threads()} threads, {args.rounds} rounds alternating, {args.tokens} tokens a request")
    work = scratch_dir("kvstream-fast-decoder-")
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
