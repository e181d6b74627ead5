"""Background responses (``background: true``) where KVStream answers the Responses API
itself, here in front of Ollama's native API: they run on without their request, are read
while they run, streamed again from any event after a dropped connection, cancelled, and
keep their API key's place among its generations in flight. Driven by the official
``openai`` client, as an app polls one."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from kvstream.api.app import create_app
from kvstream.backends import OllamaBackend
from kvstream.engine import KVStreamEngine
from tests.conftest import assert_cancelled_and_released, wait_released
from tests.doubles import Script, ollama_double

TOKENS = ["Once", " upon", " a", " time", "."]


async def _proxy(start_upstream, start_proxy, script: Script, **sections):
    url, recorder = await start_upstream(script, factory=ollama_double)
    return await start_proxy(OllamaBackend(url), **sections), recorder


async def _until(client: openai.AsyncOpenAI, response_id: str, *statuses: str, timeout_s: float = 10.0):
    """Poll ``response_id`` as an app does until its status is one of ``statuses``."""
    seen = []
    for _ in range(int(timeout_s / 0.02)):
        response = await client.responses.retrieve(response_id)
        seen.append(response)
        if response.status in statuses:
            return response, seen
        await asyncio.sleep(0.02)
    raise AssertionError(f"still {seen[-1].status} after {timeout_s}s")


async def test_a_background_response_runs_on_and_is_polled_to_its_end(start_upstream, start_proxy, http):
    proxy, recorder = await _proxy(start_upstream, start_proxy, Script(tokens=TOKENS, delay_s=0.15))
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        created = await client.responses.create(model="llama3.2", input="Tell a story", background=True)
        assert (created.status, created.background, created.output) == ("queued", True, [])
        async with http.get(proxy.url + "/status") as resp:
            assert (await resp.json())["responses"]["running"] == 1
        async with http.get(proxy.url + "/metrics") as resp:
            assert "\nkvstream_responses_running 1.0\n" in await resp.text()
        done, seen = await _until(client, created.id, "completed")
        # While it ran, a poll showed it in progress with the text written so far.
        partial = [r.output_text for r in seen if r.status == "in_progress" and r.output]
        assert partial and all("Once upon a time.".startswith(text) for text in partial)
        assert (done.id, done.output_text, done.background, done.usage.output_tokens) == (
            created.id, "Once upon a time.", True, len(TOKENS))
        assert recorder.completed == 1
        assert (await client.responses.retrieve(created.id)).model_dump() == done.model_dump()
        # It continues like any stored response.
        await client.responses.create(model="llama3.2", input="And then?", previous_response_id=created.id)
        assert recorder.bodies[-1]["messages"][:2] == [{"role": "user", "content": "Tell a story"},
                                                      {"role": "assistant", "content": "Once upon a time."}]
    async with http.get(proxy.url + "/status") as resp:
        assert (await resp.json())["responses"]["running"] == 0
    async with http.get(proxy.url + "/metrics") as resp:
        scraped = await resp.text()
    assert "\nkvstream_responses_running 0.0\n" in scraped and "\nkvstream_responses_stored 2.0\n" in scraped
    await wait_released(proxy)


async def test_a_dropped_background_stream_is_resumed_from_the_last_event_seen(start_upstream, start_proxy):
    proxy, _ = await _proxy(start_upstream, start_proxy, Script(tokens=TOKENS, delay_s=0.15))
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        stream = await client.responses.create(model="llama3.2", input="Tell a story", background=True, stream=True)
        first = []
        async for event in stream:
            first.append(event)
            if event.type == "response.output_text.delta":
                break  # the connection drops after the first piece of text
        await stream.close()
        assert [e.type for e in first[:2]] == ["response.created", "response.queued"]
        assert first[0].response.status == "queued" and first[0].response.background is True
        response_id, last = first[0].response.id, first[-1].sequence_number
        rest = [event async for event in await client.responses.retrieve(response_id, stream=True, starting_after=last)]
        events = first + rest
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == "response.completed" and events[-1].response.output_text == "Once upon a time."
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Once upon a time."
        # Once ended, the whole stream can be read again from any point, and the response too.
        again = [event async for event in await client.responses.retrieve(response_id, stream=True, starting_after=2)]
        assert [e.model_dump() for e in again] == [e.model_dump() for e in events[3:]]
        assert (await client.responses.retrieve(response_id)).output_text == "Once upon a time."
    await wait_released(proxy)


async def test_a_background_response_is_cancelled_while_it_runs(start_upstream, start_proxy):
    proxy, recorder = await _proxy(start_upstream, start_proxy, Script(tokens=TOKENS * 40, delay_s=0.05))
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        conversation = await client.conversations.create()
        created = await client.responses.create(model="llama3.2", input="Go on", background=True,
                                                conversation=conversation.id)
        await _until(client, created.id, "in_progress")
        with pytest.raises(openai.BadRequestError, match="still in progress"):
            await client.responses.create(model="llama3.2", input="x", previous_response_id=created.id)
        cancelled = await client.responses.cancel(created.id)
        assert (cancelled.id, cancelled.status) == (created.id, "cancelled")
        await assert_cancelled_and_released(proxy, recorder)
        assert (await client.responses.cancel(created.id)).status == "cancelled"  # again: the same answer
        assert (await client.responses.retrieve(created.id)).status == "cancelled"
        # A cancelled turn is not part of the conversation.
        assert [item async for item in client.conversations.items.list(conversation.id)] == []


async def test_background_requests_the_route_cannot_take_are_400s(start_upstream, start_proxy):
    url, _ = await start_upstream(Script(tokens=["Hi"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="store") as error:
            await client.responses.create(model="llama3.2", input="x", background=True, store=False)
        assert error.value.body["param"] == "background"
        with pytest.raises(openai.BadRequestError, match="boolean"):
            await client.responses.create(model="llama3.2", input="x", extra_body={"background": "yes"})
        foreground = await client.responses.create(model="llama3.2", input="x")
        with pytest.raises(openai.BadRequestError, match="background: true"):
            await client.responses.cancel(foreground.id)
        quiet = await client.responses.create(model="llama3.2", input="x", background=True)
        done, _ = await _until(client, quiet.id, "completed")
        with pytest.raises(openai.BadRequestError, match="'completed'"):
            await client.responses.cancel(quiet.id)
        for response_id in (foreground.id, quiet.id):  # neither was created streamed
            with pytest.raises(openai.BadRequestError, match="stream"):
                await client.responses.retrieve(response_id, stream=True)
        with pytest.raises(openai.NotFoundError):
            await client.responses.cancel("resp_unknown")
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{proxy.v1}/responses/{quiet.id}?stream=true&starting_after=-3") as resp:
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "starting_after"
    server = await start_proxy(OllamaBackend(url), server={"responses_max_stored": 0})
    async with openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="storing is off"):
            await client.responses.create(model="llama3.2", input="x", background=True)
    await wait_released(proxy)


async def test_a_background_run_keeps_its_keys_place_until_it_ends(start_upstream, start_proxy):
    """With one generation a key, a key's background run holds it: the same key's next
    request is a 429 until the run is cancelled; another key cannot touch the run."""
    proxy, _ = await _proxy(start_upstream, start_proxy, Script(tokens=TOKENS * 40, delay_s=0.05),
                            server={"api_keys": ["sk-a", "sk-b"], "max_concurrent_per_key": 1})
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="sk-a", max_retries=0) as a, \
            openai.AsyncOpenAI(base_url=proxy.v1, api_key="sk-b", max_retries=0) as b:
        running = await a.responses.create(model="llama3.2", input="Go on", background=True)
        with pytest.raises(openai.RateLimitError):
            await a.responses.create(model="llama3.2", input="x", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):  # nor can another key read or cancel it
            await b.responses.cancel(running.id)
        assert (await a.responses.cancel(running.id)).status == "cancelled"
        await _first_event(a)  # served again once its run has ended
        await _first_event(b)
    await wait_released(proxy)


async def _first_event(client: openai.AsyncOpenAI) -> None:
    stream = await client.responses.create(model="llama3.2", input="x", stream=True)
    assert (await anext(aiter(stream))).type == "response.created"
    await stream.close()


async def test_deleting_a_running_response_cancels_it(start_upstream, start_proxy):
    proxy, recorder = await _proxy(start_upstream, start_proxy, Script(tokens=TOKENS * 40, delay_s=0.05))
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        stream = await client.responses.create(model="llama3.2", input="Go on", background=True, stream=True)
        response_id = (await anext(aiter(stream))).response.id
        await stream.close()  # the client left: the run goes on
        await _until(client, response_id, "in_progress")
        await client.responses.delete(response_id)
        await assert_cancelled_and_released(proxy, recorder)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response_id)


async def test_shutting_down_cancels_what_runs(start_upstream, aiohttp_server):
    url, recorder = await start_upstream(Script(tokens=TOKENS * 40, delay_s=0.05), factory=ollama_double)
    backend = OllamaBackend(url)
    engine = KVStreamEngine(backend, backend.settings)
    server = await aiohttp_server(create_app(backend.settings, engine))
    async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused", max_retries=0) as client:
        created = await client.responses.create(model="llama3.2", input="Go on", background=True)
        await _until(client, created.id, "in_progress")
    await server.close()  # the app's cleanup: runs cancelled before the engine closes
    for _ in range(200):
        if recorder.cancelled:
            break
        await asyncio.sleep(0.02)
    assert (recorder.cancelled, recorder.completed) == (1, 0) and not engine._generations


@pytest.mark.parametrize("script", [Script(status=500), Script(tokens=["Hel", "lo"], error_after=1)],
                         ids=["an error status", "an error mid-stream"])
async def test_a_background_response_the_runtime_failed_reads_failed(start_upstream, start_proxy, script):
    """Polled: ``failed`` with its error, stored, and not added to its conversation; streamed
    again: the events end with ``response.failed``."""
    proxy, _ = await _proxy(start_upstream, start_proxy, script)
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        conversation = await client.conversations.create()
        created = await client.responses.create(model="llama3.2", input="Hi", background=True, stream=True,
                                                conversation=conversation.id)
        events = [event async for event in created]
        assert events[-1].type == "response.failed"
        response_id = events[0].response.id
        failed = await client.responses.retrieve(response_id)
        assert failed.status == "failed" and failed.error.code == "server_error" and failed.error.message
        assert [e.model_dump() for e in await _all(client, response_id)] == [e.model_dump() for e in events]
        assert [item async for item in client.conversations.items.list(conversation.id)] == []
    await wait_released(proxy)


async def _all(client: openai.AsyncOpenAI, response_id: str) -> list:
    return [event async for event in await client.responses.retrieve(response_id, stream=True)]
