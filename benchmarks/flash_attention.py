"""The ``flash`` tier (one Triton kernel reading the paged pool in place) against the ``sdpa``
tier (each context gathered out of the pool, then torch's SDPA, which on CUDA is its own
FlashAttention / memory-efficient kernel) on the same steps, per layer, same run, same timer.

    python benchmarks/flash_attention.py [--layers 8] [--dtype float16 bfloat16]

CUDA only (on a CPU the kernel runs only under Triton's interpreter, which says nothing about
speed). Both tiers go through ``paged_attention`` itself, the step's plan built once and used
by every layer as in the engine (the new K/V written into the pool, then attention), each call
on the next of ``--layers`` layers' pools so that K/V come from HBM, not from L2. Steps: decodes
at the issue's c=16, the long-context case (8 decodes at ~2,000 tokens), a larger batch, a
whole prompt, a chunk after a cached document, and a mixed step; for SmolLM2's geometry (9 query
heads over 3 KV heads, head dim 64) and a Llama-3-8B-like one (32 over 8, head dim 128). Prints
CUDA-event time per layer call (best of 5 rounds), the ratio sdpa / flash, the largest
difference between the two outputs and how many pieces flash split the decodes' keys into.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvstream.hf import flash  # noqa: E402
from kvstream.hf.attention import AttentionPlan, paged_attention  # noqa: E402
from kvstream.hf.kv_cache import KVShape, PagedKVCache  # noqa: E402

GEOMETRIES = (("SmolLM2-135M", 9, 3, 64), ("Llama-3-8B-like", 32, 8, 128))
# Per step: (tokens already in the pool, new tokens) per sequence.
STEPS = (
    ("16 decodes x ~300", [(300 - 7 * i, 1) for i in range(16)]),
    ("8 decodes x ~2,000", [(2000 - 13 * i, 1) for i in range(8)]),
    ("64 decodes x ~1,000", [(1000 - 5 * i, 1) for i in range(64)]),
    ("prompt of 2,000", [(0, 2000)]),
    ("512 after 2,000 cached", [(2000, 512)]),
    ("16 decodes + 256-token chunk", [(300 - 7 * i, 1) for i in range(16)] + [(500, 256)]),
)


class _Layer(torch.nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.layer_idx = index


def time_per_call(fn, calls: int) -> float:
    """Best-of-5 mean milliseconds per call, by CUDA events around ``calls`` calls."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="layers' pools, read in turn")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device: on a CPU the flash kernel runs only under Triton's interpreter")
    if flash.available():
        sys.exit(flash.available())
    device = torch.device("cuda")
    bs = args.block_size
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, block size {bs}, {args.layers} layers' pools in turn")
    print(f"{'geometry':<16} {'dtype':<9} {'step':<30} {'sdpa ms':>8} {'flash ms':>9} {'ratio':>7} {'max diff':>9} {'splits':>6}")
    generator = torch.Generator(device=device).manual_seed(0)
    for name, heads, kv_heads, dim in GEOMETRIES:
        for dtype_name in args.dtype:
            dtype = getattr(torch, dtype_name)
            for label, rows in STEPS:
                blocks = [-(-(cached + new) // bs) for cached, new in rows]
                cache = PagedKVCache(KVShape(args.layers, kv_heads, dim), sum(blocks) + 8, bs, 0, dtype, device)
                cache.k.normal_(generator=generator)
                cache.v.normal_(generator=generator)
                order = torch.randperm(cache.num_blocks, device="cpu").tolist()  # a busy pool's scattered blocks
                seqs, used = [], 0
                for (cached, new), count in zip(rows, blocks, strict=True):
                    seqs.append((order[used : used + count], cached, new))
                    used += count
                tokens = sum(new for _, new in rows)
                q = torch.randn(1, heads, tokens, dim, device=device, dtype=dtype, generator=generator)
                k = torch.randn(1, kv_heads, tokens, dim, device=device, dtype=dtype, generator=generator)
                v = torch.randn(1, kv_heads, tokens, dim, device=device, dtype=dtype, generator=generator)
                layers = [_Layer(i) for i in range(args.layers)]
                results = {}
                splits = 1
                for tier in ("sdpa", "flash"):
                    plan = AttentionPlan.build(cache, seqs, tier, heads)
                    if plan.flash is not None:
                        splits = max(launch.splits for launch in plan.flash.launches)
                    turn = itertools.cycle(layers)

                    def call(plan=plan, turn=turn):
                        return paged_attention(next(turn), q, k, v, None, None, kvstream_plan=plan)[0]

                    with torch.inference_mode():
                        output = paged_attention(layers[0], q, k, v, None, None, kvstream_plan=plan)[0].float()
                        results[tier] = (time_per_call(call, 20), output)
                (base, reference), (ours, output) = results["sdpa"], results["flash"]
                diff = float((reference - output).abs().max())
                print(f"{name:<16} {dtype_name:<9} {label:<30} {base:>8.3f} {ours:>9.3f} {base / ours:>6.2f}x {diff:>9.1e} {splits:>6}")
                del cache


if __name__ == "__main__":
    main()
