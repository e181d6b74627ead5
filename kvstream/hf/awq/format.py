"""AutoAWQ's GEMM layout, bit for bit, and round-to-nearest group quantization.

A linear layer ``y = x @ W.T`` with ``W`` of shape [out, in] is stored as:

- ``qweight`` int32 [in, out / 8]: 4-bit values of ``W.T``, eight output columns per int32;
- ``qzeros`` int32 [in / group, out / 8]: the zero point of each group, packed the same way;
- ``scales`` float16 [in / group, out]: the scale of each group.

A weight is ``(q - zero) * scale``. Inside each int32, nibble ``i`` (bits 4i..4i+3) holds
output column ``AWQ_ORDER[i]`` of its eight: the interleave AutoAWQ's CUDA kernels unpack
fastest; reading back applies the inverse (``AWQ_REVERSE_ORDER``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = 4
PACK = 32 // BITS  # values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
SUPPORTED_GROUP_SIZES = (32, 64, 128)


@dataclass
class PackedLinear:
    """One quantized projection in the GEMM layout (``bias`` kept in full precision)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    bias: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1] * PACK

    def nbytes(self) -> int:
        tensors = [self.qweight, self.qzeros, self.scales] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def check_shape(out_features: int, in_features: int, group_size: int) -> None:
    """Raise ValueError naming what the layout cannot take."""
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group size {group_size} is not supported (one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))})")
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of the group size {group_size}")
    if out_features % PACK:
        raise ValueError(f"out_features {out_features} is not a multiple of {PACK}")


def pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] ints in 0..15 -> int32 [rows, cols / 8], AWQ's nibble order."""
    rows, cols = values.shape
    grouped = values.to(torch.int32).reshape(rows, cols // PACK, PACK)
    packed = torch.zeros(rows, cols // PACK, dtype=torch.int32)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= grouped[:, :, column] << (BITS * nibble)
    return packed


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, n] -> int32 [rows, 8n] values in 0..15, in column order."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=packed.device)
    nibbles = torch.bitwise_right_shift(packed.unsqueeze(-1), shifts) & 0xF  # [rows, n, 8] by nibble
    order = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return nibbles[:, :, order].reshape(packed.shape[0], -1)


def _rtn_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [groups, group, out], zero points [groups, out], fp16 scales [groups, out]) of
    round-to-nearest asymmetric 4-bit quantization (AutoAWQ's zero-point scheme)."""
    out_features, in_features = weight.shape
    check_shape(out_features, in_features, group_size)
    groups = weight.detach().float().T.reshape(in_features // group_size, group_size, out_features)
    high, low = groups.amax(dim=1), groups.amin(dim=1)  # [groups, out]
    scales = ((high - low).clamp(min=1e-5) / 15).to(torch.float16)
    s = scales.float()
    zeros = (-torch.round(low / s)).clamp(0, 15)
    q = (torch.round(groups / s.unsqueeze(1)) + zeros.unsqueeze(1)).clamp(0, 15)
    return q, zeros, scales


def fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight`` [out, in] as ``dequantize(quantize_rtn(weight))`` gives it back, transposed
    to [out, in], without packing: what the quantizer's searches score candidates with."""
    q, zeros, scales = _rtn_codes(weight, group_size)
    values = (q - zeros.unsqueeze(1)) * scales.float().unsqueeze(1)  # [groups, group, out]
    return values.reshape(weight.shape[1], weight.shape[0]).T


def quantize_rtn(weight: torch.Tensor, group_size: int) -> PackedLinear:
    """Round-to-nearest asymmetric 4-bit quantization of ``weight`` [out, in] per group of
    ``group_size`` input channels (AutoAWQ's zero-point scheme)."""
    out_features, in_features = weight.shape
    q, zeros, scales = _rtn_codes(weight, group_size)
    return PackedLinear(
        qweight=pack(q.reshape(in_features, out_features)),
        qzeros=pack(zeros),
        scales=scales,
        group_size=group_size,
    )


def dequantize(layer: PackedLinear, dtype: torch.dtype = torch.float32, columns: slice | None = None) -> torch.Tensor:
    """``W.T`` [in, out] (or the output ``columns``, a slice on multiples of 8) in ``dtype``."""
    qweight, qzeros, scales = layer.qweight, layer.qzeros, layer.scales
    if columns is not None:
        packed = slice(columns.start // PACK, columns.stop // PACK)
        qweight, qzeros, scales = qweight[:, packed], qzeros[:, packed], scales[:, columns]
    q = unpack(qweight).to(dtype)
    zeros = unpack(qzeros).to(dtype).repeat_interleave(layer.group_size, dim=0)
    return (q - zeros) * scales.to(dtype).repeat_interleave(layer.group_size, dim=0)
