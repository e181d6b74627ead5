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
"""

from __future__ import annotations

import functools
import logging
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


def _disagreement(module: ModuleType, layer: nn.Linear) -> float:
    """Largest difference between the kernel and F.linear on ``layer``'s own weight, relative to
    the largest output, over batches of 1, 5 and MAX_ROWS rows."""
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    with torch.inference_mode():
        for rows in (1, 5, MAX_ROWS):
            x = torch.randn(rows, layer.in_features, generator=generator)
            want = F.linear(x, layer.weight)
            got = module.native_linear(x, layer.weight)
            worst = max(worst, float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)))
    return worst


def install(model: nn.Module, backend: str = "auto") -> MatmulChoice:
    """Switch ``model``'s eligible linear layers to ``NativeLinear`` per ``backend``: ``auto``
    where the kernel builds and agrees with F.linear, ``native`` the same or
    ``MatmulBackendError``, ``torch`` never. Returns what runs."""
    if backend not in BACKENDS:
        raise MatmulBackendError(f"unknown matmul backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    layers = _eligible(model)
    if backend == "torch":
        _switch(layers, nn.Linear)
        return MatmulChoice("torch", {"native": "not requested (matmul backend torch)"})
    why = None
    if not layers:
        why = "no float32 nn.Linear on the CPU in this model"
    else:
        module, how = load()
        if module is None:
            why = f"not built: {how}"
        else:
            error = _disagreement(module, layers[0])
            if error > 1e-5:
                why = f"disagrees with F.linear by {error:.2e} (relative) on the model's weights"
    if why is not None:
        if backend == "native":
            raise MatmulBackendError(f"matmul backend native cannot run: {why}")
        logger.info("linear layers run F.linear: the native kernel %s", why)
        _switch(layers, nn.Linear)
        return MatmulChoice("torch", {"native": why})
    _switch(layers, NativeLinear)
    return MatmulChoice("native", {}, len(layers))


def _switch(layers: list[nn.Linear], cls: type[nn.Linear]) -> None:
    """Give ``layers`` class ``cls`` (a model handed to a second engine may hold either)."""
    for layer in layers:
        layer.__class__ = cls
