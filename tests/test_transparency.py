"""Transparency: every route KVStream does not manage reaches the runtime unchanged, and the
managed OpenAI routes keep what the runtime sent (logprobs, timings, unknown fields, its own
errors), driven with real HTTP and the official openai client against runtime doubles."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re

import aiohttp
import openai
import pytest
from aiohttp import web
from openai import AsyncOpenAI

from kvstream.backends import OllamaBackend, OpenAICompatibleBackend
from tests.conftest import wait_released
from tests.doubles import Recorder, Script, ollama_double, openai_upstream

KEY = "kvstream-key"


def runtime_double(script: Script, recorder: Recorder, seen: list[web.Request] | None = None) -> web.Application:
    """The OpenAI double plus llama-server-like routes KVStream does not manage."""
    app = openai_upstream(script, recorder)
    seen = seen if seen is not None else []

    async def props(request: web.Request) -> web.Response:
        seen.append(request)
        return web.json_response(
            {"total_slots": 2, "query": request.query_string}, headers={"X-Runtime": "llama", "Cache-Control": "max-age=7"}
        )

    async def tokenize(request: web.Request) -> web.Response:
        seen.append(request)
        body = await request.json()
        return web.json_response({"tokens": [ord(c) for c in body["content"]]})

    async def upload(request: web.Request) -> web.Response:
        seen.append(request)
        data = await request.content.read()  # past the double's own 1 MiB read() limit
        return web.json_response({"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})

    async def slow_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"part {i}\n".encode())
            await asyncio.sleep(0.3)
        await resp.write_eof()
        return resp

    async def cut_short(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain", "Content-Length": "1000"})
        await resp.prepare(request)
        await resp.write(b"only part of it")
        request.transport.close()  # type: ignore[union-attr]
        return resp

    async def native_completion(request: web.Request) -> web.Response:
        seen.append(request)
        with recorder.tracking(await request.json()):
            await asyncio.sleep(0.3)
        return web.json_response({"content": " done", "stop": True, "timings": {"predicted_n": 1}})

    async def runtime_metrics(request: web.Request) -> web.Response:
        return web.Response(text="llamacpp:prompt_tokens_total 3\n")

    async def preflight(request: web.Request) -> web.Response:
        return web.Response(headers={"Access-Control-Allow-Origin": "*", "Access-Control-Allow-Methods": "POST"})

    async def bad_request(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": 400, "message": "runtime says no", "type": "invalid_request_error"}}, status=400)

    async def models(request: web.Request) -> web.Response:  # llama-server serves both paths
        return web.json_response({"object": "list", "data": [{"id": "test-model", "object": "model", "meta": {"n_ctx_train": 8192}}]})

    app.router.add_get("/models", models)
    app.router.add_get("/props", props)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/upload", upload)
    app.router.add_get("/slow", slow_stream)
    app.router.add_get("/cut", cut_short)
    app.router.add_post("/completion", native_completion)
    app.router.add_get("/metrics", runtime_metrics)
    app.router.add_route("OPTIONS", "/v1/chat/completions", preflight)
    app.router.add_post("/v1/embeddings", bad_request)
    return app


@pytest.fixture
async def runtime(aiohttp_server):
    seen: list[web.Request] = []
    recorder = Recorder()
    script = Script(tokens=["Hel", "lo"], extra={"timings": {"predicted_n": 2}, "system_fingerprint": "b1234"}, logprobs=True)
    server = await aiohttp_server(runtime_double(script, recorder, seen))
    return str(server.make_url("")).rstrip("/"), recorder, seen, script


# ------------------------------------------------------------------ pass-through
async def test_an_unmanaged_get_reaches_the_runtime_with_its_query_and_headers(runtime, start_proxy, http):
    url, _, seen, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with http.get(proxy.url + "/props?fields=a,b&x=1", headers={"X-Client": "yes", "Connection": "keep-alive, X-Drop", "X-Drop": "1", "TE": "trailers"}) as resp:
        assert resp.status == 200
        assert resp.headers["X-Runtime"] == "llama" and resp.headers["Cache-Control"] == "max-age=7"
        assert (await resp.json())["query"] == "fields=a,b&x=1"
    forwarded = seen[-1].headers
    assert forwarded["X-Client"] == "yes"
    assert "X-Drop" not in forwarded and "TE" not in forwarded  # hop-by-hop, and what Connection names


async def test_a_post_body_and_a_large_upload_arrive_intact(runtime, start_proxy, http):
    url, _, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url), server={"max_body_bytes": 3 * 1024 * 1024})
    async with http.post(proxy.url + "/tokenize", json={"content": "abc"}) as resp:
        assert await resp.json() == {"tokens": [97, 98, 99]}
    data = bytes(range(256)) * 8192  # 2 MiB
    async with http.post(proxy.url + "/upload", data=data) as resp:
        assert await resp.json() == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    async def chunked():  # no Content-Length: streamed upstream as it comes
        for _ in range(16):
            yield data[: 128 * 1024]

    async with http.post(proxy.url + "/upload", data=chunked()) as resp:
        assert (await resp.json())["bytes"] == 16 * 128 * 1024


async def test_an_upload_over_the_limit_gets_413_and_never_reaches_the_runtime(runtime, start_proxy, http):
    url, _, seen, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url), server={"max_body_bytes": 4096})
    async with http.post(proxy.url + "/upload", data=b"x" * 10_000) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"
    assert not seen


async def test_a_streamed_answer_is_forwarded_as_it_arrives(runtime, start_proxy, http):
    url, _, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    loop = asyncio.get_running_loop()
    async with http.get(proxy.url + "/slow") as resp:
        started = loop.time()
        first = await resp.content.readline()
        first_at = loop.time() - started
        rest = await resp.read()
    assert first == b"part 0\n" and rest == b"part 1\npart 2\n"
    assert first_at < 0.25, "the first part waited for the whole answer"


async def test_a_runtime_that_closes_mid_body_cuts_the_client_short_and_the_proxy_lives(runtime, start_proxy, http):
    url, _, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.get(proxy.url + "/cut") as resp:
            await resp.read()
    async with http.get(proxy.url + "/props") as resp:
        assert resp.status == 200


async def test_keys_guard_pass_through_and_kvstreams_key_is_not_forwarded(runtime, start_proxy, http):
    url, _, seen, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url, api_key="runtime-key"), server={"api_keys": [KEY]})
    async with http.get(proxy.url + "/props") as resp:
        assert resp.status == 401
    async with http.get(proxy.url + "/props", headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 200
    assert seen[-1].headers["Authorization"] == "Bearer runtime-key"  # the runtime's own credential
    # Anthropic's clients send the key as x-api-key: taken, and not forwarded either.
    async with http.get(proxy.url + "/props", headers={"x-api-key": "wrong"}) as resp:
        assert resp.status == 401
    async with http.get(proxy.url + "/props", headers={"x-api-key": KEY}) as resp:
        assert resp.status == 200
    assert "x-api-key" not in {name.lower() for name in seen[-1].headers}
    # A CORS preflight carries no credentials by design: it passes through to the runtime.
    async with http.options(proxy.url + "/v1/chat/completions", headers={"Origin": "http://app", "Access-Control-Request-Method": "POST"}) as resp:
        assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "*"


async def test_the_runtimes_own_routes_shadowed_by_kvstreams_are_under_upstream(runtime, start_proxy, http):
    url, _, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with http.get(proxy.url + "/metrics") as resp:
        assert "kvstream_requests_running" in await resp.text()
    async with http.get(proxy.url + "/upstream/metrics") as resp:
        assert await resp.text() == "llamacpp:prompt_tokens_total 3\n"
    async with http.get(proxy.url + "/nothing-here") as resp:
        assert resp.status == 404  # the runtime's own 404


async def test_a_native_generation_route_takes_a_batch_slot(runtime, start_proxy, http):
    url, recorder, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url), scheduler={"max_batch_size": 1})

    async def one() -> dict:
        async with http.post(proxy.url + "/completion", json={"prompt": "Hi", "n_predict": 4}) as resp:
            return await resp.json()

    results = await asyncio.gather(*(one() for _ in range(3)))
    assert all(r["content"] == " done" for r in results)
    assert recorder.max_in_flight == 1  # admitted one at a time, like the managed routes
    await wait_released(proxy)
    assert proxy.engine.stats.requests_finished == 3
    metrics = await (await http.get(proxy.url + "/metrics")).text()
    assert 'kvstream_requests_total{code="200",route="passthrough_generation"} 3.0' in metrics


async def test_a_runtime_error_on_a_passed_through_route_is_its_own(runtime, start_proxy, http):
    url, _, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with http.post(proxy.url + "/v1/embeddings", json={"input": "x"}) as resp:
        assert resp.status == 400
        assert await resp.json() == {"error": {"code": 400, "message": "runtime says no", "type": "invalid_request_error"}}


async def test_the_embeddings_client_reaches_the_runtime(start_proxy, aiohttp_server):
    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(
            {"object": "list", "model": body["model"], "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]}],
             "usage": {"prompt_tokens": 2, "total_tokens": 2}}
        )

    app = openai_upstream(Script(), Recorder())
    app.router.add_post("/v1/embeddings", embeddings)
    server = await aiohttp_server(app)
    proxy = await start_proxy(OpenAICompatibleBackend(str(server.make_url("")).rstrip("/")))
    async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        result = await client.embeddings.create(model="test-model", input="hello")
    assert result.data[0].embedding == [0.5, -0.25]


# ------------------------------------------------------------ the runtime's answer
async def test_a_streamed_chat_keeps_every_field_the_runtime_sent(runtime, start_proxy, http):
    url, recorder, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True, "top_logprobs": 2}
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        raw = await resp.text()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert raw.endswith("data: [DONE]\n\n")
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # the runtime's own role chunk
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["Hel", "lo"]
    assert events[1]["choices"][0]["logprobs"]["content"][0]["token"] == "Hel"
    assert all(e["timings"] == {"predicted_n": 2} and e["system_fingerprint"] == "b1234" for e in events)
    assert all(e["id"] == "chatcmpl-double" for e in events)
    assert not any("usage" in e for e in events)  # the client did not ask for it (KVStream did)
    assert recorder.bodies[-1]["top_logprobs"] == 2 and recorder.bodies[-1]["stream_options"] == {"include_usage": True}


async def test_a_managed_chat_carries_the_clients_own_headers_upstream(runtime, start_proxy, http):
    """A runtime feature keyed by a request header (llama-server's X-Conversation-Id stream
    sessions) works through KVStream: the client's end-to-end headers go with the forwarded
    body, without the hop-by-hop ones, the body's own description, KVStream's controls or
    KVStream's key; the runtime's credential is KVStream's to send."""
    url, recorder, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url, api_key="runtime-key"), server={"api_keys": [KEY]})
    body = {"model": "test-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    sent = {"Authorization": f"Bearer {KEY}", "X-Conversation-Id": "conv-1::m", "OpenAI-Organization": "org-1",
            "Connection": "keep-alive, X-Drop", "X-Drop": "1", "X-KVStream-Priority": "high", "Accept-Encoding": "br",
            "Via": "1.1 corp-gateway"}
    for stream in (True, False):
        async with http.post(proxy.url + "/v1/chat/completions", json=body | {"stream": stream}, headers=sent) as resp:
            assert resp.status == 200
            await resp.read()
        upstream = recorder.headers[-1]
        assert upstream["X-Conversation-Id"] == "conv-1::m" and upstream["OpenAI-Organization"] == "org-1"
        assert upstream["Authorization"] == "Bearer runtime-key" and upstream["Content-Type"] == "application/json"
        assert upstream["X-Request-Id"] == resp.headers["X-Request-Id"]
        assert "X-Drop" not in upstream and "X-KVStream-Priority" not in upstream and upstream.get("Accept-Encoding") != "br"
        # RFC 9110 7.6.3: the proxies the request passed, then this one (what detects a loop).
        assert re.fullmatch(r"1\.1 corp-gateway, 1\.1 kvstream \([0-9a-f]{16}\)", upstream["Via"]), upstream["Via"]
    # The openai client's own headers arrive too (its SDK's X-Stainless-* among them).
    client = AsyncOpenAI(base_url=proxy.url + "/v1", api_key=KEY, default_headers={"X-Conversation-Id": "conv-2"})
    await client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    assert recorder.headers[-1]["X-Conversation-Id"] == "conv-2" and "X-Stainless-Lang" in recorder.headers[-1]
    await client.close()


async def test_a_runtime_behind_url_credentials_gets_them_whatever_authorization_a_client_sends(runtime, start_proxy, http):
    """No KVStream keys, the runtime's credentials in its URL, and a client that sends its own
    Authorization (the openai client always does): the managed chat and a passed-through
    route reach the runtime with the URL's credentials (aiohttp refuses a request carrying
    both, which had failed every such chat)."""
    import base64

    url, recorder, seen, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url.replace("http://", "http://user:p%40ss@")))
    basic = "Basic " + base64.b64encode(b"user:p@ss").decode()
    client = AsyncOpenAI(base_url=proxy.url + "/v1", api_key="the-clients-own", max_retries=0)
    for stream in (False, True):
        answer = await client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}], stream=stream)
        if stream:
            assert [chunk async for chunk in answer]
        assert recorder.headers[-1]["Authorization"] == basic
    await client.close()
    async with http.get(proxy.url + "/props", headers={"Authorization": "Bearer the-clients-own"}) as resp:
        assert resp.status == 200
    assert seen[-1].headers["Authorization"] == basic


async def test_usage_reaches_a_streaming_client_that_asked_for_it(runtime, start_proxy):
    url, _, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello"


async def test_a_non_streamed_answer_is_the_runtimes_own_body(runtime, start_proxy, http):
    url, recorder, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        reply = await client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}], logprobs=True)
    assert reply.choices[0].message.content == "Hello"
    assert [t.token for t in reply.choices[0].logprobs.content] == ["Hel", "lo"]
    assert reply.system_fingerprint == "b1234" and reply.model_extra["timings"] == {"predicted_n": 2}
    assert recorder.bodies[-1].get("stream") is None  # asked the way the client asked
    assert proxy.engine.stats.requests_finished == 1 and proxy.engine.scheduler.bm.is_idle()


async def test_any_model_name_is_served_by_a_single_model_runtime(runtime, start_proxy):
    url, recorder, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        # An app written for OpenAI: the single-model runtime serves any name (llama-server does).
        reply = await client.chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "hi"}])
    assert recorder.bodies[-1]["model"] == "test-model"
    assert reply.model == "test-model"  # what the runtime answered, untouched


async def test_a_body_without_model_is_accepted(runtime, start_proxy, http):
    url, recorder, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with http.post(proxy.v1 + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"] == "Hello"
    assert "model" not in recorder.bodies[-1]


async def test_unprefixed_openai_routes_are_managed_too(runtime, start_proxy, http):
    url, _, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with http.post(proxy.url + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200 and "X-KVStream-Queue-Ms" in resp.headers
    async with http.get(proxy.url + "/models") as resp:
        assert (await resp.json())["data"][0]["meta"] == {"n_ctx_train": 8192}  # the runtime's own list, whole


async def test_the_runtime_judges_values_and_its_error_reaches_the_client_as_is(start_proxy, start_upstream, http):
    error = {"error": {"code": 400, "message": "temperature must be finite", "type": "invalid_request_error"}}
    url, _ = await start_upstream(Script(status=400, error_body=error))
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with http.post(proxy.v1 + "/chat/completions", json={"model": "test-model", "messages": [{"role": "user", "content": "x"}], "temperature": 9}) as resp:
        assert resp.status == 400
        assert await resp.json() == error


async def test_kvstreams_own_bad_values_get_400_never_422(runtime, start_proxy, http):
    url, _, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    body = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "priority": "urgent"}
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "invalid_request_error"


async def test_a_translating_backend_validates_with_400_and_keeps_ollamas_404(start_proxy, start_upstream, http):
    url, _ = await start_upstream(Script(), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    async with http.post(proxy.v1 + "/chat/completions", json={"model": "llama3.2:latest", "messages": [], "temperature": 5}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
    async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-3.5-turbo", messages=[{"role": "user", "content": "hi"}])
        # max_tokens 0 is the runtime's to judge, not refused before it.
        reply = await client.chat.completions.create(model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
        assert reply.choices[0].finish_reason is not None


async def test_pass_through_can_be_switched_off(runtime, start_proxy, http):
    url, _, seen, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url), server={"passthrough": False})
    async with http.get(proxy.url + "/props") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "unknown_route"
    assert not seen
    async with http.post(proxy.v1 + "/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200  # the managed routes still work


async def test_a_compressed_upload_reaches_the_runtime_as_sent(runtime, start_proxy, http):
    """A passed-through body is not inflated by KVStream (issue 18: inflating in the parser
    let one request stall the server): it goes upstream compressed, still labelled, and the
    runtime reads it as it would directly."""
    import gzip

    url, _, seen, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    data = b"kvstream " * 20_000
    packed = gzip.compress(data)
    async with http.post(proxy.url + "/upload", data=packed, headers={"Content-Encoding": "gzip"}) as resp:
        assert resp.status == 200, await resp.text()
        assert await resp.json() == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert seen[-1].headers["Content-Encoding"] == "gzip"
    assert int(seen[-1].headers["Content-Length"]) == len(packed)


async def test_pass_through_with_the_runtime_gone_is_a_503(start_proxy, http, unused_tcp_port_factory):
    proxy = await start_proxy(OpenAICompatibleBackend(f"http://127.0.0.1:{unused_tcp_port_factory()}"))
    async with http.get(proxy.url + "/props") as resp:
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "backend_unavailable"
    async with http.post(proxy.url + "/completion", json={"prompt": "x"}) as resp:
        assert resp.status == 503
    await wait_released(proxy)


async def test_a_client_leaving_a_native_generation_cancels_it_and_frees_the_slot(start_proxy, aiohttp_server):
    recorder = Recorder()
    started = asyncio.Event()

    async def completion(request: web.Request) -> web.StreamResponse:
        with recorder.tracking(await request.json()):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(100):
                await resp.write(f'data: {{"content": "{i}"}}\n\n'.encode())
                started.set()
                await asyncio.sleep(0.05)
        return resp

    app = openai_upstream(Script(), Recorder())
    app.router.add_post("/completion", completion)
    server = await aiohttp_server(app)
    proxy = await start_proxy(OpenAICompatibleBackend(str(server.make_url("")).rstrip("/")))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(proxy.url + "/completion", json={"prompt": "x", "stream": True})
        await resp.content.readline()
        await started.wait()
        resp.close()  # the client hangs up mid-answer
    for _ in range(200):
        if recorder.cancelled:
            break
        await asyncio.sleep(0.02)
    assert recorder.cancelled == 1 and recorder.completed == 0  # the runtime stopped generating
    await wait_released(proxy)
    assert proxy.engine.stats.requests_cancelled == 1


async def test_a_chunked_upload_over_the_limit_is_cut_with_413(runtime, start_proxy, http):
    url, _, _, _ = runtime
    proxy = await start_proxy(OpenAICompatibleBackend(url), server={"max_body_bytes": 64 * 1024})

    async def chunked():  # no Content-Length: the limit is counted as the body streams
        for _ in range(8):
            yield b"x" * 16 * 1024

    async with http.post(proxy.url + "/upload", data=chunked()) as resp:
        assert resp.status == 413, await resp.text()
    async with http.get(proxy.url + "/props") as resp:
        assert resp.status == 200  # and the proxy goes on


async def test_an_admin_route_outlives_the_generation_deadline(aiohttp_server, start_proxy, http):
    """The request deadline is for generations: a runtime's own long route (Ollama's
    /api/pull streams progress for as long as a download takes) passes through whole, held
    only to the read timeout."""

    async def pull(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        for done in range(6):
            await response.write(json.dumps({"status": "pulling", "completed": done}).encode() + b"\n")
            await asyncio.sleep(0.3)
        await response.write_eof(b'{"status":"success"}\n')
        return response

    app = web.Application()
    app.router.add_post("/api/pull", pull)
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app)
    proxy = await start_proxy(OpenAICompatibleBackend(str(server.make_url("")).rstrip("/"), request_timeout_s=0.5))
    async with http.post(proxy.url + "/api/pull", json={"model": "m"}) as resp:
        lines = (await resp.read()).splitlines()
    assert resp.status == 200 and json.loads(lines[-1]) == {"status": "success"} and len(lines) == 7
