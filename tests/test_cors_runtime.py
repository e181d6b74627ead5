"""CORS in front of a runtime: a web page that may read the runtime's answers directly may
read them through KVStream, and one the runtime refuses is refused as directly. The answers
KVStream builds (a scheduled generation's, re-sent or translated) carry the grant the runtime
gave its answer to the request; KVStream's own refusals carry the one it last gave that
origin. Runtime doubles here (llama-server's policy: any origin; Ollama's: local pages only);
the real llama-server in tests/test_llamacpp_e2e.py."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from kvstream.api import cors
from kvstream.backends import OllamaBackend, OpenAICompatibleBackend
from tests.conftest import wait_released
from tests.doubles import Recorder, Script, ollama_double, openai_upstream

PAGE = "http://localhost:5173"
STRANGER = "https://evil.example"
CHAT = {"model": "llama3.2", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def llama_server_like(script: Script, recorder: Recorder, seen: list[str]) -> web.Application:
    """The OpenAI double with llama-server's CORS: the page's origin reflected on every answer."""
    app = openai_upstream(script, recorder)

    async def grant(request: web.Request, response: web.StreamResponse) -> None:
        seen.append(request.headers.get("Origin", ""))
        if "Origin" in request.headers:
            response.headers["Access-Control-Allow-Origin"] = request.headers["Origin"]

    async def preflight(request: web.Request) -> web.Response:
        return web.Response(headers={"Access-Control-Allow-Credentials": "true", "Access-Control-Allow-Methods": "POST"})

    app.on_response_prepare.append(grant)
    app.router.add_route("OPTIONS", "/v1/chat/completions", preflight)
    return app


async def _answer(http: aiohttp.ClientSession, url: str, body: dict, origin: str | None) -> tuple[int, dict[str, str], str]:
    headers = {"Origin": origin} if origin else {}
    async with http.post(url, json=body, headers=headers) as resp:
        text = await resp.text()
        return resp.status, dict(resp.headers), text


async def test_a_scheduled_answer_carries_the_runtimes_grant_streamed_or_not_errors_too(start_upstream, start_proxy, http):
    seen: list[str] = []
    script = Script(tokens=["Hel", "lo"])
    url, _ = await start_upstream(script, factory=lambda s, r: llama_server_like(s, r, seen))
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    for body in (CHAT, dict(CHAT, stream=True)):
        status, headers, text = await _answer(http, proxy.v1 + "/chat/completions", body, PAGE)
        assert status == 200 and "Hel" in text
        assert headers["Access-Control-Allow-Origin"] == PAGE and "Origin" in headers["Vary"]
        assert seen[-1] == PAGE  # the page's origin went upstream: the runtime judged it
    status, headers, _ = await _answer(http, proxy.v1 + "/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}, PAGE)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == PAGE
    # The runtime's own error: a page reads it as it would directly (not a CORS failure).
    script.status = 400
    status, headers, text = await _answer(http, proxy.v1 + "/chat/completions", CHAT, PAGE)
    assert status == 400 and "scripted failure" in text and headers["Access-Control-Allow-Origin"] == PAGE
    # No page, no grant (nor a Vary KVStream adds for one).
    script.status = None
    status, headers, _ = await _answer(http, proxy.v1 + "/chat/completions", CHAT, None)
    assert status == 200 and "Access-Control-Allow-Origin" not in headers and seen[-1] == ""
    await wait_released(proxy)


async def test_kvstreams_own_refusal_carries_the_grant_the_runtime_last_gave_that_origin(start_upstream, start_proxy, http,
                                                                                        monkeypatch):
    url, _ = await start_upstream(Script(), factory=lambda s, r: llama_server_like(s, r, []))
    proxy = await start_proxy(OpenAICompatibleBackend(url), server={"max_messages": 1})
    too_many = dict(CHAT, messages=CHAT["messages"] * 2)  # refused by KVStream before the runtime sees it
    status, headers, _ = await _answer(http, proxy.v1 + "/chat/completions", too_many, PAGE)
    assert status == 413 and "Access-Control-Allow-Origin" not in headers  # the runtime said nothing of this page yet
    # The browser's preflight passes through: the runtime's grant comes back as it gave it.
    async with http.options(proxy.v1 + "/chat/completions", headers={"Origin": PAGE, "Access-Control-Request-Method": "POST"}) as resp:
        assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == PAGE
    status, headers, _ = await _answer(http, proxy.v1 + "/chat/completions", too_many, PAGE)
    assert status == 413 and headers["Access-Control-Allow-Origin"] == PAGE
    assert headers["Access-Control-Allow-Credentials"] == "true"
    status, headers, _ = await _answer(http, proxy.v1 + "/chat/completions", too_many, STRANGER)
    assert "Access-Control-Allow-Origin" not in headers  # another origin: what was learned is per origin
    # A grant stands for ten minutes: then the runtime is asked again.
    monkeypatch.setattr(cors, "GRANT_TTL_S", 0.0)
    status, headers, _ = await _answer(http, proxy.v1 + "/chat/completions", too_many, PAGE)
    assert status == 413 and "Access-Control-Allow-Origin" not in headers


async def test_in_front_of_ollama_a_page_ollama_refuses_is_refused_as_directly(start_upstream, start_proxy, http):
    """KVStream translates the OpenAI routes to Ollama's native API: the page's origin goes
    with the translated request, so Ollama's own policy (local pages, OLLAMA_ORIGINS) decides."""
    url, _ = await start_upstream(Script(tokens=["Hel", "lo"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    for body in (CHAT, dict(CHAT, stream=True)):
        status, headers, text = await _answer(http, proxy.v1 + "/chat/completions", body, PAGE)
        assert status == 200 and "Hel" in text and headers["Access-Control-Allow-Origin"] == PAGE
        direct = await _answer(http, url + "/v1/chat/completions", body, STRANGER)
        status, headers, _ = await _answer(http, proxy.v1 + "/chat/completions", body, STRANGER)
        assert status == direct[0] == 403 and "Access-Control-Allow-Origin" not in headers
    # The Responses API, which KVStream answers itself over Ollama's chat.
    status, headers, text = await _answer(http, proxy.v1 + "/responses", {"model": "llama3.2", "input": "hi", "max_output_tokens": 4}, PAGE)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == PAGE
    # Ollama's native route passes through with Ollama's own answer.
    status, headers, _ = await _answer(http, proxy.url + "/api/chat", dict(CHAT, model="llama3.2:latest", stream=False), PAGE)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == PAGE
    await wait_released(proxy)


def test_the_grants_remembered_are_bounded():
    grants = cors.RuntimeGrants()
    for i in range(cors.MAX_ORIGINS + 10):
        grants.learn(f"http://page{i}", {"Access-Control-Allow-Origin": f"http://page{i}"})
    assert grants.recall("http://page0") == {}  # the oldest forgotten: the Origin header is the client's to choose
    last = f"http://page{cors.MAX_ORIGINS + 9}"
    assert grants.recall(last) == {"Access-Control-Allow-Origin": last}
