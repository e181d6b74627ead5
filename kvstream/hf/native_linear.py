"""The model's linear layers on CPU for decode-sized batches (``native_linear.cpp``).

Why it exists: a decode step multiplies one row per running sequence by every weight matrix,
and BLAS's sgemm is tuned for large blocks. Measured on SmolLM2-135M's projections with the
weights coming from memory (as in a forward), 2 threads: 1.3-2.0x faster than ``F.linear`` at
1 row, 1.4-3.2x at 8-16 rows, 0.95-1.7x at 64 rows across runs (``benchmarks/native_linear.py``).
Past ``MAX_ROWS`` rows (prefill chunks) ``F.linear`` runs, as before. Its threads are
OpenMP's, as torch's are: see ``ModelRunner.start`` for why one thread should load and step
the model.

``install`` switches a model's ``nn.Linear`` modules (float32, on CPU) to ``NativeLinear``
in place: the same module objects and parameters (no copy), only the class changes, so tied
weights stay tied and the model stays an ordinary transformers model. The engine does it to
the model it is given, as it does with the attention function (compat.py). Each output is
summed in a fixed order whatever the batch (``native_linear.cpp``), so a sequence's tokens do
not depend on what it is batched with, and float32 agreement with ``F.linear`` is checked on
the model's own weights before anything is switched. Built by ``native_build``; without a
compiler the model keeps ``F.linear``, and ``/status`` says why (``matmul_backend_why``).

``HalfLinear`` is the same kernel over a weight held in float16 / bfloat16 (a checkpoint's
weights as stored: ``half_weights.py``, the AWQ loader's embeddings), widened in registers;
those modules are made at load, and ``install`` only turns their kernel on or off.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvstream.hf import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_linear.cpp")
# Most rows a call sends to the kernel; bigger batches (prefill chunks) go to F.linear, which
# is as fast from ~64 rows (measured at SmolLM2's shapes, benchmarks/native_linear.py).
MAX_ROWS = 64
BACKENDS = ("auto", "native", "torch")
# Output rows of a half-precision weight widened at once when a ``HalfLinear`` call is
# prefill-sized (or the kernel is off): a bounded float32 copy for BLAS.
UPCAST_ROWS = 4096


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """The compiled kernel and how it was built, or None and why not."""
    return native_build.load_extension("kvstream_native_linear", SOURCE)


class NativeLinear(nn.Linear):
    """An ``nn.Linear`` whose forward runs the native kernel for up to ``MAX_ROWS`` rows.

    Never constructed: ``install`` switches existing modules' class to it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        weight = self.weight
        if (
            rows == 0 or rows > MAX_ROWS  # prefill chunks
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))  # no backward here
            # the model moved or cast after the switch, or a weight replaced by a view
            or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or weight.device.type != "cpu" or not weight.is_contiguous()
        ):
            return F.linear(x, weight, self.bias)
        module, _ = load()
        flat = x.reshape(rows, self.in_features)
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        y = module.native_linear(flat, weight)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def direct_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``forward`` for ``[rows, in]`` float32 CPU inputs with its per-call checks made now
        (fast_decoder.py's direct decoder path: the checks cost as much as a decode-sized call)."""
        module, _ = load()
        weight, bias = self.weight, self.bias
        if module is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
            return self.forward

        def call(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > MAX_ROWS:  # prefill chunks
                return F.linear(x, weight, bias)
            y = module.native_linear(x if x.stride(-1) == 1 else x.contiguous(), weight)
            if bias is not None:
                y += bias
            return y

        return call


class HalfLinear(nn.Module):
    """``y = x @ W.T (+ b)`` for float32 ``x`` with ``W`` held in float16 / bfloat16 (a
    checkpoint's weights as stored, ``half_weights``): the kernel widens each weight in
    registers, exactly, so a decode-sized call gives the upcast matrix's float32 kernel
    result bit for bit. ``W`` is a buffer, not a parameter (the model's dtype, read from its
    first parameter, stays float32)."""

    # False under the ``torch`` matmul backend (``install``): every call widens blocks for
    # BLAS, as prefill-sized calls always do.
    use_kernel = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        flat = x.reshape(rows, self.in_features)
        module, _ = load()
        if 0 < rows <= MAX_ROWS and module is not None and self.use_kernel:
            y = module.native_linear(flat if flat.stride(-1) == 1 else flat.contiguous(), self.weight)
        else:
            y = torch.empty(rows, self.out_features, dtype=self.dtype)
            for start in range(0, self.out_features, UPCAST_ROWS):
                y[:, start : start + UPCAST_ROWS] = F.linear(flat, self.weight[start : start + UPCAST_ROWS].to(self.dtype))
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def direct_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``forward`` for ``[rows, in]`` float32 inputs with its per-call choices made now
        (fast_decoder.py's direct decoder path)."""
        module, _ = load()
        if module is None or not self.use_kernel:
            return self.forward
        weight, bias, forward = self.weight, self.bias, self.forward

        def call(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > MAX_ROWS:
                return forward(x)
            y = module.native_linear(x if x.stride(-1) == 1 else x.contiguous(), weight)
            if bias is not None:
                y += bias
            return y

        return call

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stored {self.weight.dtype}"


@dataclass
class MatmulChoice:
    """What runs the model's linear layers, and why a faster choice did not."""

    name: str  # "native" | "torch"
    why_not: dict[str, str] = field(default_factory=dict)
    modules: int = 0  # linear modules switched to the kernel


class MatmulBackendError(ValueError):
    """``native`` was asked for and cannot run here (one line, naming why)."""


def _eligible(model: nn.Module) -> list[nn.Linear]:
    """The model's plain float32 CPU linear layers with dense weights, switched or not
    (quantized layers are other classes and keep their own kernels)."""
    return [
        m for m in model.modules()
        if type(m) in (nn.Linear, NativeLinear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu" and m.weight.is_contiguous()
    ]


def disagreement(module: ModuleType, weight: torch.Tensor, rows: int = 256) -> float:
    """Largest difference between the kernel and F.linear (on the weight upcast to float32)
    over the first ``rows`` rows of a layer's own ``weight``, relative to the largest output,
    for batches of 1, 5 and MAX_ROWS rows."""
    sample = weight[:rows].contiguous()
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    with torch.inference_mode():
        for count in (1, 5, MAX_ROWS):
            x = torch.randn(count, weight.shape[1], generator=generator)
            want = F.linear(x, sample.float())
            got = module.native_linear(x, sample)
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    return worst


def install(model: nn.Module, backend: str = "auto") -> MatmulChoice:
    """Switch ``model``'s eligible linear layers to ``NativeLinear`` (and its ``HalfLinear``
    layers' kernel on) per ``backend``: ``auto`` where the kernel builds and agrees with
    F.linear, ``native`` the same or ``MatmulBackendError``, ``torch`` never. Returns what runs."""
    if backend not in BACKENDS:
        raise MatmulBackendError(f"unknown matmul backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    layers = _eligible(model)
    halves = [m for m in model.modules() if isinstance(m, HalfLinear)]
    if backend == "torch":
        _switch(layers, nn.Linear)
        _use_kernel(halves, False)
        return MatmulChoice("torch", {"native": "not requested (matmul backend torch)"})
    why = None
    if not layers and not halves:
        why = "no float32 nn.Linear on the CPU in this model"
    else:
        module, how = load()
        if module is None:
            why = f"not built: {how}"
        else:
            error = disagreement(module, (layers or halves)[0].weight)
            if error > 1e-5:
                why = f"disagrees with F.linear by {error:.2e} (relative) on the model's weights"
    if why is not None:
        if backend == "native":
            raise MatmulBackendError(f"matmul backend native cannot run: {why}")
        logger.info("linear layers run F.linear: the native kernel %s", why)
        _switch(layers, nn.Linear)
        _use_kernel(halves, False)
        return MatmulChoice("torch", {"native": why})
    _switch(layers, NativeLinear)
    _use_kernel(halves, True)
    return MatmulChoice("native", {}, len(layers) + len(halves))


def _use_kernel(layers: list[HalfLinear], on: bool) -> None:
    for layer in layers:
        layer.use_kernel = on


def _switch(layers: list[nn.Linear], cls: type[nn.Linear]) -> None:
    """Give ``layers`` class ``cls`` (a model handed to a second engine may hold either)."""
    for layer in layers:
        layer.__class__ = cls
