"""The HTTP front against a scripted OpenAI-compatible upstream: the OpenAI wire format, the
official client, streaming transparency, and every unhappy path."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from kvstream.backends import OllamaBackend, OpenAICompatibleBackend
from tests.conftest import assert_cancelled_and_released
from tests.doubles import Script, ollama_double

pytestmark = pytest.mark.timeout(60)


async def sse_lines(resp: aiohttp.ClientResponse) -> list[str]:
    text = (await resp.read()).decode()
    return [line for line in text.split("\n\n") if line]


@pytest.fixture
async def proxied(start_upstream, start_proxy):
    """A proxy in front of a scripted upstream; returns (proxy, script, recorder)."""
    script = Script()
    url, recorder = await start_upstream(script)
    proxy = await start_proxy(OpenAICompatibleBackend(url, None), scheduler={"max_batch_size": 4})
    return proxy, script, recorder


def client(proxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)


async def test_chat_non_streaming_with_the_openai_client(proxied):
    proxy, script, recorder = proxied
    out = await client(proxy).chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    assert out.choices[0].message.content == "Hello, world!"
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 4 and out.usage.total_tokens == 11
    # Asked the way the client asked: the runtime's own non-streamed body comes back.
    assert "stream" not in recorder.bodies[0] and "stream_options" not in recorder.bodies[0]
    assert proxy.engine.scheduler.bm.is_idle() and proxy.engine.stats.generation_tokens == 4


async def test_answers_that_come_back_whole_count_in_the_recent_window(proxied, http):
    """/status's last-minute figures (and the Retry-After estimate, which reads its median
    end-to-end time) count non-streamed answers too: they have no first token to time."""
    proxy, *_ = proxied
    c = client(proxy)
    await c.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    async with http.get(proxy.url + "/status") as resp:
        recent = (await resp.json())["recent"]
    assert recent["requests"] == 1 and recent["e2e_p50_s"] is not None
    assert recent["ttft_p50_s"] is None and recent["decode_tokens_per_s_p50"] is None
    assert proxy.engine.recent_e2e_median_s() == recent["e2e_p50_s"]
    stream = await c.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert [chunk async for chunk in stream]
    async with http.get(proxy.url + "/status") as resp:
        recent = (await resp.json())["recent"]
    assert recent["requests"] == 2 and recent["ttft_p50_s"] is not None


async def test_chat_streaming_is_framed_exactly_as_openai(proxied, http):
    proxy, *_ = proxied
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Request-Id"] and "X-KVStream-Queue-Ms" in resp.headers
        events = await sse_lines(resp)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1] if c["choices"]) == "Hello, world!"
    finish = chunks[-2]
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "stop"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == 11
    assert all(c.get("usage") is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "chat.completion.chunk" for c in chunks)


async def test_streaming_with_the_openai_client_and_completions(proxied):
    proxy, script, _ = proxied
    c = client(proxy)
    stream = await c.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
    assert "".join(pieces) == "Hello, world!"
    script.finish_reason = "length"
    out = await c.completions.create(model="test-model", prompt="Once", max_tokens=4)
    assert out.choices[0].text == "Hello, world!" and out.choices[0].finish_reason == "length"
    stream = await c.completions.create(model="test-model", prompt="Once", max_tokens=4, stream=True)
    texts = [chunk.choices[0].text async for chunk in stream]
    assert "".join(texts) == "Hello, world!"


async def test_each_token_reaches_the_client_before_the_next_is_produced(proxied, http):
    proxy, script, recorder = proxied
    script.delay_s = 0.2
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    arrivals = []
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                arrivals.append(time.monotonic())
    assert len(arrivals) == 4
    # The first token arrived before the upstream even produced the second.
    assert arrivals[0] < recorder.token_times[1]
    assert arrivals[1] < recorder.token_times[2]


async def test_models_and_request_ids(proxied, http):
    proxy, *_ = proxied
    models = await client(proxy).models.list()
    assert [m.id for m in models.data] == ["test-model"]
    async with http.get(proxy.v1 + "/models/test-model") as resp:
        assert resp.status == 200 and (await resp.json())["id"] == "test-model"
    async with http.get(proxy.url + "/health") as resp:
        assert resp.status == 200 and resp.headers["X-Request-Id"].startswith("req-")
    async with http.get(proxy.url + "/health", headers={"X-Request-Id": "trace-42"}) as resp:
        assert resp.headers["X-Request-Id"] == "trace-42"


@pytest.mark.parametrize(
    "raw, status, param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'"a string"', 400, None),
        (b"\xff\xfe", 400, None),
        (json.dumps({"model": "test-model", "messages": [{"role": "user", "content": "x"}], "priority": "urgent"}).encode(), 400, "priority"),
    ],
)
async def test_what_kvstream_itself_reads_gets_an_openai_shaped_400(proxied, http, raw, status, param):
    """In front of a runtime that speaks OpenAI, KVStream judges only the JSON itself and its
    own fields; every other value is the runtime's to judge (tests/test_transparency.py)."""
    proxy, _, recorder = proxied
    async with http.post(proxy.v1 + "/chat/completions", data=raw, headers={"Content-Type": "application/json"}) as resp:
        body = await resp.json()
        assert resp.status == status, body
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
        assert resp.headers["X-Request-Id"]
    assert recorder.bodies == []  # nothing bad reached the runtime
    assert proxy.engine.scheduler.bm.is_idle()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "llama3.2:latest"}, "messages"),
        ({"model": "llama3.2:latest", "messages": []}, "messages"),
        ({"model": "llama3.2:latest", "messages": "hi"}, "messages"),
        ({"model": "llama3.2:latest", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": "llama3.2:latest", "messages": [{"role": "user"}]}, "messages.0"),
        ({"model": "llama3.2:latest", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"model": "llama3.2:latest", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
        ({"model": "llama3.2:latest", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
        ({"model": "llama3.2:latest", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ],
)
async def test_a_translating_backend_gets_only_what_kvstream_validated(start_upstream, start_proxy, http, body, param):
    """In front of Ollama's native API KVStream translates, so it validates: 400 (never 422)
    for a value it cannot translate, Ollama's own 404 for a model it does not have."""
    url, recorder = await start_upstream(Script(), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        error = (await resp.json())["error"]
        assert resp.status == (404 if param == "model" else 400), error
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
        assert "Traceback" not in error["message"]
    assert recorder.bodies == []
    assert proxy.engine.scheduler.bm.is_idle()


@pytest.mark.parametrize("best_of, n, message", [(2, 1, "best_of must be 1"), (1, 2, "at least n")])
async def test_best_of_in_front_of_a_backend_of_one_choice_is_a_400(start_upstream, start_proxy, http, best_of, n, message):
    """Completions' best_of asks for candidates; Ollama's native API gives one answer a
    request, so more than one is refused (as n is), and best_of below n is refused anywhere."""
    url, recorder = await start_upstream(Script(), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    body = {"model": "llama3.2:latest", "prompt": "x", "best_of": best_of, "n": n}
    async with http.post(proxy.v1 + "/completions", json=body) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "best_of", error
        assert message in error["message"]
    assert recorder.bodies == []
    assert proxy.engine.scheduler.bm.is_idle()


async def test_everything_openai_accepts_is_accepted(proxied):
    proxy, _, recorder = proxied
    await client(proxy).chat.completions.create(
        model="test-model",
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ],
        stop="\n",
        temperature=0,
        seed=3,
        response_format={"type": "text"},
        extra_body={"top_k": 5, "min_p": 0.1},
    )
    sent = recorder.bodies[0]
    assert sent["stop"] == "\n" and sent["top_k"] == 5 and sent["min_p"] == 0.1  # forwarded as sent
    assert sent["response_format"] == {"type": "text"} and "priority" not in sent


async def test_oversized_body_gets_413(start_upstream, start_proxy, http):
    url, recorder = await start_upstream()
    proxy = await start_proxy(OpenAICompatibleBackend(url), server={"max_body_bytes": 2048})
    body = {"model": "test-model", "messages": [{"role": "user", "content": "x" * 5000}]}
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"
    assert recorder.bodies == []


async def test_unknown_route_and_method_are_the_runtimes_to_answer(proxied, http):
    proxy, *_ = proxied
    async with http.get(proxy.url + "/v2/nothing") as resp:
        assert resp.status == 404  # the runtime's own answer, passed through
    async with http.get(proxy.v1 + "/chat/completions") as resp:
        assert resp.status == 405


async def test_backend_down_at_start_then_recovers(start_upstream, start_proxy, http, unused_tcp_port_factory):
    port = unused_tcp_port_factory()
    proxy = await start_proxy(OpenAICompatibleBackend(f"http://127.0.0.1:{port}"))
    async with http.get(proxy.url + "/ready") as resp:
        assert resp.status == 503
    async with http.get(proxy.url + "/health") as resp:
        assert resp.status == 200  # liveness does not depend on the backend
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        err = await resp.json()
        assert resp.status == 503 and resp.headers["Retry-After"]
        assert err["error"]["code"] == "backend_unavailable"
    assert proxy.engine.scheduler.bm.is_idle()
    # The runtime comes up on that port: the proxy picks it up without a restart.
    from aiohttp import web

    from tests.doubles import Recorder, openai_upstream

    runner = web.AppRunner(openai_upstream(Script(), Recorder()))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with http.get(proxy.url + "/ready") as resp:
            assert resp.status == 200
        async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
            assert resp.status == 200 and (await resp.json())["choices"][0]["message"]["content"] == "Hello, world!"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stream", [True, False])
async def test_upstream_error_status_before_any_token(proxied, http, stream):
    proxy, script, _ = proxied
    script.status = 500
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        assert resp.status == 502 and resp.headers["Content-Type"].startswith("application/json")
        assert "scripted failure" in (await resp.json())["error"]["message"]
    script.status, script.error_body = 400, {"error": {"code": 400, "message": "the request exceeds the available context size", "type": "invalid_request_error"}}
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        assert resp.status == 400 and "context size" in (await resp.json())["error"]["message"]
    assert proxy.engine.scheduler.bm.is_idle()


@pytest.mark.parametrize("fault", ["die_after", "error_after", "malformed_after"])
async def test_backend_dies_mid_stream(proxied, http, fault):
    proxy, script, _ = proxied
    setattr(script, fault, 2)
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        assert resp.status == 200
        events = await sse_lines(resp)  # the response ends cleanly (no payload error)
    payloads = [json.loads(e.removeprefix("data: ")) for e in events]
    assert "error" in payloads[-1] and set(payloads[-1]["error"]) == {"message", "type", "param", "code"}
    assert "data: [DONE]" not in events  # a truncated answer never looks complete
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in payloads[:-1]) == "Hello,"
    # The openai client raises on the error event.
    with pytest.raises(openai.APIError):
        stream = await client(proxy).chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for _ in stream:
            pass
    assert proxy.engine.scheduler.bm.is_idle()
    assert proxy.engine.stats.requests_failed == 2
    # The next request is served normally.
    setattr(script, fault, None)
    out = await client(proxy).chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == "Hello, world!"


async def test_non_streaming_mid_stream_failure_is_a_502(proxied, http):
    proxy, script, _ = proxied
    script.die_after = 2
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        assert resp.status == 502 and "error" in await resp.json()
    assert proxy.engine.scheduler.bm.is_idle()


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_upstream_and_frees_blocks(proxied, stream):
    proxy, script, recorder = proxied
    script.delay_s = 0.3
    script.tokens = ["tok"] * 50
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    async with aiohttp.ClientSession() as session:
        if stream:
            async with session.post(proxy.v1 + "/chat/completions", json=body) as resp:
                await resp.content.readline()  # the role chunk: generation is under way
        else:
            task = asyncio.create_task(session.post(proxy.v1 + "/chat/completions", json=body))
            while not recorder.bodies:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    await assert_cancelled_and_released(proxy, recorder)


async def test_client_hanging_up_while_the_backend_finishes_releases_everything(start_upstream, start_proxy):
    """A backend that does work after its last token (llama.cpp saves the slot): the client
    reads [DONE] and hangs up at once, which cancels the handler mid-cleanup. The request's
    slot and blocks must be released all the same."""
    url, _ = await start_upstream()
    finished_cleanup = asyncio.Event()

    class SlowCleanup(OpenAICompatibleBackend):
        async def generate(self, request):
            try:
                async for token in super().generate(request):
                    yield token
            finally:
                await asyncio.sleep(0.3)
                finished_cleanup.set()

    proxy = await start_proxy(SlowCleanup(url), scheduler={"max_batch_size": 1, "queue_timeout_s": 5})
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    for _ in range(3):  # with one slot, a leaked slot would block the second request
        async with aiohttp.ClientSession() as session:
            async with session.post(proxy.v1 + "/chat/completions", json=body) as resp:
                text = await resp.text()
                assert text.endswith("data: [DONE]\n\n")
    for _ in range(100):
        if proxy.engine.scheduler.bm.is_idle() and not proxy.engine.scheduler.running:
            break
        await asyncio.sleep(0.02)
    assert proxy.engine.scheduler.bm.is_idle() and not proxy.engine.scheduler.running


async def test_warm_prefills_at_start_and_on_request_through_the_scheduler(start_upstream, start_proxy, http):
    url, recorder = await start_upstream(Script())
    system = "You are a terse assistant."
    proxy = await start_proxy(OpenAICompatibleBackend(url, "test-model"), prefix_cache={"warm": [system]})
    # create_app's startup warmed the configured prompt: one token, greedy, as a system turn.
    assert recorder.bodies and recorder.bodies[0]["messages"] == [{"role": "system", "content": system}]
    assert recorder.bodies[0]["max_tokens"] == 1 and recorder.bodies[0]["temperature"] == 0
    async with http.post(proxy.v1 + "/warm", json={"prompt": "Once upon a time"}) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["object"] == "kvstream.warm" and body["prompt_tokens"] > 0
    assert recorder.bodies[-1]["prompt"] == "Once upon a time"
    for bad in ({}, {"prompt": "a", "system": "b"}, {"messages": []}, {"prompt": "a", "max_tokens": 5}):
        async with http.post(proxy.v1 + "/warm", json=bad) as resp:
            assert resp.status == 400, bad
            assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}
    assert proxy.engine.scheduler.bm.is_idle() and proxy.engine.stats.requests_finished == 2


async def test_warm_with_the_runtime_gone_is_an_openai_shaped_503_and_start_up_survives_it(start_proxy, http, unused_tcp_port):
    # The configured warm-up fails at start (logged), the proxy still comes up.
    proxy = await start_proxy(OpenAICompatibleBackend(f"http://127.0.0.1:{unused_tcp_port}", "test-model"), prefix_cache={"warm": ["x"]})
    async with http.post(proxy.v1 + "/warm", json={"system": "You are terse."}) as resp:
        assert resp.status == 503 and resp.headers.get("Retry-After")
        assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}
    async with http.post(proxy.v1 + "/warm", data=b"{not json") as resp:
        assert resp.status == 400
    assert proxy.engine.scheduler.bm.is_idle()
