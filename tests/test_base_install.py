"""What a proxy-only user installs, tested as they install it: ``pip install .`` into a fresh
virtual environment (the Dockerfile's install path), no torch, no transformers. The installed
``kvstream serve --backend openai`` answers the official ``openai`` client in front of an
OpenAI-compatible upstream, and ``--backend hf`` says in one line which extra is missing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from tests.conftest import REQUIRE_REAL, free_port, stop_process, wait_http
from tests.doubles import Script

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory) -> Path:
    """A fresh venv with ``pip install .`` of this checkout, nothing else."""
    venv = tmp_path_factory.mktemp("base-install") / "venv"
    # Built from the interpreter under this one's venv: none of the test environment's
    # packages (torch among them) are visible inside.
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(ROOT)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PIP_NO_INPUT": "1"},
    )
    if install.returncode != 0:
        message = f"pip install . failed: {install.stderr[-2000:]}"
        if REQUIRE_REAL:
            pytest.fail(message)
        pytest.skip(message)
    return venv


def test_the_base_install_has_no_torch(base_venv):
    python = str(base_venv / "bin" / "python")
    for module in ("torch", "transformers"):
        assert subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=60).returncode != 0, module
    # The package and its CLI import and run.
    result = subprocess.run([str(base_venv / "bin" / "kvstream"), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "serve" in result.stdout, result.stderr


async def test_the_base_install_serves_a_chat_with_the_openai_client(base_venv, start_upstream, tmp_path):
    url, recorder = await start_upstream(Script(tokens=["Hello", " from", " upstream"]))
    port = free_port()
    proxy = subprocess.Popen(
        [str(base_venv / "bin" / "kvstream"), "serve", "--backend", "openai", "--backend-url", url, "--port", str(port)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        # The upstream double runs on this event loop: wait for readiness off it.
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/ready", proxy, 60, "kvstream serve (base install)")
        async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0) as client:
            reply = await client.chat.completions.create(
                model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
        assert reply.choices[0].message.content == "Hello from upstream"
        assert [b["messages"] for b in recorder.bodies] == [[{"role": "user", "content": "hi"}]]
    finally:
        await asyncio.to_thread(stop_process, proxy)


def test_the_base_install_names_the_missing_extra_for_hf(base_venv, tmp_path):
    for command in (["serve", "--backend", "hf", "--port", str(free_port())], ["awq", "align", str(tmp_path)],
                    ["awq", "quantize", "--out", str(tmp_path / "out")]):
        result = subprocess.run([str(base_venv / "bin" / "kvstream"), *command], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, command
        lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
        assert len(lines) == 1 and "pip install 'kvstream[hf]'" in lines[0], (command, lines)
