"""Helpers shared by the benchmark scripts: free ports, child processes, percentiles, CPU time."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstream.backends.llamacpp.runtime import free_port  # noqa: E402,F401
from kvstream.backends.llamacpp.runtime import stop_process as stop  # noqa: E402,F401
from kvstream.bench.metrics import percentile  # noqa: E402,F401

ROOT = Path(__file__).resolve().parent.parent




def scratch_dir(prefix: str) -> Path:
    """A temporary folder for a run's checkpoints and models, removed when the script exits
    (they take gigabytes: a synthetic 96-layer model and its AWQ checkpoint are 1.8 GB)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status < 500:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer in {timeout}s")


def spawn(args: list[str], env: dict[str, str] | None = None, log: str | None = None) -> subprocess.Popen:
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(args, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)




def serve_hf(name: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """`kvstream serve --backend hf` on a free port (log: /tmp/kvstream-NAME-PORT.log), once
    it is ready: (the process, its URL). Stop it with ``stop``."""
    port = free_port()
    proc = spawn([PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", "hf", "--port", str(port),
                  "--log-level", "warning", *extra], log=f"/tmp/kvstream-{name}-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", timeout=300, proc=proc)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



PYTHON = sys.executable


async def stream_chat(session, url: str, body: dict) -> tuple[float, float] | None:
    """POST a streaming chat to ``url`` and read it whole: (seconds to the first content
    token, seconds to the end), or None for a non-200 answer, an error event or a
    connection failure. The one timer every benchmark's TTFT uses."""
    import aiohttp

    start = time.perf_counter()
    first = None
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                await resp.read()
                return None
            async for line in resp.content:
                if b'"error"' in line:
                    return None
                if first is None and line.startswith(b"data: {") and b'"content"' in line and b'"role"' not in line:
                    first = time.perf_counter()
    except aiohttp.ClientError:
        return None
    end = time.perf_counter()
    return (first or end) - start, end - start


def best_per_item_s(call, items: list, rounds: int = 3) -> float:
    """Seconds per item of ``call(item)`` over ``items`` in turn (as a forward walks its layers,
    so that their weights come from memory, not the caches): the best of ``rounds`` passes,
    after one warm-up pass."""
    for item in items:
        call(item)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for item in items:
            call(item)
        best = min(best, (time.perf_counter() - start) / len(items))
    return best


def built_kernel(load, label: str, threads: int | None):
    """A kernel benchmark's set-up: torch on ``threads`` threads (None: its default), and the
    compiled module ``load()`` returns with how it was built; exits saying why when it did not build."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    module, how = load()
    if module is None:
        sys.exit(f"the {label} is not built here: {how}")
    return module, how

