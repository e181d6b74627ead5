"""KIVI-style quantization of whole KV blocks (Liu et al., 2024, "KIVI: A Tuning-Free
Asymmetric 2bit Quantization for KV Cache").

Keys have a few outlier *channels* that stay large across tokens, so keys are quantized per
channel: one (min, scale) pair per (layer, head, channel) over the block's tokens, the group
being the block. Values have no such channels, and attention mixes them per token, so values
are quantized per token: one pair per (layer, token, head) over the head's channels.

Only full blocks are quantized here (the prefix cache and its spill tiers only ever hold
full blocks); a sequence's partial last block stays in the pool at full precision.

A block is ``k, v`` shaped ``[layers, block_size, kv_heads, head_dim]``. 8-bit codes take one
byte each; 4-bit codes are packed two to a byte along the last axis. Mins and scales are
float16. Dequantized values are within ``scale / 2`` of the originals (round to nearest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)


@dataclass
class QuantizedTensor:
    """Codes plus the (min, scale) of each group; ``axis`` is the axis a group spans."""

    codes: torch.Tensor  # uint8; 4-bit codes packed in pairs along the last axis
    minimum: torch.Tensor  # float16, the input's shape with ``axis`` reduced to 1
    scale: torch.Tensor  # float16, same shape as ``minimum``
    bits: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.minimum, self.scale))


@dataclass
class QuantizedBlock:
    k: QuantizedTensor  # per channel: groups span the token axis
    v: QuantizedTensor  # per token: groups span the channel axis

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


# Axes of a block [layers, tokens, heads, channels] that one group spans.
KEY_AXIS = 1  # tokens: one group per channel
VALUE_AXIS = 3  # channels: one group per token


def quantize(x: torch.Tensor, bits: int, axis: int) -> QuantizedTensor:
    """Asymmetric round-to-nearest quantization of ``x`` in groups along ``axis``."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"kv_cache_bits must be one of {SUPPORTED_BITS}, not {bits}")
    levels = (1 << bits) - 1
    x = x.float()
    lo = x.amin(dim=axis, keepdim=True)
    hi = x.amax(dim=axis, keepdim=True)
    # Round the group's range to float16 first, so the codes are computed with the very
    # scale the dequantizer will use.
    lo16 = lo.to(torch.float16)
    scale16 = ((hi - lo16.float()) / levels).clamp_min(1e-8).to(torch.float16)
    codes = ((x - lo16.float()) / scale16.float()).round_().clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        if codes.shape[-1] % 2:
            raise ValueError("4-bit packing needs an even head_dim")
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedTensor(codes.contiguous(), lo16, scale16, bits, tuple(x.shape))


def dequantize(q: QuantizedTensor, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The float tensor ``q`` stands for, in ``dtype`` on ``device``."""
    codes = q.codes.to(device)
    if q.bits == 4:
        unpacked = torch.empty(*codes.shape[:-1], codes.shape[-1] * 2, dtype=torch.uint8, device=codes.device)
        unpacked[..., 0::2] = codes & 0x0F
        unpacked[..., 1::2] = codes >> 4
        codes = unpacked
    x = codes.float() * q.scale.to(device).float() + q.minimum.to(device).float()
    return x.to(dtype)


def quantize_block(k: torch.Tensor, v: torch.Tensor, bits: int) -> QuantizedBlock:
    """One full block's K (per channel) and V (per token)."""
    return QuantizedBlock(quantize(k, bits, KEY_AXIS), quantize(v, bits, VALUE_AXIS))


def dequantize_block(block: QuantizedBlock, dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return dequantize(block.k, dtype, device), dequantize(block.v, dtype, device)
