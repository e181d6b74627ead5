"""The native linear kernel (``kvstream/hf/native_linear.cpp``) against ``F.linear`` (torch's
BLAS sgemm) at the shapes of SmolLM2-135M's layers, per batch size, same weights, same timer,
same run.

    python benchmarks/native_linear.py [--rows 1 4 8 16 32 64 128] [--threads N]

Each case multiplies ``rows`` rows by a set of distinct weight matrices of one shape whose
total (>= 256 MB) is far larger than the CPU's caches, one after another, as a forward does:
the weights come from memory, as they do in the engine (a single matrix timed in a loop would
sit in cache and measure something no forward sees). Shapes: the MLP's gate/up (1536 x 576),
its down projection (576 x 1536), the attention's q/o (576 x 576) and the LM head (49152 x 576).
Prints, per shape and rows, both times per matrix, the ratio, the kernel's weight bandwidth
and GFLOP/s, and the largest difference from F.linear relative to the largest output. The
engine sends batches of up to ``native_linear.MAX_ROWS`` rows to the kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _util import best_per_item_s, built_kernel  # noqa: E402

from kvstream.hf import native_linear  # noqa: E402

SHAPES = {"mlp gate/up": (1536, 576), "mlp down": (576, 1536), "attn q/o": (576, 576), "lm head": (49152, 576)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--megabytes", type=int, default=256, help="weights per shape (past the caches)")
    args = parser.parse_args()
    module, how = built_kernel(native_linear.load, "native linear kernel", args.threads)
    print(f"native linear ({how}) vs F.linear, float32, {torch.get_num_threads()} threads; kernel up to {native_linear.MAX_ROWS} rows in the engine")
    print(f"{'shape':<13}{'rows':>5}{'F.linear ms':>13}{'native ms':>11}{'ratio':>7}{'GB/s':>7}{'GFLOP/s':>9}{'rel diff':>10}")
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for label, (n, k) in SHAPES.items():
            count = max(2, args.megabytes * 2**20 // (n * k * 4))
            weights = [torch.randn(n, k, generator=generator) / k**0.5 for _ in range(count)]
            for rows in args.rows:
                x = torch.randn(rows, k, generator=generator)
                base = best_per_item_s(lambda w: F.linear(x, w), weights)
                mine = best_per_item_s(lambda w: module.native_linear(x, w), weights)
                want = F.linear(x, weights[0])
                diff = float((module.native_linear(x, weights[0]) - want).abs().max() / want.abs().max())
                print(f"{label:<13}{rows:>5}{base * 1e3:>13.3f}{mine * 1e3:>11.3f}{base / mine:>6.2f}x"
                      f"{n * k * 4 / mine / 1e9:>7.1f}{2 * rows * n * k / mine / 1e9:>9.1f}{diff:>10.1e}")
            del weights


if __name__ == "__main__":
    main()
