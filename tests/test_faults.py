"""Faults not covered elsewhere: a client that reads slowly (backpressure reaches the runtime
instead of piling up in KVStream), a hanging runtime through the proxy (504), malformed
NDJSON from Ollama, a runtime that dies and comes back."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from aiohttp import web

from kvstream.backends import OllamaBackend, OpenAICompatibleBackend
from tests.conftest import assert_cancelled_and_released
from tests.doubles import Recorder, Script, ollama_double, openai_upstream

pytestmark = pytest.mark.timeout(60)


async def test_a_slow_reader_slows_the_runtime_instead_of_filling_kvstream(start_upstream, start_proxy):
    tokens = 20000
    script = Script(tokens=["x" * 1000] * tokens)  # ~20 MB of stream
    url, recorder = await start_upstream(script)
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with aiohttp.ClientSession(read_bufsize=2**16) as s:
        async with s.post(proxy.v1 + "/chat/completions", json=body) as resp:
            await resp.content.readline()
            await asyncio.sleep(1.0)  # the client stops reading
            produced_while_paused = len(recorder.token_times)
            assert produced_while_paused < tokens, "the whole stream was buffered somewhere instead of pushing back"
            received = 0
            async for line in resp.content:
                received += line.count(b"xxxxxxxxxx")
    assert len(recorder.token_times) == tokens and received >= tokens
    assert proxy.engine.scheduler.bm.is_idle()


async def test_a_hanging_runtime_gives_504_and_frees_everything(start_upstream, start_proxy):
    url, _ = await start_upstream(Script(hang=True))
    proxy = await start_proxy(OpenAICompatibleBackend(url, request_timeout_s=0.5))
    c = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        await c.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 504
    assert proxy.engine.scheduler.bm.is_idle() and not proxy.engine.scheduler.running


async def test_malformed_ndjson_from_ollama_is_a_clean_error(start_upstream, start_proxy):
    url, _ = await start_upstream(Script(tokens=["a", "b", "c"], malformed_after=1), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    c = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="malformed"):
        stream = await c.chat.completions.create(model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for _ in stream:
            pass
    with pytest.raises(openai.APIStatusError) as err:  # not streamed: a plain 502
        await c.chat.completions.create(model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 502 and "malformed NDJSON" in err.value.message
    assert proxy.engine.scheduler.bm.is_idle() and proxy.engine.stats.requests_failed == 2


async def test_client_leaving_during_prefill_cancels_the_runtime(start_upstream, start_proxy):
    """Admitted, the runtime still prefilling (no byte sent yet), and the client hangs up."""
    script = Script(first_delay_s=2.0)
    url, recorder = await start_upstream(script)
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(proxy.v1 + "/chat/completions", json=body))
        while not recorder.bodies:
            await asyncio.sleep(0.02)
        assert proxy.engine.scheduler.running  # admitted, waiting for the first token
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await assert_cancelled_and_released(proxy, recorder)


async def test_a_hanging_model_list_delays_no_request(start_upstream, start_proxy):
    """Once the list is known, a runtime whose /v1/models stops answering costs requests
    nothing: the known list serves while one refresh (not one per request) waits."""
    # The first call is the start-up health probe (this backend's is /v1/models), the second
    # the first list; from then on the runtime's model list hangs.
    url, recorder = await start_upstream(Script(models_hang_after=2))
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0, timeout=3) as client:
        await client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
        proxy.engine._models_at -= 60  # the list is stale now: the next request starts a refresh
        replies = await asyncio.gather(*(
            client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}]) for _ in range(8)
        ))
    assert all(r.choices[0].message.content == "Hello, world!" for r in replies)
    assert recorder.models_calls == 3  # probe, first list, then a single refresh for all eight


@pytest.mark.parametrize(("signal_name", "said"), [("ILL", "illegal instruction"), ("KILL", "killed by SIGKILL")])
async def test_a_managed_llama_server_dying_at_start_says_how(tmp_path, signal_name, said):
    """A llama-server that dies loading (built for CPU instructions the machine will not run:
    SIGILL, seen with AMX on VMs) is an error that says so, and how to rebuild it."""
    from kvstream.backends.llamacpp.runtime import ManagedLlamaServer

    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nkill -{signal_name} $$\n")
    binary.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    server = ManagedLlamaServer(model, binary=str(binary), slot_save_path=tmp_path / "slots")
    with pytest.raises(RuntimeError, match=said) as err:
        await server.start(timeout=20)
    assert ("CMAKE_ARGS" in str(err.value)) == (signal_name == "ILL")
    await server.stop()
    assert server.log_path.exists()  # it failed: the log stays, to say why
    server.log_path.unlink()


async def test_ready_follows_the_runtime_going_down_and_coming_back(start_proxy, http):
    """/status ``ready`` and ``kvstream_backend_up`` changed only when someone asked /ready: a
    runtime that died went on reading as up. The engine probes it all along now; a runtime
    that comes back with the limits it had is not sized again."""
    runner = web.AppRunner(openai_upstream(Script(), Recorder()))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    proxy = await start_proxy(OpenAICompatibleBackend(f"http://127.0.0.1:{port}"), routing={"health_interval_s": 0.1})

    async def reads(up: bool) -> None:
        for _ in range(100):
            async with http.get(proxy.url + "/status") as resp:
                ready = (await resp.json())["backend"]["ready"]
            async with http.get(proxy.url + "/metrics") as resp:
                metric = f"kvstream_backend_up {1.0 if up else 0.0}" in await resp.text()
            if ready is up and metric:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"ready never read {up}")

    try:
        await reads(True)
        scheduler = proxy.engine.scheduler
        await runner.cleanup()  # the runtime dies, its connections with it
        await reads(False)
        runner = web.AppRunner(openai_upstream(Script(), Recorder()))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await reads(True)
        # Back with the same limits: the pool is kept (and what it knows of cached prefixes).
        assert proxy.engine.scheduler is scheduler
    finally:
        await runner.cleanup()


async def test_a_runtime_reporting_malformed_limits_is_served_with_the_defaults(start_upstream, start_proxy, monkeypatch, caplog):
    """A runtime whose report of its limits does not parse (llama-server's /props with a slot
    count that is not a number, as a proxy in front of it might mangle it) is served with the
    defaults and said in the log; the start no longer fails with it."""
    url, _ = await start_upstream()
    backend = OpenAICompatibleBackend(url)

    async def malformed():
        return int("abc")

    monkeypatch.setattr(backend, "limits", malformed)
    proxy = await start_proxy(backend)
    assert "its answer is malformed (ValueError" in caplog.text
    client = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    out = await client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == "Hello, world!" and proxy.engine.ready


async def test_limits_that_never_read_serve_with_the_defaults_and_are_read_again_until_they_do(start_upstream, start_proxy, monkeypatch, caplog):
    """A runtime whose limits fail to be read (a 503 on /props, a timeout) is not sized with
    the defaults at the first failure: read again at each probe, served with the defaults
    after a few failures (said once in the log, not at every probe), and sized from its own
    report as soon as one is read."""
    from kvstream.engine import core
    from kvstream.types import BackendError, RuntimeLimits

    monkeypatch.setattr(core, "PROBE_UNTIL_SIZED_S", 0.02)
    url, _ = await start_upstream()
    backend = OpenAICompatibleBackend(url)
    reads = {"n": 0, "answer": None}

    async def limits():
        reads["n"] += 1
        if reads["answer"] is None:
            raise BackendError("runtime error (HTTP 503): busy")
        return reads["answer"]

    monkeypatch.setattr(backend, "limits", limits)
    proxy = await start_proxy(backend, routing={"health_interval_s": 0.05})
    engine = proxy.engine
    for _ in range(200):
        if engine._sized:
            break
        await asyncio.sleep(0.02)
    assert engine._sized and reads["n"] >= core.DEFAULTS_AFTER_UNREAD and engine.limits == RuntimeLimits()
    before = reads["n"]
    await asyncio.sleep(0.3)
    assert reads["n"] > before  # still read at every probe
    assert caplog.text.count("could not read the runtime's limits") == 1
    reads["answer"] = RuntimeLimits(parallel=3, n_ctx_per_request=4096, n_ctx_total=12288)
    for _ in range(200):
        if engine.scheduler.config.max_batch_size == 3:
            break
        await asyncio.sleep(0.02)
    assert engine.scheduler.config.max_batch_size == 3 and engine.limits.n_ctx_per_request == 4096
    settled = reads["n"]
    await asyncio.sleep(0.3)
    assert reads["n"] == settled  # read: no longer asked at every probe
    client = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    out = await client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == "Hello, world!"
