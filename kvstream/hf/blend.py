"""Chunk-level KV reuse for moved text (opt-in ``reuse: blend``): RAG prompts that hold the
same documents in another order, or after another prefix.

Exact prefix caching only helps when everything before a block is identical. Here a prompt's
later text is also matched, block by block, against the *content* of cached blocks wherever
they were computed, and their KV is reused at the new position:

1. **Match.** From the end of the exact prefix hit, every window of ``block_size`` tokens is
   looked up by content in the pool's cached blocks (any alignment: a document need not start
   at a block boundary in either prompt). The prompt's last token is always computed.
2. **Move.** The matched tokens' K/V are copied into the new sequence's slots, and keys are
   re-rotated by the position delta: a RoPE key at position p becomes the key at q by one more
   rotation of ``q - p`` (values carry no position).
3. **Repair** (CacheBlend, Yao et al. 2024). A moved chunk's KV still reflects its *old*
   preceding context. The prompt is run through the first ``select_layer + 1`` layers (cheap),
   giving true keys there; the moved tokens whose keys deviate most get recomputed through all
   layers, ``blend_ratio`` of them, together with the first ``seam_tokens`` after every seam,
   every unmatched token and the suffix, attending to the blended context.
4. **Cost model.** Blending is skipped when the measured cost per prefill token says that
   recomputing everything would be faster (short chunks on a small model).

The result is approximate by design: the blocks from the first moved token on are never
entered into the exact prefix cache, and exact prefix hits never go through any of this.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kvstream.config import default
from kvstream.hf.block_manager import ReusePool


@dataclass
class BlendParams:
    """Per-request blend settings (``reuse: blend``)."""

    blend_ratio: float = default("prefix_cache", "blend_ratio")  # share of moved tokens recomputed by the repair (0 = no repair)
    seam_tokens: int = 2  # tokens always recomputed at the start of every moved run
    select_layer: int = 1  # layer whose key deviation picks the tokens to recompute
    min_tokens: int = 32  # fewer moved tokens than this are not worth a blend


@dataclass
class BlendPlan:
    """What a blend prefill does for one sequence."""

    copies: list[tuple[int, int, int]]  # (destination position, source slot, source position), one per block
    run_starts: list[int]  # destination positions where a moved run begins (a seam)
    start: int  # first position this prefill covers (the end of the exact hit)
    end: int  # one past the last position it covers (the prompt's last token is left out)
    block_size: int

    @property
    def moved_tokens(self) -> int:
        return len(self.copies) * self.block_size

    def approx_positions(self) -> list[int]:
        return [dst + i for dst, _, _ in self.copies for i in range(self.block_size)]


@dataclass
class BlendCosts:
    """Measured costs for the cost model (exponential moving averages, seconds per token)."""

    prefill_s_per_token: float | None = None
    move_s_per_token: float | None = None

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else 0.8 * old + 0.2 * new

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        if tokens >= 16:
            self.prefill_s_per_token = self._ema(self.prefill_s_per_token, seconds / tokens)

    def observe_move(self, seconds: float, tokens: int) -> None:
        if tokens:
            self.move_s_per_token = self._ema(self.move_s_per_token, seconds / tokens)

    def worth_it(self, plan: BlendPlan, params: BlendParams, num_layers: int) -> bool:
        """Blend only if moving + probing + recomputing beats computing every token."""
        moved = plan.moved_tokens
        if moved < params.min_tokens:
            return False
        if self.prefill_s_per_token is None:
            return True  # nothing measured yet: try, and learn
        span = plan.end - plan.start
        probe = span * (params.select_layer + 1) / num_layers if params.blend_ratio > 0 else 0.0
        recomputed = span - moved + moved * params.blend_ratio + params.seam_tokens * len(plan.run_starts)
        blend_s = (probe + recomputed) * self.prefill_s_per_token + moved * (self.move_s_per_token or 0.0)
        return blend_s < span * self.prefill_s_per_token


def find_moved_chunks(pool: ReusePool, token_ids: list[int], start: int, block_size: int) -> BlendPlan:
    """Match ``token_ids[start:-1]`` against the content of the pool's cached blocks.

    Windows are tried at every offset; a match takes its ``block_size`` tokens. A match that
    continues the previous one in both prompts (adjacent here, adjacent in the source)
    extends a run; any other starts a new run, whose first tokens are a seam."""
    end = len(token_ids) - 1
    plan = BlendPlan([], [], start, end, block_size)
    i = start
    previous: tuple[int, int] | None = None  # (destination end, source end) of the last match
    while i + block_size <= end:
        block = pool.lookup_content(tuple(token_ids[i : i + block_size]))
        if block is None:
            i += 1
            continue
        if previous != (i, block.start):
            plan.run_starts.append(i)
        plan.copies.append((i, block.block_id * block_size, block.start))
        previous = (i + block_size, block.start + block_size)
        i += block_size
    return plan


class RotaryShift:
    """Re-rotates RoPE keys from one position to another (``rotate_half`` convention)."""

    def __init__(self, model: torch.nn.Module) -> None:
        rotary = _find_rotary(model)
        if rotary is None:
            raise ValueError("blend reuse needs a rotary-embedding model (no rotary_emb found)")
        self.inv_freq = rotary.inv_freq.detach().float()
        self.rot_dim = 2 * self.inv_freq.numel()

    def shift(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``keys`` ``[layers, T, kv_heads, head_dim]`` at positions p -> the keys at p + delta
        (``delta`` ``[T]``)."""
        angles = delta.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]  # [T, rot/2]
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[None, :, None, :].to(keys.device)
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[None, :, None, :].to(keys.device)
        rot = keys[..., : self.rot_dim].float()
        half = self.rot_dim // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = keys.clone()
        out[..., : self.rot_dim] = (rot * cos + rotated_half * sin).to(keys.dtype)
        return out


def _find_rotary(model: torch.nn.Module):
    for name in ("model.rotary_emb", "rotary_emb", "model.model.rotary_emb"):
        obj = model
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None and hasattr(obj, "inv_freq"):
            return obj
    return None


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's list of decoder layers (``model.model.layers`` in the Llama family)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None


def select_for_repair(deviation: torch.Tensor, positions: list[int], ratio: float) -> list[int]:
    """The ``ratio`` share of ``positions`` with the largest ``deviation`` (same order)."""
    if ratio <= 0 or not positions:
        return []
    count = min(len(positions), math.ceil(ratio * len(positions)))
    top = torch.topk(deviation, count).indices.tolist()
    return sorted(positions[i] for i in top)


class Stopwatch:
    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
