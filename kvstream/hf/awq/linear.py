"""``AWQLinear``: a linear layer that computes from AWQ-packed weights.

Four kernels, chosen once per process and device by ``probe_kernel`` (correct on a real
shape, then the fastest; never assumed from what imports or compiles):

- ``native``: ``native.py``'s compiled kernel for up to ``native.MAX_ROWS`` rows (decode
  steps, batches), reading the checkpoint's tensors as they are (nothing derived, no weight
  materialized); more rows (prefill chunks) get a bounded block of columns at a time
  dequantized by its C++ companion in one pass, then BLAS;
- ``dequant``: pure torch. Output columns are dequantized a bounded chunk at a time (never
  more than ``CHUNK_BYTES`` of floats) in the packed, interleaved column order, multiplied,
  and the product's columns put back in order: cheaper than reordering the weights;
- ``int4mm``: torch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``) on weights
  repacked to its layout at load. On the machines measured here it was slower than
  ``dequant`` (see ``probe_kernel``), so it is only taken where it wins;
- ``triton`` (CUDA): ``triton_matmul.py``'s kernel, unpacking the checkpoint's tensors in
  registers for any number of rows. On CUDA the candidates are ``triton`` and ``dequant``
  (which runs on any device).

The packed tensors are plain attributes, not parameters: layer streaming swaps them for
staging-slot views before each forward (``streaming``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstream.hf.awq import native, triton_matmul
from kvstream.hf.awq.format import AWQ_REVERSE_ORDER, BITS, PACK, PackedLinear, dequantize, unpack

logger = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 1024 * 1024  # most bytes of dequantized weight alive at once, per layer
PACKED_NAMES = ("qweight", "qzeros", "scales")


def logical_order(out_features: int) -> torch.Tensor:
    """Index that takes a product in packed (interleaved) column order to column order."""
    base = torch.arange(0, out_features, PACK).repeat_interleave(PACK)
    return base + torch.tensor(AWQ_REVERSE_ORDER).repeat(out_features // PACK)


class AWQLinear(torch.nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as AWQ GEMM tensors (``qweight``, ``qzeros``,
    ``scales``); ``dtype`` is the activations' (the engine's) precision."""

    kernel = "dequant"
    # Set by the layer streamer: nothing derived from the packed tensors (int4mm's repacked
    # weights) is kept past the call, or every streamed layer's would stay resident.
    streamed = False
    # The packed tensors (plain attributes, see ``load``).
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    _derived: tuple[torch.Tensor, torch.Tensor] | None
    _derive_into: tuple[torch.Tensor, ...] | None

    def __init__(self, packed: PackedLinear, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.group_size = packed.group_size
        self.dtype = dtype
        self.bias = None if packed.bias is None else torch.nn.Parameter(packed.bias.to(dtype), requires_grad=False)
        self.order = logical_order(self.out_features)
        self.packed_order = self.order.argsort()  # fixed by the shape: not recomputed per load()
        self.load(packed.qweight, packed.qzeros, packed.scales)

    def load(
        self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, derive_into: tuple[torch.Tensor, ...] | None = None
    ) -> None:
        """Point the layer at these packed tensors (resident, mapped, or a staging slot);
        ``derive_into``: ``derive_buffers`` to compute ``derive`` into, when the dequant
        kernel needs it (a staging slot's, so that streamed layers do not churn the heap)."""
        # Plain attributes written straight into the instance dict: nn.Module.__setattr__
        # checks each value against parameters, buffers and submodules, which cost a streamed
        # forward ~5 ms a token on SmolLM2 (five attributes, seven projections, 26 layers).
        vars(self).update(qweight=qweight, qzeros=qzeros, scales=scales, _derived=None, _derive_into=derive_into)

    def derive(self, into: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per group: zero x scale and scale, in the packed column order (groups x out). With
        ``into`` (buffers from ``derive_buffers``), computed there without allocating: a
        staging slot's, so that streamed layers do not churn the heap every forward."""
        groups = self.qzeros.shape[0]
        if into is None:
            into = derive_buffers(groups, self.out_features, self.dtype, self.qzeros.device)
        zs, scales, nibbles, half = into
        torch.bitwise_right_shift(self.qzeros.unsqueeze(-1), shifts(self.qzeros.device), out=nibbles.view(groups, -1, PACK))
        nibbles.bitwise_and_(0xF)
        torch.index_select(self.scales, 1, self.packed_order, out=half)
        scales.copy_(half)
        zs.copy_(nibbles).mul_(scales)
        return zs, scales

    def packed(self) -> PackedLinear:
        return PackedLinear(self.qweight, self.qzeros, self.scales, self.group_size, self.bias)

    def move(self, device: torch.device, packed: bool = True) -> None:
        """Put the layer on ``device``: its column orders and bias, and with ``packed`` its
        packed tensors too (a streamed layer's come from its staging slots instead)."""
        self.order, self.packed_order = self.order.to(device), self.packed_order.to(device)
        if self.bias is not None:
            self.bias = torch.nn.Parameter(self.bias.to(device), requires_grad=False)
        if packed:
            self.load(self.qweight.to(device), self.qzeros.to(device), self.scales.to(device))

    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qzeros, self.scales))

    def _zeros_and_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._derived is None:
            self._derived = self.derive(self._derive_into)
        return self._derived

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "triton":
            flat = x.reshape(-1, self.in_features).to(self.dtype)
            y = triton_matmul.matmul(flat, self.qweight, self.qzeros, self.scales, self.group_size)
            y = y.reshape(*x.shape[:-1], self.out_features)
        elif self.kernel == "int4mm":
            y = int4mm(self, x)
        elif self.kernel == "native" and self.dtype == torch.float32:
            flat = x.reshape(-1, self.in_features)
            if flat.shape[0] <= native.MAX_ROWS:
                y = native.gemv(flat, self.qweight, self.qzeros, self.scales, self.packed_order, self.group_size)
            else:
                y = self._native_dequant_matmul(flat)
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = self._dequant_matmul(x)
        return y if self.bias is None else y + self.bias

    def direct_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``forward`` for ``[rows, in]`` inputs with its per-call choices made now (the kernel,
        the dtype): what the engine's direct decoder path (fast_decoder.py) calls, where the
        Python of ``forward`` cost as much as a decode-sized kernel call. The packed tensors
        are read at each call: streaming re-points them."""
        if self.kernel != "native" or self.dtype != torch.float32:
            return self.forward
        gemv, bias = native.load()[0].awq_gemv, self.bias

        def call(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > native.MAX_ROWS:
                y = self._native_dequant_matmul(x)
            else:
                y = gemv(x, self.qweight, self.qzeros, self.scales, self.packed_order, self.group_size)
            return y if bias is None else y + bias

        return call

    @staticmethod
    def fused_call(modules: list[AWQLinear]) -> Callable[[torch.Tensor], list[torch.Tensor]] | None:
        """One call for several projections of the same ``[rows, in]`` input (a layer's Q,
        K and V; gate and up): each module's output, computed by one native kernel call up to
        ``native.MAX_ROWS`` rows (the threads share out all the projections' words at once)
        and by each module's own call above. Bit for bit what the modules give one by one.
        None where they cannot share a call: a kernel other than ``native``, other precisions,
        input widths or group sizes. Like ``direct_call``, reads the packed tensors at each
        call (streaming re-points them)."""
        first = modules[0]
        if any(not isinstance(m, AWQLinear) or m.kernel != "native" or m.dtype != torch.float32
               or (m.in_features, m.group_size) != (first.in_features, first.group_size) for m in modules):
            return None
        many, group_size = native.load()[0].awq_gemv_many, first.group_size
        singles = [m.direct_call() for m in modules]
        orders = [m.packed_order for m in modules]
        biases = [m.bias for m in modules]

        def call(x: torch.Tensor) -> list[torch.Tensor]:
            if x.shape[0] > native.MAX_ROWS:
                return [single(x) for single in singles]
            ys = many(x, [m.qweight for m in modules], [m.qzeros for m in modules], [m.scales for m in modules], orders, group_size)
            return [y if bias is None else y + bias for y, bias in zip(ys, biases)]

        return call

    def _native_dequant_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        """Prefill chunks and large batches under the native kernel: a bounded block of columns
        at a time dequantized in one C++ pass, already in column order, then BLAS."""
        flat = flat.contiguous()
        out = torch.empty(flat.shape[0], self.out_features, dtype=torch.float32)
        step = max(PACK, CHUNK_BYTES // (4 * self.in_features) // PACK * PACK)
        _, weights = workspace(self.in_features * min(step, self.out_features), torch.float32)
        for start in range(0, self.out_features, step):
            stop = min(self.out_features, start + step)
            w = native.dequantize(self.qweight, self.qzeros, self.scales, self.packed_order, self.group_size,
                                  start // PACK, stop // PACK, weights)
            torch.matmul(flat, w, out=out[:, start:stop])
        return out

    def _dequant_matmul(self, x: torch.Tensor) -> torch.Tensor:
        zs, scales = self._zeros_and_scales()
        groups = self.in_features // self.group_size
        flat = x.reshape(-1, self.in_features).to(self.dtype)
        out = torch.empty(flat.shape[0], self.out_features, dtype=self.dtype, device=flat.device)
        step = max(PACK, CHUNK_BYTES // (4 * self.in_features) // PACK * PACK)
        nibbles, weights = workspace(self.in_features * min(step, self.out_features), self.dtype, flat.device)
        for start in range(0, self.out_features, step):
            stop = min(self.out_features, start + step)
            width = stop - start
            packed = self.qweight[:, start // PACK : stop // PACK]
            q = nibbles[: self.in_features * width].view(self.in_features, width // PACK, PACK)
            torch.bitwise_right_shift(packed.unsqueeze(-1), shifts(flat.device), out=q)
            q.bitwise_and_(0xF)
            w = weights[: self.in_features * width].view(groups, self.group_size, width)
            w.copy_(q.view(groups, self.group_size, width))
            w.mul_(scales[:, start:stop].unsqueeze(1)).sub_(zs[:, start:stop].unsqueeze(1))
            torch.matmul(flat, w.view(self.in_features, width), out=out[:, start:stop])
        return out[:, self.order].reshape(*x.shape[:-1], self.out_features)


@functools.cache
def shifts(device: torch.device) -> torch.Tensor:
    """Each nibble's bit offset in an int32 word, on ``device``."""
    return torch.arange(0, 32, BITS, dtype=torch.int32, device=device)


def derive_buffers(groups: int, out_features: int, dtype: torch.dtype, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
    """Buffers for ``AWQLinear.derive``: zero x scale, scale, and two scratch tensors."""
    return (torch.empty(groups, out_features, dtype=dtype, device=device), torch.empty(groups, out_features, dtype=dtype, device=device),
            torch.empty(groups, out_features, dtype=torch.int32, device=device),
            torch.empty(groups, out_features, dtype=torch.float16, device=device))
_workspaces = threading.local()


def workspace(elements: int, dtype: torch.dtype, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-thread buffers the dequantized chunks are built in, grown as needed and reused:
    allocating them per chunk fragmented the heap by hundreds of MB (measured RssAnon)."""
    device = torch.device(device or "cpu")
    held = getattr(_workspaces, "buffers", None)
    if held is None or held[0].numel() < elements or held[1].dtype != dtype or held[1].device != device:
        size = max(elements, held[0].numel() if held is not None and held[1].device == device else 0)
        held = (torch.empty(size, dtype=torch.int32, device=device), torch.empty(size, dtype=dtype, device=device))
        _workspaces.buffers = held
    return held


# ------------------------------------------------------------------ torch's CPU int4 kernel
def int4_layout(layer: AWQLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's weights repacked for ``_weight_int4pack_mm_for_cpu``: its int4 layout of
    ``W`` [out, in], and per group (scale, offset) with ``w = (q - 8) * scale + offset``."""
    q = unpack(layer.qweight).T.contiguous()  # [out, in], values 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    zeros, scales = unpack(layer.qzeros).float(), layer.scales.float()
    return packed, torch.stack([scales, (8 - zeros) * scales], dim=-1).contiguous()


def int4mm(layer: AWQLinear, x: torch.Tensor) -> torch.Tensor:
    cached = getattr(layer, "_int4", None)
    if cached is None or cached[0] is not layer.qweight:
        cached = (layer.qweight, *int4_layout(layer))
        if not layer.streamed:
            layer._int4 = cached  # type: ignore[attr-defined]
    flat = x.reshape(-1, layer.in_features).float()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, cached[1], layer.group_size, cached[2])
    return y.to(layer.dtype).reshape(*x.shape[:-1], layer.out_features)


@dataclass
class KernelChoice:
    name: str
    why: str


def _timed(layer: AWQLinear, x: torch.Tensor) -> float:
    cuda = x.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    layer(x)
    if cuda:
        torch.cuda.synchronize(x.device)
    return time.perf_counter() - start


@functools.cache
def probe_kernel(in_features: int, out_features: int, group_size: int, dtype: torch.dtype, rows: int = 8,
                 device: torch.device = torch.device("cpu")) -> KernelChoice:
    """Check each kernel against the reference dequantization on this shape, and time the
    ones that are right; the fastest wins. On CPU the candidates are ``dequant``, ``int4mm``
    and ``native``; on CUDA ``dequant`` and ``triton`` (each checked also at 64 rows there,
    the Triton kernel's other row tile, which compiles it too).

    Once per process and shape: the choice is a timing, and a second probe on a loaded
    machine could pick the other kernel, whose sums round differently (two loads of one
    checkpoint, streamed and resident, then disagreed in the last bits of their logits)."""
    from kvstream.hf.awq.format import quantize_rtn

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    layer = AWQLinear(quantize_rtn(weight, group_size), dtype)
    cuda = device.type == "cuda"
    shapes = (rows, 64) if cuda else (rows,)
    inputs = [torch.randn(n, in_features, generator=generator).to(dtype) for n in shapes]
    weights = dequantize(layer.packed())
    references = [x.float() @ weights for x in inputs]
    if cuda:
        layer.move(device)
        inputs = [x.to(device) for x in inputs]
    x = inputs[0]
    correct: list[str] = []
    for name in ("dequant", "triton") if cuda else ("dequant", "int4mm", "native"):
        layer.kernel = name
        why = triton_matmul.why_unavailable(device) if name == "triton" else None
        try:
            if why is not None:
                raise RuntimeError(why)
            ys = [layer(x).float().cpu() for x in inputs]
        except (RuntimeError, AttributeError, NotImplementedError, ImportError) as exc:  # not on this build
            logger.debug("awq kernel %s unavailable: %s", name, exc)
            continue
        if not all(torch.allclose(y, reference, rtol=1e-2, atol=1e-2 * reference.abs().max().item())
                   for y, reference in zip(ys, references, strict=True)):
            logger.warning("awq kernel %s gives wrong results on this machine; not used", name)
            continue
        correct.append(name)
    # A decode step's one row and a batch's ``rows``: timed at ``rows`` alone, the kernels are
    # close enough for noise to pick the one that is 4-7x slower on the single row decoding
    # runs. Each kernel's best of seven rounds, the kernels taking turns within a round: timed
    # five times in a row each, a burst of load on a shared machine once fell on all five of
    # the native kernel's and the 96-layer benchmark ran the dequant kernel at 1/14 the speed.
    timings = dict.fromkeys(correct, float("inf"))
    for _ in range(7):
        for name in correct:
            layer.kernel = name
            timings[name] = min(timings[name], sum(_timed(layer, shape) for shape in (x[:1], x)))
    best = min(timings, key=timings.__getitem__)
    others = ", ".join(f"{n} {timings[n] / timings[best]:.1f}x slower" for n in timings if n != best)
    return KernelChoice(best, others or "the only kernel that ran")
