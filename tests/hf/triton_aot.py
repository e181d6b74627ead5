"""Compile the engine's Triton kernels ahead of time for NVIDIA GPUs, with no GPU present.

    python -m tests.hf.triton_aot [--flash | --awq] [ARCH ...]   # default: both; 90 (Hopper) 86 (Ampere)

Triton's whole pipeline runs on the CPU, its ptxas included, down to a cubin: this checks
that every variant the engine launches compiles for the architecture and how much shared
memory each asks for (a block asking for more than the architecture has fails at launch, on
a GPU only): the flash tier's (float16 / bfloat16 / float32, head dims 64 and 128, decode and
chunk programs, split and unsplit, and the split combine) and the AWQ matmul's (the three
precisions, decode-sized and large row tiles). Prints one JSON line per variant. Run in its
own process by tests/hf/test_flash_tier.py and tests/hf/test_awq_triton.py: under
``TRITON_INTERPRET`` (which the tests set) the kernels are interpreted functions, which do
not compile.
"""

from __future__ import annotations

import json
import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from kvstream.hf import flash
from kvstream.hf.awq import triton_matmul
from kvstream.hf.awq.triton_kernel import awq_matmul
from kvstream.hf.flash_kernel import combine_splits, paged_flash

POINTERS = ("Q", "K", "V", "O", "partial_out", "partial_lse", "tables", "cached", "starts", "lengths", "tile_seqs",
            "tile_firsts")
INDEX_POINTERS = {"tables", "cached", "starts", "lengths", "tile_seqs", "tile_firsts"}


def _signature(fn, pointer_types: dict[str, str], floats: set[str], constants: dict[str, object]) -> ASTSource:
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    return ASTSource(fn, signature, constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Shared memory a block may use, by architecture (CUDA's programming guide, compute capabilities).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def variants(which: str = "all"):
    """(description, dtype, ASTSource, options) for each kernel variant the engine can launch
    (``which``: "flash", "awq" or "all")."""
    if which in ("awq", "all"):
        yield from awq_variants()
    if which not in ("flash", "all"):
        return
    for dtype in DTYPES:
        for head_dim in (64, 128):
            for rows, splits in ((flash.MIN_ROWS, 1), (flash.MIN_ROWS, 4), (flash.CHUNK_ROWS, 1)):
                partial = "*fp32" if splits > 1 else f"*{dtype}"
                pointers = {name: ("*i32" if name in INDEX_POINTERS else partial if name.startswith("partial") else f"*{dtype}")
                            for name in POINTERS}
                constants = {"GROUP": 4, "BLOCK_M": rows, "BLOCK_N": flash.KEYS_PER_TILE, "BLOCK_SIZE": 16,
                             "HEAD_DIM": head_dim, "HEAD_DIM_PADDED": head_dim, "IEEE": dtype == "fp32", "SPLITS": splits}
                yield (f"paged_flash {dtype} d{head_dim} rows{rows} splits{splits}", dtype,
                       _signature(paged_flash, pointers, {"scale_log2"}, constants), flash_options(dtype))
            pointers = {"partial_out": "*fp32", "partial_lse": "*fp32", "O": f"*{dtype}", "starts": "*i32", "tile_seqs": "*i32"}
            yield (f"combine_splits {dtype} d{head_dim}", dtype,
                   _signature(combine_splits, pointers, set(), {"SPLITS": 4, "HEAD_DIM": head_dim, "HEAD_DIM_PADDED": head_dim}),
                   flash_options(dtype))


def flash_options(dtype: str) -> dict[str, int]:
    return {"num_warps": flash.NUM_WARPS, "num_stages": flash.num_stages(DTYPES[dtype])}


def awq_variants():
    """The AWQ matmul: each precision, decode-sized and large row tiles (group size 128)."""
    options = {"num_warps": triton_matmul.NUM_WARPS, "num_stages": triton_matmul.NUM_STAGES}
    for dtype in DTYPES:
        for block_m in (triton_matmul.SMALL_ROWS, triton_matmul.LARGE_ROWS):
            pointers = {"X": f"*{dtype}", "QWEIGHT": "*i32", "QZEROS": "*i32", "SCALES": "*fp16", "OUT": "*fp32"}
            constants = {"GROUP_SIZE": 128, "BLOCK_M": block_m, "BLOCK_N": triton_matmul.BLOCK_N,
                         "BLOCK_K": triton_matmul.BLOCK_K, "IEEE": dtype == "fp32"}
            yield f"awq_matmul {dtype} rows{block_m}", dtype, _signature(awq_matmul, pointers, set(), constants), options


def main(archs: list[int], which: str) -> None:
    for arch in archs:
        for name, _, source, options in variants(which):
            kernel = compile(source, target=GPUTarget("cuda", arch, 32), options=options)
            print(json.dumps({"arch": arch, "kernel": name, "shared_bytes": kernel.metadata.shared,
                              "shared_limit": SHARED_LIMIT.get(arch), "cubin_bytes": len(kernel.asm["cubin"])}), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    which = args.pop(0).removeprefix("--") if args and args[0] in ("--flash", "--awq") else "all"
    main([int(arch) for arch in args] or [90, 86], which)
