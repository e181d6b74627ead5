"""The managed llama-server: started by KVStream, restarted after kill -9, stopped with it;
and `kvstream serve` as a user runs it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
import json
from pathlib import Path

import aiohttp
import openai
import pytest

from kvstream.backends import LlamaCppBackend
from tests.conftest import free_port, llama_server_binary, smollm2_gguf, wait_http

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(300)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_managed_runtime_starts_restarts_after_kill_and_stops(start_proxy, tmp_path):
    llama_server_binary()
    backend = LlamaCppBackend(None, str(smollm2_gguf()), slot_save_path=str(tmp_path))
    proxy = await start_proxy(backend)
    runtime = backend.runtime
    assert runtime is not None and alive(runtime.pid)
    c = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    assert (await c.models.list()).data[0].id == "SmolLM2-135M-Instruct.Q4_1"
    kwargs = dict(model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0)
    first = await c.chat.completions.create(**kwargs)
    old_pid = runtime.pid
    os.kill(old_pid, signal.SIGKILL)
    for _ in range(600):
        await asyncio.sleep(0.1)
        if runtime.restarts == 1 and runtime.ready.is_set() and runtime.pid != old_pid:
            break
    assert runtime.restarts == 1 and runtime.pid != old_pid
    again = await c.chat.completions.create(**kwargs)
    assert again.choices[0].message.content == first.choices[0].message.content
    pid = runtime.pid
    await backend.close()
    assert not alive(pid)
    # It failed once, so its log stays, with both runs in it.
    assert runtime.log_path.read_bytes().count(b"llama_server: listening on") == 2
    runtime.log_path.unlink()


def test_kvstream_serve_with_a_gguf_starts_answers_and_cleans_up(tmp_path):
    """The README's command, run as a user runs it, stopped with SIGTERM."""
    llama_server_binary()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstream.cli.main", "serve", "--backend", "llamacpp", "--model", str(smollm2_gguf()), "--port", str(port)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", proc, what="kvstream serve")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as resp:
            status = json.loads(resp.read())
        child = status["backend"]["managed"]["pid"]
        assert alive(child)
        log = Path(status["backend"]["managed"]["log"])
        assert log.exists()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        out = c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert out.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    assert not alive(child), "llama-server outlived KVStream"
    assert not log.exists(), "a clean stop leaves no log behind"


async def test_a_chat_template_file_reaches_the_llama_server_kvstream_starts(start_proxy, tmp_path):
    """``chat_template`` with a managed llama-server: started with --jinja --chat-template-file,
    so the prompt is that template's (its count in the usage too); with a server of one's own,
    refused at once, saying what to do instead."""
    llama_server_binary()
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\nTemplated here: {{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    backend = LlamaCppBackend(None, str(smollm2_gguf()), slot_save_path=str(tmp_path), chat_template=str(template))
    command = backend.runtime.command()
    assert command[command.index("--chat-template-file") + 1] == str(template.resolve()) and "--jinja" in command
    proxy = await start_proxy(backend)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(proxy.url + "/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]}) as resp:
                rendered = (await resp.json())["prompt"]
            # llama-server counts a chat's prompt itself: its own answer, passed through.
            async with http.post(proxy.url + "/v1/chat/completions/input_tokens",
                                 json={"messages": [{"role": "user", "content": "Hi"}]}) as resp:
                counted = await resp.json()
            assert resp.status == 200 and counted["object"] == "response.input_tokens" and counted["input_tokens"] > 5
            assert "X-KVStream-Tokens" not in resp.headers
        assert rendered == "<|im_start|>user\nTemplated here: Hi<|im_end|>\n<|im_start|>assistant\n"
    finally:
        await backend.close()
    with pytest.raises(ValueError, match="start yours with --jinja --chat-template-file"):
        LlamaCppBackend("http://127.0.0.1:9", None, chat_template=str(template))
    with pytest.raises(ValueError, match="no such file"):
        LlamaCppBackend(None, str(smollm2_gguf()), chat_template=str(tmp_path / "missing.jinja"))


async def test_the_responses_api_reaches_llama_servers_own(start_proxy, tmp_path):
    """In front of a llama-server (which serves /v1/responses itself) the official client's
    responses.create passes through to it, admitted like any generation."""
    llama_server_binary()
    backend = LlamaCppBackend(None, str(smollm2_gguf()), slot_save_path=str(tmp_path))
    proxy = await start_proxy(backend)
    try:
        async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
            reply = await client.responses.create(model="SmolLM2-135M-Instruct.Q4_1", input="Say hi", max_output_tokens=8,
                                                  temperature=0)
        assert reply.output_text and reply.usage.output_tokens <= 8
        assert proxy.engine.stats.requests_finished == 1
    finally:
        await backend.close()


async def test_anthropics_messages_reach_llama_servers_own(start_proxy, tmp_path):
    """llama-server serves /v1/messages itself: the anthropic client's request passes through."""
    anthropic = pytest.importorskip("anthropic")
    llama_server_binary()
    backend = LlamaCppBackend(None, str(smollm2_gguf()), slot_save_path=str(tmp_path))
    proxy = await start_proxy(backend)
    try:
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0) as client:
            message = await client.messages.create(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=8,
                                                   messages=[{"role": "user", "content": "Say hi"}])
        assert message.content[0].text and message.usage.output_tokens <= 8
        assert proxy.engine.stats.requests_finished == 1
    finally:
        await backend.close()
