"""Which attention kernel the engine runs: chosen by probing at start, never by what imports.

Tiers, fastest first:

- ``flash``: a FlashAttention-2 style Triton kernel reading the paged pool in place for every
  row of a step, decodes and prefill chunks alike (flash.py); CUDA only (Triton comes with
  torch's CUDA builds);
- ``native``: decodes through a C++ kernel that reads the pool in place through the block
  tables (native_attention.py), compiled on first use; prefill chunks as ``sdpa``. CPU and
  float32 only (needs a C++ compiler and ninja);
- ``flex``: decodes through torch's ``flex_attention``, compiled, reading the pool in place
  through the block tables (flex.py); prefill chunks as ``sdpa``. Runs where torch.compile
  works (on CPU: a C++ compiler);
- ``sdpa``: each sequence's context gathered out of the pool, then torch's fused
  scaled-dot-product attention (``attention.py``);
- ``eager``: plain matmul-softmax in fp32, the reference every other tier is checked against.

``choose_tier`` runs each built candidate and ``eager`` through ``paged_attention`` on a
small pool with the model's own geometry (query heads, KV heads, head dim, dtype, device,
block size) and a packed row that holds every case a step can: a prefill chunk after cached tokens, a
whole-prompt prefill and decodes, with contexts that are not a multiple of the block size.
The first candidate that agrees to the dtype's tolerance runs; ``/status`` shows it as
``attention_backend`` and why each faster tier was not taken (``attention_backend_why``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from kvstream.hf import flash
from kvstream.hf.attention import NATIVE_CHUNK_MAX, AttentionPlan, paged_attention
from kvstream.hf.kv_cache import KVShape, PagedKVCache

logger = logging.getLogger(__name__)

TIERS = ("flash", "native", "flex", "sdpa", "eager")
# Largest absolute difference from eager a tier may show on the probe, per dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def probe_rows(block_size: int) -> tuple[tuple[int, int], ...]:
    """(tokens already in the pool, new tokens this step) per probe sequence: a short chunk
    after a cached head (the native tier reads it in place), a longer one (gathered), a whole
    prompt, and decodes whose contexts end mid-block, exactly at a block's end, and inside the
    first block, and one long enough that the flash tier splits its keys on a GPU."""
    return ((block_size + 3, 5), (1, NATIVE_CHUNK_MAX + 3), (0, 6), (2 * block_size + 1, 1), (block_size - 1, 1), (2, 1),
            (2 * flash.MIN_SPLIT_KEYS + 3, 1))


def unsupported(name: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why tier ``name`` cannot take this dtype or device, before building or probing it."""
    if name == "flash" and device.type != "cuda":
        return "CUDA only (a Triton kernel)"
    if name == "flash":
        return flash.available()
    if name == "native" and device.type != "cpu":
        return "CPU only (a C++ kernel)"
    if name == "native" and dtype != torch.float32:
        return f"float32 only, the model runs {str(dtype).removeprefix('torch.')}"
    return None


class AttentionTierError(ValueError):
    """The requested attention tier cannot run here (one line, naming why)."""


@dataclass(frozen=True)
class TierChoice:
    """The tier that runs, and why each faster one does not."""

    name: str
    why_not: dict[str, str] = field(default_factory=dict)


def _probe_error(
    kernel: str, num_heads: int, shape: KVShape, dtype: torch.dtype, device: torch.device, block_size: int,
    kv_dtype: torch.dtype | None = None,
) -> float:
    """Largest absolute difference between ``kernel`` and eager on one packed probe step
    (queries in ``dtype``, the pool in ``kv_dtype``, default the same)."""
    kv_dtype = kv_dtype or dtype
    generator = torch.Generator().manual_seed(0)
    rows = probe_rows(block_size)
    blocks_per_seq = -(-max(c + n for c, n in rows) // block_size)
    cache = PagedKVCache(
        KVShape(1, shape.num_kv_heads, shape.head_dim), blocks_per_seq * len(rows), block_size, 0, kv_dtype, device
    )
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator).to(kv_dtype))  # the cached heads
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator).to(kv_dtype))
    # Tables in reverse block order, so that no kernel can pass by reading slots in sequence.
    seqs = [(list(range((i + 1) * blocks_per_seq - 1, i * blocks_per_seq - 1, -1)), cached, new) for i, (cached, new) in enumerate(rows)]
    tokens = sum(new for _, new in rows)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, tokens, shape.head_dim, generator=generator).to(dtype).to(device)

    query, key, value = rand(num_heads), rand(shape.num_kv_heads), rand(shape.num_kv_heads)
    layer = SimpleNamespace(layer_idx=0)
    scale = shape.head_dim**-0.5
    outputs = []
    with torch.inference_mode():  # as the engine runs it (a compiled kernel guards on it)
        for name in (kernel, "eager"):  # both write the same new K/V, then read them back
            plan = AttentionPlan.build(cache, seqs, name, num_heads)
            outputs.append(paged_attention(layer, query, key, value, None, scale, kvstream_plan=plan)[0].float())
    return float((outputs[0] - outputs[1]).abs().max())


def choose_tier(
    requested: str, num_heads: int, shape: KVShape, dtype: torch.dtype, device: torch.device, block_size: int = 16,
    kv_dtype: torch.dtype | None = None,
) -> TierChoice:
    """The tier to run for ``requested`` (``auto`` or a tier name), the model computing in
    ``dtype`` over a pool of ``kv_dtype`` (default the same). Raises AttentionTierError
    when a named tier is not built, fails to run here (flex without a working torch.compile)
    or disagrees with eager."""
    if requested != "auto" and requested not in TIERS:
        raise AttentionTierError(f"attention backend {requested!r} is not one of auto, {', '.join(TIERS)}")
    candidates = TIERS if requested == "auto" else (requested,)
    tolerance = max(TOLERANCE.get(dtype, 5e-2), TOLERANCE.get(kv_dtype or dtype, 5e-2))
    why_not: dict[str, str] = {}
    if requested != "auto":  # the tiers faster than the one asked for
        for name in TIERS[: TIERS.index(requested)]:
            why_not[name] = f"attention.backend asks for {requested}"
    for name in candidates:
        if unsupported(name, dtype, device):
            why_not[name] = unsupported(name, dtype, device)
        elif name == "eager":
            return TierChoice("eager", why_not)
        else:
            try:
                error = _probe_error(name, num_heads, shape, dtype, device, block_size, kv_dtype)
            except Exception as exc:  # noqa: BLE001 - e.g. torch.compile without a C++ compiler
                first_line = (str(exc).strip().splitlines() or [""])[0][:200]
                why_not[name] = f"failed on the probe: {type(exc).__name__}: {first_line}"
                logger.warning("attention tier %s unavailable: %s", name, why_not[name])
            else:
                if error <= tolerance:
                    return TierChoice(name, why_not)
                why_not[name] = f"differs from eager by {error:.2g} on the probe (tolerance {tolerance:g})"
        if requested != "auto":
            raise AttentionTierError(f"attention backend {name}: {why_not[name]}")
    raise AssertionError("eager is always a candidate of auto")  # pragma: no cover
