"""The Ollama, LM Studio and Foundry Local adapters against protocol-faithful doubles, driven
through the proxy by the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import openai
import pytest

from kvstream.backends import FoundryBackend, LMStudioBackend, OllamaBackend
from kvstream.backends.foundry import parse_status_output, resolve_alias
from tests.conftest import wait_released
from tests.doubles import PROTOCOLS, Script, foundry_double, lmstudio_double, ollama_double

pytestmark = pytest.mark.timeout(60)


def client(proxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)


# ---------------------------------------------------------------------------- Ollama
@pytest.fixture
async def ollama(start_upstream, start_proxy):
    script = Script(tokens=["The", " sky", " is", " blue"], prompt_tokens=26)
    url, recorder = await start_upstream(script, factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    return proxy, script, recorder


async def test_ollama_chat_maps_options_usage_and_done_reason(ollama):
    proxy, script, recorder = ollama
    out = await client(proxy).chat.completions.create(
        model="llama3.2:latest",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Why is the sky blue?"}]}],
        max_tokens=20, temperature=0.1, top_p=0.9, seed=42, stop=["\n\n"],
    )
    assert out.choices[0].message.content == "The sky is blue"
    assert out.usage.prompt_tokens == 26 and out.usage.completion_tokens == 4
    sent = recorder.bodies[0]
    assert sent["messages"] == [{"role": "user", "content": "Why is the sky blue?"}]
    assert sent["options"] == {"num_predict": 20, "temperature": 0.1, "top_p": 0.9, "seed": 42, "stop": ["\n\n"]}
    assert sent["stream"] is True
    script.finish_reason = "length"
    out = await client(proxy).completions.create(model="llama3.2:latest", prompt="Why", max_tokens=4)
    assert out.choices[0].finish_reason == "length" and out.choices[0].text == "The sky is blue"
    assert recorder.bodies[1]["prompt"] == "Why"


async def test_ollama_think_from_the_openai_fields_that_say_it(ollama):
    """Ollama's ``think`` from what an OpenAI client sends: ``chat_template_kwargs``'
    ``enable_thinking`` (vLLM's and llama-server's), ``reasoning_effort`` (as Ollama's own
    OpenAI layer maps it); neither: the model's default (no ``think``)."""
    proxy, _, recorder = ollama
    messages = [{"role": "user", "content": "hi"}]
    for extra, think in (({"chat_template_kwargs": {"enable_thinking": False}}, False), ({"reasoning_effort": "high"}, "high"),
                         ({}, None)):
        await client(proxy).chat.completions.create(model="llama3.2:latest", messages=messages, max_tokens=4, extra_body=extra)
        assert recorder.bodies[-1].get("think") == think, extra


async def test_ollama_logprobs_reach_the_openai_client_in_openais_shapes(ollama):
    """OpenAI's logprobs/top_logprobs become Ollama's; its per-chunk entries come back as
    chat's content list (streamed and joined) and as the legacy completions lists."""
    proxy, _, recorder = ollama
    oa = client(proxy)
    out = await oa.chat.completions.create(
        model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2)
    assert recorder.bodies[-1]["logprobs"] is True and recorder.bodies[-1]["top_logprobs"] == 2
    content = out.choices[0].logprobs.content
    assert [(e.token, e.logprob) for e in content] == [("The", -0.25), (" sky", -0.5), (" is", -0.75), (" blue", -1.0)]
    assert content[1].bytes == list(b" sky") and [t.token for t in content[1].top_logprobs] == [" sky~0", " sky~1"]
    stream = await oa.chat.completions.create(
        model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}], logprobs=True, stream=True)
    streamed = [e.token async for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == ["The", " sky", " is", " blue"]
    text = await oa.completions.create(model="llama3.2:latest", prompt="Why", max_tokens=4, logprobs=1)
    assert text.choices[0].logprobs.tokens == ["The", " sky", " is", " blue"]
    assert text.choices[0].logprobs.text_offset == [0, 3, 7, 10]
    assert text.choices[0].logprobs.top_logprobs[0] == {"The~0": -1.0}
    plain = await oa.chat.completions.create(model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}])
    assert plain.choices[0].logprobs is None and "logprobs" not in recorder.bodies[-1]


async def test_ollama_streams_and_lists_models(ollama):
    proxy, *_ = ollama
    models = await client(proxy).models.list()
    assert [m.id for m in models.data] == ["deepseek-r1:latest", "llama3.2:latest"]
    stream = await client(proxy).chat.completions.create(model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}], stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "The sky is blue"
    # Soft backend: the pool is sized from /api/ps context_length x parallel (1).
    assert proxy.engine.scheduler.bm.pool.num_blocks * proxy.engine.scheduler.bm.block_size == 4096
    assert proxy.engine.scheduler.bm.is_idle()


async def test_ollama_errors(ollama):
    proxy, script, _ = ollama
    c = client(proxy)
    with pytest.raises(openai.NotFoundError):  # unknown to /api/tags: KVStream's own 404
        await c.chat.completions.create(model="mistral", messages=[{"role": "user", "content": "hi"}])
    script.status = 503  # Ollama's "server busy" queue-full answer
    with pytest.raises(openai.InternalServerError) as err:
        await c.chat.completions.create(model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 503 and "maximum pending requests exceeded" in err.value.message
    script.status = None
    script.error_after = 2  # {"error": ...} line mid-stream
    with pytest.raises(openai.APIError, match="error was encountered while running the model"):
        stream = await c.chat.completions.create(model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for _ in stream:
            pass
    script.error_after, script.die_after = None, 2  # EOF without done:true
    with pytest.raises(openai.APIStatusError) as err:
        await c.chat.completions.create(model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 502 and "done:true" in err.value.message
    assert proxy.engine.scheduler.bm.is_idle()


async def test_ollama_refuses_token_prompts_and_echo_by_name(ollama):
    """Ollama takes text prompts and never returns them: a token-id prompt or echo is a 400
    naming the field, not a prompt Ollama would read as text or an echo silently dropped."""
    proxy, _, recorder = ollama
    c = client(proxy)
    with pytest.raises(openai.BadRequestError) as err:
        await c.completions.create(model="llama3.2:latest", prompt=[1, 2, 3], max_tokens=2)
    assert err.value.body["param"] == "prompt" and "token ids" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        await c.completions.create(model="llama3.2:latest", prompt="hi", max_tokens=2, echo=True)
    assert err.value.body["param"] == "echo"
    assert recorder.bodies == []
    reply = await c.completions.create(model="llama3.2:latest", prompt="hi", max_tokens=2, echo=False)
    assert reply.choices[0].text


async def test_ollama_serves_a_batch_of_prompts_as_requests_of_their_own(ollama):
    """The completions batch form in front of a runtime without one: each prompt is its own
    /api/generate request, the choices numbered in prompt order, the usage summed."""
    proxy, script, recorder = ollama
    c = client(proxy)
    reply = await c.completions.create(model="llama3.2:latest", prompt=["one", "two", "three"], max_tokens=4)
    assert [ch.index for ch in reply.choices] == [0, 1, 2]
    assert all(ch.text == "The sky is blue" and ch.finish_reason == "stop" for ch in reply.choices)
    assert sorted(b["prompt"] for b in recorder.bodies) == ["one", "three", "two"]
    assert reply.usage.prompt_tokens == 3 * script.prompt_tokens
    stream = await c.completions.create(model="llama3.2:latest", prompt=["one", "two"], max_tokens=4, stream=True)
    texts: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: "The sky is blue", 1: "The sky is blue"}
    assert proxy.engine.scheduler.bm.is_idle()

    # One slot: the second prompt waits for the first; past the client's deadline, the batch
    # is a 503 and nothing is left holding a slot or blocks.
    script.delay_s = 0.3
    with pytest.raises(openai.APIStatusError) as err:
        await c.completions.create(model="llama3.2:latest", prompt=["one", "two"], max_tokens=4,
                                   extra_headers={"X-KVStream-Deadline-Ms": "200"})
    assert err.value.status_code == 503 and "queue" in err.value.message
    script.delay_s = 0.0
    assert proxy.engine.scheduler.bm.is_idle() and not proxy.engine.scheduler.running


async def test_a_client_leaving_a_batch_cancels_every_prompt_and_frees_the_slots(start_upstream, start_proxy):
    """Mid-stream hang-up: the prompt streaming is cancelled upstream, the ones still queued
    never reach the runtime, and nothing is left holding a slot or blocks."""
    import aiohttp

    url, recorder = await start_upstream(Script(tokens=["tok"] * 50, delay_s=0.05), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(proxy.v1 + "/completions", json={
            "model": "llama3.2:latest", "prompt": ["one", "two", "three"], "max_tokens": 50, "stream": True})
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()  # the client hangs up mid-stream
    for _ in range(200):
        if recorder.cancelled:
            break
        await asyncio.sleep(0.02)
    await wait_released(proxy)
    assert recorder.cancelled == 1 and recorder.completed == 0 and len(recorder.bodies) == 1  # one slot: one sent
    assert proxy.engine.stats.requests_cancelled == 3 and not proxy.engine.scheduler.waiting


def test_ollama_tool_calls_and_images_translate_both_ways():
    from kvstream.backends.ollama import _openai_tool_calls, to_ollama_messages

    messages = to_ollama_messages([
        {"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "2", "name": "f"},
    ])
    assert messages[0] == {"role": "user", "content": "what is this?", "images": ["QUJD"]}
    assert messages[1]["tool_calls"] == [{"function": {"name": "f", "arguments": {"x": 1}}}]  # an object, as Ollama wants
    assert messages[2]["tool_name"] == "f"
    stream = [json.loads(line) for line in (PROTOCOLS / "ollama/chat_stream_tools.ndjson").read_text().splitlines() if line.strip()]
    calls = _openai_tool_calls(stream[0]["message"]["tool_calls"], 0)
    assert isinstance(calls[0]["function"]["arguments"], str)  # a JSON string, as OpenAI wants
    assert json.loads(calls[0]["function"]["arguments"]) == stream[0]["message"]["tool_calls"][0]["function"]["arguments"]


# ------------------------------------------------------------------------- LM Studio
async def test_lmstudio_chat_and_context_from_api_v0(start_upstream, start_proxy):
    url, recorder = await start_upstream(Script(), factory=lmstudio_double)
    proxy = await start_proxy(LMStudioBackend(url))
    out = await client(proxy).chat.completions.create(model="meta-llama-3.1-8b-instruct", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == "Hello, world!"
    limits = proxy.engine.limits
    assert limits.n_ctx_per_request == 131072 and limits.parallel == 4  # the loaded model's context
    assert proxy.engine.scheduler.config.max_batch_size == 4


async def test_lmstudio_no_model_loaded_passes_its_error_on(start_upstream, start_proxy):
    url, _ = await start_upstream(Script(), factory=lmstudio_double, loaded=False)
    proxy = await start_proxy(LMStudioBackend(url))
    with pytest.raises(openai.NotFoundError) as err:
        await client(proxy).chat.completions.create(model="meta-llama-3.1-8b-instruct", messages=[{"role": "user", "content": "hi"}])
    assert "No models loaded" in err.value.message
    assert err.value.body["code"] == "model_not_found"


# --------------------------------------------------------------------- Foundry Local
def test_foundry_status_output_parsing():
    text = (PROTOCOLS / "foundry/cli_service_status_outputs.txt").read_text()
    blocks = text.split("\n\n")
    assert parse_status_output(blocks[0]) == "http://127.0.0.1:55064"  # the /openai/status path is dropped
    assert parse_status_output(blocks[1]) is None  # not running
    assert parse_status_output(blocks[-1]) == "http://127.0.0.1:52364"  # CLI 0.10.2 `server status`


def test_foundry_alias_resolution_prefers_gpu_over_cpu_among_downloaded_variants_and_exact_ids():
    catalog = [
        {"name": "Phi-4-mini-instruct-generic-cpu", "alias": "phi-4-mini", "runtime": {"deviceType": "CPU"}},
        {"name": "Phi-4-mini-instruct-generic-gpu", "alias": "phi-4-mini", "runtime": {"deviceType": "GPU"}},
        {"name": "qwen:1", "alias": "qwen"},
        {"name": "qwen:3", "alias": "qwen"},
    ]
    assert resolve_alias("phi-4-mini", catalog) == "Phi-4-mini-instruct-generic-gpu"
    assert resolve_alias("PHI-4-MINI-INSTRUCT-GENERIC-CPU", catalog) == "Phi-4-mini-instruct-generic-cpu"
    assert resolve_alias("qwen", catalog) == "qwen:3"
    assert resolve_alias("unknown", catalog) is None
    # Among the variants this machine downloaded, when it has any.
    assert resolve_alias("phi-4-mini", catalog, ["Phi-4-mini-instruct-generic-cpu"]) == "Phi-4-mini-instruct-generic-cpu"


async def test_foundry_discovered_through_its_cli(start_upstream, start_proxy, tmp_path, monkeypatch):
    url, recorder = await start_upstream(Script(), factory=foundry_double)
    port = url.rsplit(":", 1)[1]
    # A stand-in `foundry` CLI that prints what CLI 0.10.2's `foundry server status` prints.
    cli = tmp_path / "foundry"
    cli.write_text(f"#!/bin/sh\n[ \"$1\" = server ] || exit 1\nprintf 'State    Ready\\nWeb URLs http://127.0.0.1:{port}\\n'\n")
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    proxy = await start_proxy(FoundryBackend(None, "phi-4-mini"))
    assert proxy.engine.backend.base_url == url
    assert proxy.engine.scheduler.config.max_batch_size == 1  # Foundry serves one at a time
    out = await client(proxy).chat.completions.create(model="phi-4-mini", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == "Hello, world!"
    # The alias became the variant this machine has (the catalog's GPU one is not
    # downloaded), loaded before first use (a fresh service has nothing loaded).
    assert recorder.bodies[0] == {"load": "Phi-4-mini-instruct-generic-cpu", "query": {"ttl": "600"}}
    assert recorder.bodies[1]["model"] == "Phi-4-mini-instruct-generic-cpu"
    again = await client(proxy).chat.completions.create(model="phi-4-mini", messages=[{"role": "user", "content": "hi"}])
    assert again.choices[0].message.content == "Hello, world!" and len(recorder.bodies) == 3  # loaded once
    # KVStream resolves names against what the machine can serve (downloaded ids and their
    # aliases); the service's own /v1/models, passed through as it answers, lists what is loaded.
    ids = [m.id for m in await proxy.engine.models()]
    assert "phi-4-mini" in ids and "Phi-4-mini-instruct-generic-cpu" in ids
    assert [m.id for m in (await client(proxy).models.list()).data] == ["Phi-4-mini-instruct-generic-cpu"]


async def test_foundry_restarted_on_a_new_port_is_found_again_on_the_next_request(start_upstream, start_proxy, tmp_path, monkeypatch, refused_port):
    """Foundry binds a new port each time its service starts: a request that cannot connect
    asks the CLI again and is retried there once (nothing had been sent)."""
    first, _ = await start_upstream(Script(), factory=foundry_double)
    moved, recorder = await start_upstream(Script(), factory=foundry_double)
    cli = tmp_path / "foundry"
    where = tmp_path / "port"
    where.write_text(first.rsplit(":", 1)[1])
    cli.write_text(f"#!/bin/sh\n[ \"$1\" = server ] || exit 1\nprintf 'Web URLs http://127.0.0.1:%s\\n' $(cat {where})\n")
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    proxy = await start_proxy(FoundryBackend(None, "phi-4-mini"))
    assert proxy.engine.backend.base_url == first
    # The service restarts elsewhere; its old port now refuses connections.
    where.write_text(moved.rsplit(":", 1)[1])
    backend = proxy.engine.backend
    await backend.close()
    backend.base_url = f"http://127.0.0.1:{refused_port()}"
    await backend.start()
    out = await client(proxy).chat.completions.create(model="phi-4-mini", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == "Hello, world!"
    assert proxy.engine.backend.base_url == moved and recorder.bodies[-1]["model"] == "Phi-4-mini-instruct-generic-cpu"


async def test_foundry_not_running_is_a_clear_503(start_proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no foundry CLI at all
    proxy = await start_proxy(FoundryBackend(None, "phi-4-mini"))
    with pytest.raises(openai.InternalServerError) as err:
        await client(proxy).chat.completions.create(model="phi-4-mini", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 503 and "Foundry Local is not running" in err.value.message


async def test_ollama_settings_reach_the_runtime(start_upstream, start_proxy):
    """backend.parallel / num_ctx / keep_alive from the config, as `kvstream serve` builds it."""
    from kvstream.cli.serve import build_backend
    from tests.conftest import make_settings

    url, recorder = await start_upstream(Script(), factory=ollama_double)
    settings = make_settings(backend={"type": "ollama", "base_url": url, "parallel": 3, "num_ctx": 8192, "keep_alive": "-1"})
    backend = await build_backend(settings)
    proxy = await start_proxy(backend)
    await client(proxy).chat.completions.create(model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}])
    assert recorder.bodies[0]["options"]["num_ctx"] == 8192 and recorder.bodies[0]["keep_alive"] == "-1"
    assert proxy.engine.scheduler.config.max_batch_size == 3
    assert proxy.engine.limits.n_ctx_total == 3 * 8192


async def test_lmstudio_found_where_its_cli_says_when_no_url_is_given(start_upstream, start_proxy, tmp_path, monkeypatch):
    """LM Studio keeps the port it was last started on (`lms server start --port N`)."""
    url, _ = await start_upstream(Script(), factory=lmstudio_double)
    port = url.rsplit(":", 1)[1]
    cli = tmp_path / "lms"
    cli.write_text(f"#!/bin/sh\n[ \"$1 $2 $3\" = 'server status --json' ] || exit 1\nprintf '{{ \"running\": true, \"port\": {port} }}\\n'\n")
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    proxy = await start_proxy(LMStudioBackend())
    assert proxy.engine.backend.base_url == url
    out = await client(proxy).chat.completions.create(model="meta-llama-3.1-8b-instruct", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content
    explicit = LMStudioBackend("http://127.0.0.1:1234")
    await explicit.start()
    assert explicit.base_url == "http://127.0.0.1:1234"  # an explicit URL is never second-guessed
    await explicit.close()


async def test_foundry_model_not_downloaded_is_a_clear_client_error(start_upstream, start_proxy, tmp_path, monkeypatch):
    """An id this machine has not downloaded (the catalog's GPU variant): KVStream resolves
    names against what the machine has, so the client gets a 404 naming what it can use,
    and nothing is loaded or sent."""
    url, recorder = await start_upstream(Script(), factory=foundry_double)
    proxy = await start_proxy(FoundryBackend(url, "phi-4-mini"))
    with pytest.raises(openai.APIStatusError) as err:
        await client(proxy).chat.completions.create(
            model="Phi-4-mini-instruct-generic-gpu", messages=[{"role": "user", "content": "hi"}]
        )
    assert err.value.status_code == 404 and "Phi-4-mini-instruct-generic-cpu" in err.value.message
    assert recorder.bodies == []  # neither a load nor a chat was sent


@pytest.mark.parametrize("output", ['{ "running": false, "port": 4321 }', "lms: command failed", ""], ids=["stopped", "garbage", "silent"])
async def test_lmstudio_keeps_its_default_url_when_the_cli_says_nothing_useful(tmp_path, monkeypatch, output):
    cli = tmp_path / "lms"
    cli.write_text(f"#!/bin/sh\nprintf '%s\\n' '{output}'\n")
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    backend = LMStudioBackend()
    await backend.start()
    assert backend.base_url == "http://127.0.0.1:1234"
    await backend.close()
