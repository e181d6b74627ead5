"""The native AWQ kernel (``kvstream/hf/awq/awq_gemv.cpp``) against the other ways to run the
same layer, at the shapes of SmolLM2-135M's projections, per batch size, same timer, same run.

    python benchmarks/awq_kernel.py [--rows 1 4 8 16 32 48] [--threads N] [--megabytes 32]

Per shape and rows, the time per matrix of:

- ``native``: the kernel, reading the checkpoint's packed tensors as they are;
- ``native deq``: what the engine runs past ``native.MAX_ROWS`` rows: the kernel's C++
  dequantizer writes the weights in float32 (one pass), then BLAS;
- ``dequant``: ``AWQLinear``'s pure-torch path (a bounded chunk of the weights dequantized in
  several torch passes, then BLAS), the fallback where nothing compiles;
- ``int4mm``: torch's own CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) on the same
  weights repacked to its layout (where this torch build has it);
- ``fp32``: the unquantized layer, through the engine's float32 linear kernel (native_linear)
  where it takes the rows, ``F.linear`` above: what the same model runs without AWQ;
- ``no avx512`` (CPUs with AVX-512 only): the same kernel built without it, as on an AVX2 CPU
  (its nibbles converted to floats rather than made with one ternary-logic op);
- ``no prefetch``: the same kernel built without its software prefetches
  (``KVSTREAM_NO_PREFETCH``: every path asks for the words 64 inputs down into L2).

Each case walks a set of distinct copies of one shape's weights (``--megabytes`` of packed
AWQ weights, eight times that in float32) one after another, as a forward does, so that the
weights come from memory and not from the caches. Ratios are ``native``'s speedup over each
(> 1: native faster). The engine sends up to ``native.MAX_ROWS`` rows to the kernel and more
to ``native deq``: where the two cross is what MAX_ROWS should be.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _util import best_per_item_s, built_kernel  # noqa: E402

from kvstream.hf import native_build, native_linear  # noqa: E402
from kvstream.hf.awq import native  # noqa: E402
from kvstream.hf.awq.format import dequantize, quantize_rtn  # noqa: E402
from kvstream.hf.awq.linear import AWQLinear, int4_layout  # noqa: E402

SHAPES = {"mlp gate/up": (1536, 576), "mlp down": (576, 1536), "attn q/o": (576, 576)}


def native_call(layer: AWQLinear, x: torch.Tensor) -> torch.Tensor:
    """The kernel itself at any row count (the engine stops at native.MAX_ROWS)."""
    return native.gemv(x, layer.qweight, layer.qzeros, layer.scales, layer.packed_order, layer.group_size)


def native_dequant_call(layer: AWQLinear, x: torch.Tensor) -> torch.Tensor:
    return layer._native_dequant_matmul(x)


def dequant_call(layer: AWQLinear, x: torch.Tensor) -> torch.Tensor:
    layer.kernel = "dequant"
    return layer(x)


def int4mm_call(layer: tuple, x: torch.Tensor) -> torch.Tensor:
    packed, scales_and_zeros, group_size = layer
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


def fp32_call(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    module, _ = native_linear.load()
    if x.shape[0] <= native_linear.MAX_ROWS and module is not None:
        return module.native_linear(x, weight)
    return F.linear(x, weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--megabytes", type=int, default=32, help="packed AWQ weights per shape (fp32: 8x that)")
    parser.add_argument("--group-size", type=int, default=64, help="SmolLM2's checkpoints here use 64 (576 = 4.5 x 128)")
    args = parser.parse_args()
    _, how = built_kernel(native.load, "native AWQ kernel", args.threads)
    print(f"AWQ int4 (group {args.group_size}) kernels, float32 activations, {torch.get_num_threads()} threads; "
          f"native ({how}) takes up to {native.MAX_ROWS} rows in the engine")
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    unprefetched, why = native_build.load_extension(
        "kvstream_awq_gemv_no_prefetch", native.SOURCE, extra_flags=(*(native.AVX512_FLAGS if avx512 else ()), "-DKVSTREAM_NO_PREFETCH"))
    if unprefetched is None:
        sys.exit(f"the kernel without prefetches did not build: {why}")
    no_avx512 = None
    if avx512:
        no_avx512, why = native_build.load_extension("kvstream_awq_gemv_no_avx512", native.SOURCE)
        if no_avx512 is None:
            sys.exit(f"the kernel without AVX-512 did not build: {why}")
    print(f"{'shape':<13}{'rows':>5}{'native ms':>11}{'native deq':>11}{'dequant':>9}{'int4mm':>9}{'fp32':>9}"
          f"{'vs nat deq':>11}{'vs dequant':>11}{'vs int4mm':>10}{'vs fp32':>9}{'GB/s':>7}{'rel diff':>10}"
          f"{'no avx512':>10}{'vs it':>7}{'no prefetch':>12}{'vs it':>7}")
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (out, inp) in SHAPES.items():
            measure(name, out, inp, args, generator, no_avx512, unprefetched)


def measure(name: str, out: int, inp: int, args: argparse.Namespace, generator: torch.Generator, no_avx512, unprefetched) -> None:
    """Every kernel on ``--megabytes`` of one shape's weights, at each row count: one table row each."""
    weight = torch.randn(out, inp, generator=generator) * inp**-0.5
    packed = quantize_rtn(weight, args.group_size)
    template = AWQLinear(packed)
    count = max(2, args.megabytes * 2**20 // template.packed_bytes())
    # Distinct copies of the same values: what is timed is where the bytes come from.
    awq = [AWQLinear(type(packed)(packed.qweight.clone(), packed.qzeros.clone(), packed.scales.clone(), args.group_size, None))
           for _ in range(count)]
    dense = dequantize(packed).T.contiguous()  # [out, in], the values the AWQ layers hold
    fp32 = [dense.clone() for _ in range(count)]
    try:
        int4 = [(*int4_layout(layer), args.group_size) for layer in awq]
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        print(f"  int4mm unavailable on this torch: {type(exc).__name__}")
        int4 = None
    for rows in args.rows:
        x = torch.randn(rows, inp, generator=generator)
        native_s = best_per_item_s(lambda layer: native_call(layer, x), awq)
        native_deq_s = best_per_item_s(lambda layer: native_dequant_call(layer, x), awq)
        dequant_s = best_per_item_s(lambda layer: dequant_call(layer, x), awq)
        int4_s = best_per_item_s(lambda layer: int4mm_call(layer, x), int4) if int4 else float("nan")
        fp32_s = best_per_item_s(lambda layer: fp32_call(layer, x), fp32)
        def other_build(module):
            return lambda layer: module.awq_gemv(x, layer.qweight, layer.qzeros, layer.scales, layer.packed_order, layer.group_size)

        plain_s = best_per_item_s(other_build(no_avx512), awq) if no_avx512 is not None else float("nan")
        unprefetched_s = best_per_item_s(other_build(unprefetched), awq)
        reference = x @ dense.T
        diff = (native_call(awq[0], x) - reference).abs().max().item() / reference.abs().max().item()
        bandwidth = template.packed_bytes() / native_s / 1e9
        print(f"{name:<13}{rows:>5}{native_s * 1e3:>11.3f}{native_deq_s * 1e3:>11.3f}{dequant_s * 1e3:>9.3f}{int4_s * 1e3:>9.3f}"
              f"{fp32_s * 1e3:>9.3f}{native_deq_s / native_s:>10.2f}x{dequant_s / native_s:>10.2f}x{int4_s / native_s:>9.2f}x"
              f"{fp32_s / native_s:>8.2f}x{bandwidth:>7.1f}{diff:>10.1e}{plain_s * 1e3:>10.3f}{plain_s / native_s:>6.2f}x"
              f"{unprefetched_s * 1e3:>12.3f}{unprefetched_s / native_s:>6.2f}x")


if __name__ == "__main__":
    main()
