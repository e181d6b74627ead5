"""The AWQ projection on CUDA: launching ``triton_kernel.awq_matmul`` over the packed tensors.

The kernel reads the checkpoint's GEMM layout as it is (no repacking at load, so a streamed
layer's staging slot is computed from directly) and unpacks each weight in registers. Tiles:
16 input rows (``tl.dot``'s smallest) up to 16 rows, 64 above; 64 output columns; 32 input
features a step. Inputs too small to give every SM two programs split their input features
over several programs (split-K, at most ``MAX_SPLITS``), whose float32 partial sums are added
here. Float32 inputs multiply in IEEE float32 (no TF32), so that a float32 model computes what
the CPU kernels do to float tolerance; float16 / bfloat16 multiply in their own precision with
float32 sums.

Written and tested under Triton's interpreter on the CPU, and compiled to sm_90 / sm_86 cubins
without a GPU (``tests/hf/triton_aot.py``); never run on a GPU here.
"""

from __future__ import annotations

import functools

import torch

from kvstream.hf.awq.format import PACK

BLOCK_K = 32  # divides every supported group size (32, 64, 128): a K tile is in one group
BLOCK_N = 64
SMALL_ROWS, LARGE_ROWS = 16, 64  # BLOCK_M up to 16 rows, and above
NUM_WARPS = 4
NUM_STAGES = 3
PROGRAMS_PER_PROCESSOR = 2
MAX_SPLITS = 16


def why_unavailable(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device``; None where it can."""
    if device.type != "cuda":
        return "CUDA only (a Triton kernel)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install 'kvstream[cuda]')"
    return None


@functools.cache
def _processors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter on CPU (tests): small enough that splits are exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_shape(rows: int, in_features: int, out_features: int, processors: int) -> tuple[int, int]:
    """(BLOCK_M, splits) for an input of ``rows`` rows: as many splits of the input features
    (each a whole number of ``BLOCK_K`` steps) as it takes for ``PROGRAMS_PER_PROCESSOR``
    programs per SM, at most ``MAX_SPLITS``."""
    block_m = SMALL_ROWS if rows <= SMALL_ROWS else LARGE_ROWS
    tiles = -(-rows // block_m) * -(-out_features // BLOCK_N)
    steps = in_features // BLOCK_K
    wanted = min(MAX_SPLITS, steps, -(-PROGRAMS_PER_PROCESSOR * processors // tiles))
    splits = max(s for s in range(1, wanted + 1) if steps % s == 0)
    return block_m, splits


def matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x`` [rows, in] times the packed ``W.T`` [in, out]: [rows, out] in ``x``'s dtype."""
    from kvstream.hf.awq.triton_kernel import awq_matmul

    x = x.contiguous()
    rows, in_features = x.shape
    out_features = qweight.shape[1] * PACK
    if rows == 0:  # a grid of no programs is not launched
        return x.new_empty(0, out_features)
    block_m, splits = launch_shape(rows, in_features, out_features, _processors(x.device))
    partial = torch.empty(splits, rows, out_features, dtype=torch.float32, device=x.device)
    grid = (-(-rows // block_m), -(-out_features // BLOCK_N), splits)
    awq_matmul[grid](
        x, qweight, qzeros, scales, partial, rows, out_features, in_features // splits,
        x.stride(0), partial.stride(0), partial.stride(1),
        GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    summed = partial[0] if splits == 1 else partial.sum(dim=0)
    return summed.to(x.dtype)
