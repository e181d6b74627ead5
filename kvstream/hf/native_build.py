"""Building the engine's C++ kernels on first use, with torch's extension builder.

Four kernels are compiled this way: the AWQ int4 matmul (``awq/awq_gemv.cpp``), the paged
decode attention (``paged_decode.cpp``), the float32 linear layers for decode-sized batches
(``native_linear.cpp``) and the norms and rotary embedding (``native_ops.cpp``). Each is built
once per machine and cached in ``build_folder``: named per instruction set (AVX2 + FMA where
torch reports AVX2 or AVX-512, plain C++ otherwise) so that a cache shared by two kinds of
CPU never hands one the other's build, and per source text and flags, the source copied in
and compiled there: the build's ninja file names the source's path, so two checkouts or
installs of the same source compiled from where each lies rebuilt each other's cache at every
switch (a silent minute at ``serve``), and a changed source was rebuilt without the
"building" line. The folder is per torch installation and Python headers too: the ninja file
names their include folders, so two virtual environments sharing the cache (a developer's and
a CI clone's, the same torch version in both) rebuilt each other's kernels, silently, at
every first start. Built with OpenMP (``at::parallel_for`` is inline OpenMP: without
``-fopenmp`` it runs on one thread, as the first two did before the flag was added; not on
macOS, whose Apple clang has no OpenMP). Compiling needs a C++ compiler and ninja (the ``hf``
extra installs ninja, which builds first: ``put_ninja_on_path``); where either is missing
``load_extension`` returns why, and the caller keeps its pure-torch path.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

try:
    import fcntl
except ImportError:  # Windows: builds are not guarded (torch's own lock file only)
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)


def build_directory(name: str) -> Path:
    """Where a build name's kernels are cached: ``$TORCH_EXTENSIONS_DIR`` or
    ``~/.cache/torch_extensions``, per Python and torch version (the build links against
    both), one folder per build name."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    abi = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}".replace("+", "_")
    return Path(root) / abi / name


def compiler_flags(vector: bool, extra_flags: tuple[str, ...] = ()) -> list[str]:
    """The flags a kernel is compiled with (``vector``: AVX2 + FMA + F16C)."""
    # -fopenmp: at::parallel_for is inline OpenMP; compiled without it, a kernel runs on one
    # thread. The extension then shares the libgomp torch already loaded (same soname).
    return ["-O3", *openmp_flags(), *(["-mavx2", "-mfma", "-mf16c"] if vector else []), *extra_flags]


def openmp_flags() -> list[str]:
    return [] if sys.platform == "darwin" else ["-fopenmp"]


def uses_vector(vector: bool | None) -> bool:
    """Whether a build is vectorized: where torch reports AVX2 or AVX-512, unless ``vector`` is False."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and vector is not False


def header_folders() -> tuple[str, ...]:
    """The folders whose headers a build includes (this torch installation's and Python's),
    which torch's builder writes into its ninja file: another of them is another build."""
    return (str(Path(torch.__file__).resolve().parent), sysconfig.get_paths()["include"])


def build_folder(stem: str, source: Path, vector: bool | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """The folder ``load_extension`` builds ``source`` in: the build name's, then one per
    source text, compiler flags and header folders (the first 12 hex digits of their SHA-256)."""
    vectorized = uses_vector(vector)
    digest = hashlib.sha256(source.read_bytes())
    digest.update("\0".join(compiler_flags(vectorized, extra_flags)).encode())
    digest.update("\0".join(header_folders()).encode())
    return build_directory(build_name(stem, vectorized)) / digest.hexdigest()[:12]


def copy_in(source: Path, folder: Path) -> Path:
    """``source`` copied into ``folder`` (whose name is its hash: once there, it is the same
    text), written aside and renamed so that a killed copy leaves no partial file."""
    target = folder / source.name
    if not target.exists():
        partial = folder / f".{source.name}.{os.getpid()}"
        shutil.copyfile(source, partial)
        os.replace(partial, target)
    return target


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
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process builds here: say why the start waits
            logger.info("waiting for another process building in %s", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            leftover = directory / "lock"
            if leftover.exists():
                logger.warning("removing %s, left by a build that did not finish", leftover)
                leftover.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def put_ninja_on_path() -> bool:
    """Whether ``ninja`` (which torch's builder runs by name) is on PATH, the pip package's
    first where it is installed (the ``hf`` extra's). Its own, not whichever PATH finds first:
    two ninja versions (the package's 1.13, a system's 1.11) record a build's command
    differently, so each rebuilt what the other had built, a minute at every start that found
    the other one (a shell with the venv activated finds the package's; ``.venv/bin/kvstream``
    or ``.venv/bin/python -m pytest`` run unactivated, the system's). And a venv's ``kvstream``
    started by its full path has the package installed but not on PATH."""
    try:
        import ninja
    except ImportError:
        return shutil.which("ninja") is not None
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != ninja.BIN_DIR:
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
    return shutil.which("ninja") is not None


def build_name(stem: str, vector: bool | None = None) -> str:
    """The build's name: ``stem`` and this CPU's instruction set (``kvstream_awq_gemv_avx2``),
    or ``default`` for a build without vector instructions (``vector=False``)."""
    capability = "default" if vector is False else torch.backends.cpu.get_cpu_capability().lower()
    return f"{stem}_{capability}"


def load_extension(
    stem: str, source: Path, vector: bool | None = None, extra_flags: tuple[str, ...] = ()
) -> tuple[ModuleType | None, str]:
    """The compiled ``source`` and how it was built ("AVX2 + FMA" or "scalar C++"), or None
    and why not (one line). Logs once at info when it compiles (tens of seconds) and at
    warning when it cannot. ``vector``: None builds for this CPU; False builds the plain C++
    branches that a CPU without AVX2 runs (the tests run them here that way).
    ``extra_flags``: more compiler flags for this source (``-ffp-contract=off``)."""
    vector = uses_vector(vector)
    name = build_name(stem, vector)
    try:
        from torch.utils.cpp_extension import load as build

        put_ninja_on_path()
        directory = build_folder(stem, source, vector, extra_flags)
        directory.mkdir(parents=True, exist_ok=True)
        if not any(directory.glob("*.so")):
            logger.info("building %s in %s (once per machine and version, ~40 s here)", source.name, directory)
        with exclusive(directory):
            module = build(
                name, [str(copy_in(source, directory))], extra_cflags=compiler_flags(vector, extra_flags),
                extra_ldflags=openmp_flags(), build_directory=str(directory), verbose=False)
    except Exception as exc:  # noqa: BLE001 - a missing compiler or ninja surfaces as many types
        why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        logger.warning("%s not built (%s); using the pure-torch path", source.name, why)
        return None, why
    return module, "AVX2 + FMA" if vector else "scalar C++"
