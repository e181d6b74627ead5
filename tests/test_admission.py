"""Admission through the HTTP front: queue full, queue timeout, never-fits, priorities, and
clients that leave while queued; plus the Python API."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvstream import KVStreamEngine
from kvstream.backends import OllamaBackend, OpenAICompatibleBackend
from kvstream.types import GenerateRequest
from tests.conftest import make_settings
from tests.doubles import Script, ollama_double

pytestmark = pytest.mark.timeout(60)

BODY = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture
async def one_slot(start_upstream, start_proxy):
    """A proxy with one slot in front of an upstream that takes 0.5 s per request."""
    script = Script(tokens=["a", "b"], first_delay_s=0.5)
    url, recorder = await start_upstream(script)
    proxy = await start_proxy(
        OpenAICompatibleBackend(url),
        scheduler={"max_batch_size": 1, "max_queue_size": 2, "queue_timeout_s": 0.3},
    )
    return proxy, script, recorder


async def post(session: aiohttp.ClientSession, proxy, body=BODY, headers=None) -> tuple[int, dict, dict]:
    async with session.post(proxy.v1 + "/chat/completions", json=body, headers=headers or {}) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def test_queue_timeout_is_503_with_retry_after(one_slot):
    proxy, _, recorder = one_slot
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(post(s, proxy))
        await asyncio.sleep(0.1)
        status, body, headers = await post(s, proxy)
        assert status == 503 and body["error"]["code"] == "queue_timeout"
        assert int(headers["Retry-After"]) >= 1
        assert (await first)[0] == 200
    assert len(recorder.bodies) == 1  # the timed-out request never reached the runtime
    assert proxy.engine.scheduler.bm.is_idle() and not proxy.engine.scheduler.waiting
    assert proxy.engine.stats.rejected == {"queue_timeout": 1}


async def test_queue_full_is_429_with_retry_after(start_upstream, start_proxy):
    url, _ = await start_upstream(Script(tokens=["a"], first_delay_s=0.5))
    proxy = await start_proxy(OpenAICompatibleBackend(url), scheduler={"max_batch_size": 1, "max_queue_size": 1})
    async with aiohttp.ClientSession() as s:
        running = asyncio.create_task(post(s, proxy))
        await asyncio.sleep(0.1)
        queued = asyncio.create_task(post(s, proxy))
        await asyncio.sleep(0.1)
        status, body, headers = await post(s, proxy)
        assert status == 429 and body["error"]["code"] == "queue_full" and int(headers["Retry-After"]) >= 1
        assert headers["x-should-retry"] == "true"
        assert (await running)[0] == 200 and (await queued)[0] == 200
    assert proxy.engine.scheduler.bm.is_idle()


async def test_a_request_past_what_the_runtime_holds_goes_upstream_as_sent(start_upstream, start_proxy):
    """The runtime judges a prompt or max_tokens past its context, as it would directly:
    llama-server answers its own 400 for the prompt, Ollama truncates it, LM Studio applies its
    overflow policy, and all three take a max_tokens past it (clients often send 4096 or more
    by default; vLLM answers its 400). KVStream answered a 400 of its own where the runtime
    alone would have served the request; it now counts what one request can hold there."""
    url, recorder = await start_upstream()
    proxy = await start_proxy(OpenAICompatibleBackend(url), memory={"num_gpu_blocks": 4, "block_size": 8})  # 32 tokens
    long = {"model": "test-model", "messages": [{"role": "user", "content": "word " * 40}], "max_tokens": 8}
    async with aiohttp.ClientSession() as s:
        for body in (BODY | {"max_tokens": 100_000}, long):
            status, answer, _ = await post(s, proxy, body)
            assert status == 200 and answer["choices"][0]["message"]["content"]
            assert recorder.bodies[-1]["max_tokens"] == body["max_tokens"]
            assert recorder.bodies[-1]["messages"] == body["messages"]
    assert proxy.engine.scheduler.bm.is_idle()


@pytest.mark.parametrize("path, body", [
    ("/responses", {"model": "llama3.2", "input": "word " * 40}),
    ("/messages", {"model": "llama3.2", "max_tokens": 8, "messages": [{"role": "user", "content": "word " * 40}]}),
], ids=["responses", "messages"])
async def test_a_prompt_past_the_context_is_400_at_once_where_the_api_promises_it(start_upstream, start_proxy, path, body):
    """OpenAI's Responses API and Anthropic's Messages, answered by KVStream in front of a
    runtime that does not speak them, promise a 400 for a prompt past the context."""
    url, recorder = await start_upstream(factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url, "llama3.2"), memory={"num_gpu_blocks": 4, "block_size": 8})
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.v1 + path, json=body) as resp:
            answer, headers = await resp.json(), resp.headers
    assert resp.status == 400 and "32 tokens" in answer["error"]["message"]
    if path == "/responses":
        assert answer["error"]["code"] == "context_length_exceeded" and headers["x-should-retry"] == "false"
    else:  # in Anthropic's shape
        assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert recorder.bodies == []


async def test_client_leaving_while_queued_frees_its_place(one_slot):
    proxy, _, recorder = one_slot
    proxy.engine.settings.scheduler.queue_timeout_s = 30
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(post(s, proxy))
        await asyncio.sleep(0.1)
        leaver = asyncio.create_task(post(s, proxy))
        await asyncio.sleep(0.1)
        assert len(proxy.engine.scheduler.waiting) == 1
        leaver.cancel()
        for _ in range(50):
            if not proxy.engine.scheduler.waiting:
                break
            await asyncio.sleep(0.02)
        assert not proxy.engine.scheduler.waiting
        assert (await first)[0] == 200
    assert len(recorder.bodies) == 1 and proxy.engine.scheduler.bm.is_idle()


async def test_priority_header_jumps_the_queue(start_upstream, start_proxy):
    url, recorder = await start_upstream(Script(tokens=["a"], first_delay_s=0.3))
    proxy = await start_proxy(OpenAICompatibleBackend(url), scheduler={"max_batch_size": 1})
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(post(s, proxy, BODY | {"messages": [{"role": "user", "content": "first"}]}))]
        await asyncio.sleep(0.1)
        tasks.append(asyncio.create_task(post(s, proxy, BODY | {"messages": [{"role": "user", "content": "normal"}]})))
        await asyncio.sleep(0.05)
        tasks.append(asyncio.create_task(post(s, proxy, BODY | {"messages": [{"role": "user", "content": "low"}], "priority": "low"})))
        await asyncio.sleep(0.05)
        tasks.append(asyncio.create_task(post(s, proxy, BODY | {"messages": [{"role": "user", "content": "urgent"}]}, {"X-KVStream-Priority": "high"})))
        results = await asyncio.gather(*tasks)
    assert all(status == 200 for status, _, _ in results)
    order = [b["messages"][0]["content"] for b in recorder.bodies]
    assert order == ["first", "urgent", "normal", "low"]


async def test_python_api_generate_and_close(start_upstream):
    url, recorder = await start_upstream()
    engine = KVStreamEngine(OpenAICompatibleBackend(url, "test-model"), make_settings())
    tokens = [t async for t in engine.generate("Once upon a time", max_tokens=8)]
    assert "".join(t.text for t in tokens) == "Hello, world!"
    assert tokens[-1].finish_reason == "stop" and tokens[-1].usage.completion_tokens == 4
    assert recorder.bodies[0]["prompt"] == "Once upon a time" and recorder.bodies[0]["max_tokens"] == 8
    assert engine.scheduler.bm.is_idle()
    await engine.close()


async def test_without_a_queue_timeout_a_request_waits_as_its_client_does(start_upstream, start_proxy):
    """Issue 16: no queue deadline by default, so a slow runtime does not become errors it
    would not have given; a client sets its own with X-KVStream-Deadline-Ms."""
    url, recorder = await start_upstream(Script(tokens=["a"], first_delay_s=0.6))
    proxy = await start_proxy(OpenAICompatibleBackend(url), scheduler={"max_batch_size": 1})
    assert proxy.engine.settings.scheduler.queue_timeout_s is None
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(post(s, proxy) for _ in range(4)))  # ~2.4 s of work, one at a time
        assert [r[0] for r in results] == [200] * 4
        running = asyncio.create_task(post(s, proxy))
        await asyncio.sleep(0.1)
        status, body, headers = await post(s, proxy, headers={"X-KVStream-Deadline-Ms": "200"})
        assert status == 503 and body["error"]["code"] == "queue_timeout" and int(headers["Retry-After"]) >= 1
        status, body, _ = await post(s, proxy, headers={"X-KVStream-Deadline-Ms": "soon"})
        assert status == 400 and body["error"]["param"] == "X-KVStream-Deadline-Ms"
        assert (await running)[0] == 200
    assert len(recorder.bodies) == 5


async def test_lpm_sends_a_waiting_request_to_the_slot_that_holds_its_prefix(start_upstream, start_proxy):
    """Issue 16: one runtime slot, requests of two tenants (long shared system prompts)
    arriving interleaved: lpm runs each tenant's requests back to back, so the slot's prompt
    cache is reused; fcfs would alternate and reuse nothing."""
    # The first request runs long enough for the other six to be queued behind it.
    url, recorder = await start_upstream(Script(tokens=["a"], first_delay_s=0.5))
    proxy = await start_proxy(OpenAICompatibleBackend(url), scheduler={"max_batch_size": 1})
    assert proxy.engine.scheduler.config.policy == "lpm"

    def body(tenant: str, i: int) -> dict:
        system = f"You are the assistant of tenant {tenant}. " * 40
        return {"model": "test-model", "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]}

    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(post(s, proxy, body("A", 0)))
        await asyncio.sleep(0.05)
        waiting = []
        for i in range(1, 4):  # B A B A B A, arriving while A0 runs
            waiting.append(asyncio.create_task(post(s, proxy, body("B", i))))
            await asyncio.sleep(0.01)
            waiting.append(asyncio.create_task(post(s, proxy, body("A", i))))
            await asyncio.sleep(0.01)
        assert (await first)[0] == 200
        assert all(r[0] == 200 for r in await asyncio.gather(*waiting))
    tenants = [b["messages"][0]["content"].split()[6].rstrip(".") for b in recorder.bodies]
    assert tenants == ["A", "A", "A", "A", "B", "B", "B"], tenants


async def test_the_runtimes_own_reuse_report_is_the_verified_hit(start_upstream, start_proxy):
    """Issue 16: llama-server's timings.cache_n (or usage cached_tokens) becomes the hit the
    header reports on a whole answer, and kvstream_runtime_cached_tokens_total counts it;
    KVStream's own inference stays its own series."""
    url, _ = await start_upstream(Script(extra={"timings": {"cache_n": 37, "prompt_n": 3}}))
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with aiohttp.ClientSession() as s:
        status, _, headers = await post(s, proxy)
        assert status == 200
        assert headers["X-KVStream-Prefix-Hit-Tokens"] == "37" and headers["X-KVStream-Prefix-Hit-Source"] == "runtime"
        async with s.post(proxy.v1 + "/chat/completions", json=BODY | {"stream": True}) as resp:
            assert resp.headers["X-KVStream-Prefix-Hit-Source"] == "kvstream"  # sent before the runtime reported
            await resp.read()
        async with s.get(proxy.url + "/metrics") as resp:
            text = await resp.text()
        async with s.get(proxy.url + "/status") as resp:
            cache = (await resp.json())["prefix_cache"]
    assert "kvstream_runtime_cached_tokens_total 74.0" in text
    assert cache["runtime_cached_tokens"] == 74 and cache["estimated"] is True


async def test_a_large_prompt_is_estimated_off_the_event_loop(start_upstream, monkeypatch):
    """In front of a runtime that cannot tokenize for KVStream the prompt is estimated: a
    quarter second per 4 MB of text, on a worker thread past ESTIMATE_ON_LOOP_CHARS (so that
    one client's MB of text does not pause every stream), on the loop below it; the same ids."""
    import threading

    import kvstream.engine.core as core
    from kvstream.engine.estimate import estimate_tokens

    threads = []
    monkeypatch.setattr(core, "estimate_tokens", lambda text: threads.append(threading.current_thread()) or estimate_tokens(text))
    url, _ = await start_upstream()
    engine = KVStreamEngine(OpenAICompatibleBackend(url, "test-model"), make_settings())
    large = "x" * core.ESTIMATE_ON_LOOP_CHARS + "the rest"
    small = "Once upon a time"
    for text in (large, small):
        ids, exact = await engine.prompt_tokens(GenerateRequest(model="test-model", prompt=text))
        assert ids == estimate_tokens(text) and not exact
    assert threads[0] is not threading.current_thread() and threads[1] is threading.current_thread()
    await engine.close()
