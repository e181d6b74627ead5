"""The native AWQ kernel (``awq_gemv.cpp``): int4 x float for a few rows, read straight from
the packed weights, compiled here on first use with torch's extension builder.

It exists because decoding reads each weight once per step: the pure-torch ``dequant``
kernel writes and rereads a float copy of every weight (several passes over 8 bytes per
weight for the 0.5 it reads), so a decode step spent ~7x longer in an AWQ projection than
in the fp32 one. This kernel reads the packed words once (AVX2 + FMA where the CPU has them,
plain C++ otherwise). Above ``MAX_ROWS`` rows (prefill chunks, large batches) it loses to
dequantize + BLAS, which ``AWQLinear`` then uses.

Compiling needs a C++ compiler and ninja (the ``hf`` extra installs ninja); where either is
missing ``load`` says why and the probe keeps the pure-torch kernels.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

try:
    import fcntl
except ImportError:  # Windows: builds are not guarded (torch's own lock file only)
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("awq_gemv.cpp")
# Most rows it takes. On SmolLM2's projections here (576x1536, 1536x576, 576x576), against
# dequantize + BLAS: 1 row 0.07-0.33 vs 0.49-1.34 ms, 8 rows 0.37-1.23 vs 0.69-1.49, 16 rows
# about even, 32 rows 1.5-4x slower (its accumulators stop fitting in L1).
MAX_ROWS = 8


def build_directory(name: str) -> Path:
    """Where the kernel is built and cached: ``$TORCH_EXTENSIONS_DIR`` or
    ``~/.cache/torch_extensions``, per Python and torch version (the build links against
    both), one folder per build name."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    abi = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}".replace("+", "_")
    return Path(root) / abi / name


@contextlib.contextmanager
def exclusive(directory: Path) -> Iterator[None]:
    """Hold ``directory`` against other KVStream processes building there, and clear what a
    killed build left. torch's builder marks a build with a ``lock`` file that the builder
    removes when done and waits, without a timeout, while one exists: a build killed midway
    (Ctrl-C during the first ``serve``) would hang every later start. An ``flock`` dies with
    its process, so once it is held no live build of ours is running and a ``lock`` file
    there is a leftover."""
    if fcntl is None:
        yield
        return
    with open(directory / "kvstream.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits while another process builds
        try:
            leftover = directory / "lock"
            if leftover.exists():
                logger.warning("removing %s, left by a build that did not finish", leftover)
                leftover.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def put_ninja_on_path() -> bool:
    """Whether ``ninja`` (which torch's builder runs by name) is on PATH, after adding the
    pip package's binary folder when it was not: a venv's ``kvstream`` started by its full
    path, without activating the venv, has the package installed but not on PATH."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """The compiled kernel and how it was built, or None and why not. Built once per machine
    (kept in ``build_directory``), named per instruction set so that a cache shared by two
    kinds of CPU never hands one the other's build."""
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", "DEFAULT", ...
    vector = capability in ("AVX2", "AVX512")
    flags = ["-O3", *(["-mavx2", "-mfma"] if vector else [])]
    name = f"kvstream_awq_gemv_{capability.lower()}"
    try:
        from torch.utils.cpp_extension import load as build

        put_ninja_on_path()
        directory = build_directory(name)
        directory.mkdir(parents=True, exist_ok=True)
        if not any(directory.glob("*.so")):
            logger.info("building the native AWQ kernel in %s (once per machine, ~40 s here)", directory)
        with exclusive(directory):
            module = build(name, [str(SOURCE)], extra_cflags=flags, build_directory=str(directory), verbose=False)
    except Exception as exc:  # noqa: BLE001 - a missing compiler or ninja surfaces as many types
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        logger.warning("awq native kernel not built (%s); using the pure-torch kernels", why)
        return None, why
    return module, "AVX2 + FMA" if vector else "scalar C++"


def gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, logical: torch.Tensor,
         group_size: int) -> torch.Tensor:
    """``[rows, in]`` float32 times the weights of a checkpoint's ``qweight`` / ``qzeros`` /
    ``scales`` -> ``[rows, out]`` in column order; ``logical[p]`` is the column of packed
    column ``p`` (``AWQLinear.packed_order``)."""
    module, why = load()
    if module is None:
        raise RuntimeError(f"the native AWQ kernel is not available: {why}")
    return module.awq_gemv(x, qweight, qzeros, scales, logical, group_size)
