"""OpenAI's Responses API and Anthropic's Messages API in front of remote runtimes:
translated for Ollama's native API (as the chat route is) and served through the engine;
passed through to a runtime that speaks OpenAI itself, its own answer (or its own 404)
coming back. The in-process engine's side is tests/hf/test_responses.py and
tests/hf/test_messages.py."""

from __future__ import annotations

import openai
import pytest

from kvstream.backends import OllamaBackend, OpenAICompatibleBackend
from tests.conftest import wait_released
from tests.doubles import Script, ollama_double


async def test_in_front_of_ollama_it_is_translated_and_served_by_the_engine(start_upstream, start_proxy):
    """(``llama3.2`` is ``llama3.2:latest``, as Ollama itself takes it.)"""
    url, recorder = await start_upstream(Script(tokens=["Hel", "lo", "!"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        reply = await client.responses.create(model="llama3.2", instructions="Be brief.", input="Hi", max_output_tokens=8)
        assert reply.output_text == "Hello!" and reply.status == "completed" and reply.usage.output_tokens == 3
        body = recorder.bodies[-1]
        assert body["model"] == "llama3.2:latest"
        assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert body["options"]["num_predict"] == 8
        stream = await client.responses.create(model="llama3.2", input="Hi", stream=True)
        deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
        assert "".join(deltas) == "Hello!"
    await wait_released(proxy)
    assert proxy.engine.stats.requests_finished == 2


async def test_in_front_of_an_openai_runtime_it_is_the_runtimes_own(start_upstream, start_proxy):
    """The double serves no /v1/responses: its own 404 reaches the client (not KVStream's)."""
    url, _ = await start_upstream(Script())
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="m", input="Hi")


async def test_anthropics_messages_in_front_of_ollama_are_translated(start_upstream, start_proxy):
    anthropic = pytest.importorskip("anthropic")
    url, recorder = await start_upstream(Script(tokens=["Hel", "lo", "!"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0) as client:
        message = await client.messages.create(model="llama3.2", system="Be brief.", max_tokens=8,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert message.content[0].text == "Hello!" and message.stop_reason == "end_turn"
        assert message.usage.output_tokens == 3
        body = recorder.bodies[-1]
        assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        async with client.messages.stream(model="llama3.2", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]) as stream:
            assert "".join([piece async for piece in stream.text_stream]) == "Hello!"
        with pytest.raises(anthropic.NotFoundError) as err:  # Ollama's 404 for a model it lacks, in Anthropic's shape
            await client.messages.create(model="nope", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
        assert err.value.body["error"]["type"] == "not_found_error"
    await wait_released(proxy)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
async def test_in_front_of_ollama_too_many_messages_are_refused_before_each_is_read(start_upstream, start_proxy, http, path):
    """The chat KVStream validates, Anthropic's messages and the Responses API's input items
    it translates: past ``server.max_messages`` the 413 comes on their count, before each is
    read (a bad one among them is not the 400), and nothing reaches the runtime."""
    url, recorder = await start_upstream(Script(tokens=["Hi"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url), server={"max_messages": 4})
    field = "input" if path == "/v1/responses" else "messages"
    turns = [{"role": "user", "content": "x"}] * 4 + [{"role": "nobody", "content": 7}]
    body = {"model": "llama3.2", "max_tokens": 8, field: turns}
    async with http.post(proxy.url + path, json=body) as resp:
        assert resp.status == 413, await resp.text()
        answer = await resp.json()
    assert answer["error"]["type"] == ("request_too_large" if path == "/v1/messages" else "invalid_request_error")
    assert "Too many messages (5; the limit is 4)" in answer["error"]["message"]
    if path != "/v1/messages":  # (Anthropic's error names no field)
        assert answer["error"]["param"] == field
    async with http.post(proxy.url + path, json=body | {field: turns[-4:]}) as resp:
        assert resp.status == 400, await resp.text()  # within the limit the bad one is what is judged
    assert not recorder.bodies


async def test_cache_marks_do_not_reach_ollama_which_keeps_its_own_cache(start_upstream, start_proxy):
    """``cache_control`` (Anthropic's blocks and tools) and ``prompt_cache_retention`` are
    read and taken out: Ollama's body is the unmarked request's, nothing is retained in
    KVStream's model of a runtime's cache (the runtime evicts as it will)."""
    anthropic = pytest.importorskip("anthropic")
    url, recorder = await start_upstream(Script(tokens=["Hi"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    mark = {"cache_control": {"type": "ephemeral", "ttl": "1h"}}
    tool = {"name": "get_time", "input_schema": {"type": "object"}}
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0) as client:
        for marked in (True, False):
            extra = mark if marked else {}
            await client.messages.create(model="llama3.2", max_tokens=8, tools=[tool | extra],
                                         system=[{"type": "text", "text": "Be brief."} | extra],
                                         messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"} | extra]}])
        assert recorder.bodies[-2] == recorder.bodies[-1] and "cache_control" not in str(recorder.bodies[-1])
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
        await oa.chat.completions.create(model="llama3.2", messages=[{"role": "user", "content": "Hi"}],
                                         extra_body={"prompt_cache_retention": "24h"})
    await wait_released(proxy)
    assert proxy.engine.scheduler.bm.pool.num_retained == 0


async def test_the_anthropic_client_authenticates_with_its_own_header(start_upstream, start_proxy):
    """With API keys configured, the anthropic client's ``x-api-key`` is a key like a Bearer one;
    a wrong one is refused in Anthropic's error shape (the key is checked before the route
    runs, the shape is the route's)."""
    anthropic = pytest.importorskip("anthropic")
    url, _ = await start_upstream(Script(tokens=["Hi"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url), server={"api_keys": ["sk-kv-1"]})
    request = {"model": "llama3.2", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as err:
            await client.messages.create(**request)
        assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError) as err:  # the count route too, in the same shape
            await client.messages.count_tokens(model="llama3.2", messages=request["messages"])
        assert err.value.body["type"] == "error"
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="sk-kv-1", max_retries=0) as client:
        assert (await client.messages.create(**request)).content[0].text == "Hi"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_a_runtime_dying_mid_stream_ends_the_stream_with_an_error_event(start_upstream, start_proxy, http, path):
    """Ollama drops the connection after one token: the client's stream ends with the API's
    error event, and everything is released."""
    url, _ = await start_upstream(Script(tokens=["a", "b", "c"], die_after=1), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    body = {"model": "llama3.2", "stream": True, "max_tokens" if path == "/v1/messages" else "max_output_tokens": 8}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if path == "/v1/messages" else {"input": "Hi"}
    async with http.post(proxy.url + path, json=body) as resp:
        assert resp.status == 200
        events = [line for line in (await resp.text()).splitlines() if line.startswith("event:")]
    assert events[-1] == "event: error" and "event: response.completed" not in events and "event: message_stop" not in events
    await wait_released(proxy)


async def test_the_count_routes_in_front_of_ollama_say_whether_they_estimated(start_upstream, start_proxy, http):
    """Without the model's tokenizer (the double's /api/show carries none), a count is an
    estimate, and the X-KVStream-Tokens header says so."""
    url, _ = await start_upstream(Script(), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url, exact_tokens=False))
    async with http.post(proxy.url + "/v1/messages/count_tokens",
                         json={"model": "llama3.2", "messages": [{"role": "user", "content": "Hello there, friend"}]}) as resp:
        assert resp.status == 200 and resp.headers["X-KVStream-Tokens"] == "estimated"
        assert (await resp.json())["input_tokens"] > 0
    async with http.post(proxy.url + "/v1/responses/input_tokens", json={"model": "llama3.2", "input": "Hello"}) as resp:
        body = await resp.json()
        assert resp.status == 200 and body["object"] == "response.input_tokens" and body["input_tokens"] > 0
