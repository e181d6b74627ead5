"""Stored responses and conversations kept across a restart (``server.responses_file``): a
server stopped and a new one started on the same file continue, read, list and stream
again what the first one stored, for the key that stored it. Driven by the official
``openai`` client in front of the Ollama double."""

from __future__ import annotations

import json
import logging
import os
import stat

import openai
import pytest

from kvstream.api.app import create_app
from kvstream.api.conversation_store import ConversationStore
from kvstream.api.response_store import ResponseStore
from kvstream.api.responses_file import load, save
from kvstream.backends import OllamaBackend
from kvstream.config import Settings
from kvstream.engine import KVStreamEngine
from tests.doubles import Script, ollama_double


@pytest.fixture
def start_server(aiohttp_server):
    """start_server(upstream_url, **server_settings) -> the test server (closed by the test
    to stop it, as a restart does)."""

    async def start(url: str, **server):
        backend = OllamaBackend(url)
        backend.settings = Settings(**(backend.settings.model_dump() | {"server": backend.settings.server.model_dump() | server}))
        return await aiohttp_server(create_app(backend.settings, KVStreamEngine(backend, backend.settings)))

    return start


def _client(server, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)


async def test_a_restart_keeps_responses_and_conversations(start_upstream, start_server, tmp_path):
    url, recorder = await start_upstream(Script(tokens=["Hel", "lo", "!"]), factory=ollama_double)
    kept = tmp_path / "state" / "responses.json"
    first_server = await start_server(url, responses_file=kept)
    async with _client(first_server) as client:
        first = await client.responses.create(model="llama3.2", input="Hi")
        second = await client.responses.create(model="llama3.2", input="More", previous_response_id=first.id)
        stream = await client.responses.create(model="llama3.2", input="Stream it", background=True, stream=True)
        events = [event async for event in stream]
        conversation = await client.conversations.create(metadata={"topic": "greetings"})
        await client.responses.create(model="llama3.2", input="Hello there", conversation=conversation.id)
    await first_server.close()
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o600

    server = await start_server(url, responses_file=kept)
    async with _client(server) as client:
        assert (await client.responses.retrieve(second.id)).model_dump() == second.model_dump()
        third = await client.responses.create(model="llama3.2", input="Last", previous_response_id=second.id)
        assert recorder.bodies[-1]["messages"] == [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "More"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Last"}]
        items = [item async for item in client.responses.input_items.list(third.id, order="asc")]
        assert items[1].id == first.output[0].id
        again = [event async for event in await client.responses.retrieve(events[0].response.id, stream=True)]
        assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
        assert (await client.conversations.retrieve(conversation.id)).metadata == {"topic": "greetings"}
        listed = [item async for item in client.conversations.items.list(conversation.id, order="asc")]
        assert [item.content[0].text for item in listed] == ["Hello there", "Hello!"]
    await server.close()
    # The second stop wrote the third response too.
    responses, conversations = ResponseStore(10, 1 << 20), ConversationStore(10, 1 << 20)
    load(kept, responses, conversations)
    assert {stored.response["id"] for stored in responses.values()} >= {first.id, second.id, third.id}
    assert len(conversations) == 1


async def test_each_key_still_finds_only_its_own(start_upstream, start_server, tmp_path):
    url, _ = await start_upstream(Script(tokens=["Hi"]), factory=ollama_double)
    kept = tmp_path / "responses.json"
    server = await start_server(url, responses_file=kept, api_keys=["sk-a", "sk-b"])
    async with _client(server, "sk-a") as a:
        mine = await a.responses.create(model="llama3.2", input="secret")
    await server.close()
    server = await start_server(url, responses_file=kept, api_keys=["sk-a", "sk-b"])
    async with _client(server, "sk-a") as a, _client(server, "sk-b") as b:
        assert (await a.responses.retrieve(mine.id)).id == mine.id
        with pytest.raises(openai.NotFoundError):
            await b.responses.retrieve(mine.id)
    await server.close()


async def test_an_unreadable_file_is_set_aside_and_the_server_starts_empty(start_upstream, start_server, tmp_path, caplog):
    url, _ = await start_upstream(Script(tokens=["Hi"]), factory=ollama_double)
    kept = tmp_path / "responses.json"
    for damaged in (b"{not json", b'{"version": 99}', b'{"version": 1, "items": [], "responses": [{"response": 5}]}'):
        kept.write_bytes(damaged)
        with caplog.at_level(logging.WARNING, logger="kvstream.api.responses_file"):
            server = await start_server(url, responses_file=kept)
        assert "set aside" in caplog.text
        assert (tmp_path / "responses.json.unreadable").read_bytes() == damaged
        async with _client(server) as client:
            reply = await client.responses.create(model="llama3.2", input="Hi")
        await server.close()
        responses, conversations = ResponseStore(10, 1 << 20), ConversationStore(10, 1 << 20)
        load(kept, responses, conversations)
        assert [stored.response["id"] for stored in responses.values()] == [reply.id]
        caplog.clear()


def test_shared_items_are_written_once_and_shared_again_when_read(tmp_path):
    """A conversation continued three times holds each earlier item once in the file, and
    read back, the continuations share the same item objects again."""
    responses, conversations = ResponseStore(10, 1 << 20), ConversationStore(10, 1 << 20)
    context: tuple = ()
    for n in range(3):
        own = ({"id": f"msg_in{n}", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 100}]},)
        response = {"id": f"resp_{n}", "output": [{"id": f"msg_out{n}", "type": "message", "content": [{"text": "y"}]}]}
        responses.put(None, response, context, own)
        context = responses.get(None, f"resp_{n}").conversation()
    conversations.create(None, {}, list(context))
    kept = tmp_path / "responses.json"
    save(kept, responses, conversations)
    assert len(json.loads(kept.read_bytes())["items"]) == 6  # 3 inputs, 3 outputs: each once

    responses, conversations = ResponseStore(10, 1 << 20), ConversationStore(10, 1 << 20)
    load(kept, responses, conversations)
    last, before = responses.get(None, "resp_2"), responses.get(None, "resp_1")
    assert last.context == before.conversation()
    assert all(a is b for a, b in zip(last.context, before.conversation(), strict=True))
    assert all(a is b for a, b in zip(conversations.values()[0].items, last.conversation(), strict=True))


def test_an_unwritable_file_is_logged_not_raised(tmp_path, caplog):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a directory should be")
    with caplog.at_level(logging.ERROR, logger="kvstream.api.responses_file"):
        save(blocked / "responses.json", ResponseStore(1, 1024), ConversationStore(1, 1024))
    assert "could not write" in caplog.text


async def test_a_running_server_writes_what_changed_every_interval(start_upstream, start_server, tmp_path, monkeypatch, caplog):
    """``server.responses_save_interval_s``: while the server runs, the file follows the
    stores (what a killed process would leave), written only after a change; a write that
    fails is logged and the server goes on."""
    import asyncio

    from kvstream.api import responses_file

    writes = []
    replace = responses_file._replace
    monkeypatch.setattr(responses_file, "_replace", lambda path, data: (writes.append(path), replace(path, data)))

    def stored_ids() -> set[str]:
        responses, conversations = ResponseStore(10, 1 << 20), ConversationStore(10, 1 << 20)
        load(kept, responses, conversations)
        return {stored.response["id"] for stored in responses.values()}

    async def until(condition) -> None:
        for _ in range(100):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the file did not follow the stores")

    url, _ = await start_upstream(Script(tokens=["Hi"]), factory=ollama_double)
    kept = tmp_path / "responses.json"
    server = await start_server(url, responses_file=kept, responses_save_interval_s=0.05)
    async with _client(server) as client:
        await asyncio.sleep(0.2)
        assert writes == []  # nothing changed: nothing written
        first = await client.responses.create(model="llama3.2", input="Hi")
        await until(lambda: kept.exists() and stored_ids() == {first.id})
        assert stat.S_IMODE(os.stat(kept).st_mode) == 0o600
        count = len(writes)
        await asyncio.sleep(0.3)
        assert len(writes) == count  # unchanged since: not written again
        await client.responses.retrieve(first.id)  # reading changes nothing either
        await asyncio.sleep(0.2)
        assert len(writes) == count
        second = await client.responses.create(model="llama3.2", input="Again")
        await until(lambda: stored_ids() == {first.id, second.id})
        await client.responses.delete(first.id)
        await until(lambda: stored_ids() == {second.id})
        conversation = await client.conversations.create(items=[{"type": "message", "role": "user", "content": "kept"}])
        await until(lambda: len(json.loads(kept.read_bytes())["conversations"]) == 1)

        # The file's folder replaced by a file: every write fails; the server answers on.
        kept.unlink()
        blocked = tmp_path / "blocked"
        blocked.write_text("a file where a directory should be")
        monkeypatch.setattr(responses_file, "_replace", lambda path, data: replace(blocked / "responses.json", data))
        with caplog.at_level(logging.ERROR, logger="kvstream.api.responses_file"):
            third = await client.responses.create(model="llama3.2", input="Still answered")
            await until(lambda: "could not write" in caplog.text)
        assert third.status == "completed"
        assert (await client.conversations.retrieve(conversation.id)).id == conversation.id
    monkeypatch.setattr(responses_file, "_replace", replace)
    await server.close()  # the stop writes the last state
    assert stored_ids() == {second.id, third.id}


async def test_background_responses_a_killed_server_ran_read_back_failed(start_upstream, start_server, tmp_path):
    """The periodic writes hold the background responses running as they stand: the file a
    killed process leaves (copied while they run) gives each, after a restart, ``failed``
    with the output it had written and why; a streamed one streams again to a
    ``response.failed`` event, which the official client reads as the stream's end. (In
    front of Ollama one generation runs at a time: the second waits ``queued``.)"""
    import asyncio
    import shutil

    from kvstream.api.responses_file import INTERRUPTED

    url, _ = await start_upstream(Script(tokens=["Once", " upon", " a", " time"] * 50, delay_s=0.05), factory=ollama_double)
    kept, left = tmp_path / "responses.json", tmp_path / "left-by-a-kill.json"
    server = await start_server(url, responses_file=kept, responses_save_interval_s=0.05)

    def running_entries() -> dict[str, dict]:
        if not kept.exists():
            return {}
        return {e["response"]["id"]: e for e in json.loads(kept.read_bytes())["responses"]
                if e["response"]["status"] in ("queued", "in_progress")}

    async with _client(server) as client:
        stream = await client.responses.create(model="llama3.2", input="Go on, streamed", background=True, stream=True)
        seen = []
        async for event in stream:
            seen.append(event)
            if len(seen) == 8:
                break
        await stream.close()  # the client leaves; the run goes on
        streamed = seen[0].response.id
        queued = await client.responses.create(model="llama3.2", input="Go on", background=True)
        for _ in range(200):  # until a write holds both, the first with some output
            entries = running_entries()
            if queued.id in entries and streamed in entries and len(entries[streamed]["events"]) >= 8:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the periodic writes did not hold the running responses")
        shutil.copy(kept, left)  # what a kill at this moment leaves
    await server.close()  # (a graceful stop: the runs are cancelled, and written so; the copy is the kill's)
    assert {e["response"]["status"] for e in json.loads(kept.read_bytes())["responses"]} == {"cancelled"}

    server = await start_server(url, responses_file=left)
    async with _client(server) as client:
        for response_id in (streamed, queued.id):
            failed = await client.responses.retrieve(response_id)
            assert failed.status == "failed" and failed.background is True
            assert failed.error.code == "server_error" and failed.error.message == INTERRUPTED
        assert (await client.responses.retrieve(streamed)).output_text.startswith("Once upon")  # what it had written
        assert (await client.responses.retrieve(queued.id)).output == []
        again = [event async for event in await client.responses.retrieve(streamed, stream=True)]
        assert [e.model_dump() for e in again[:8]] == [e.model_dump() for e in seen]
        assert again[-1].type == "response.failed" and again[-1].response.status == "failed"
        assert [e.sequence_number for e in again] == list(range(len(again)))
        with pytest.raises(openai.BadRequestError, match="status is 'failed'"):
            await client.responses.cancel(queued.id)
        # A failed response can still be continued, as any stored one.
        onward = await client.responses.create(model="llama3.2", input="Again", previous_response_id=streamed)
        assert onward.status == "completed"
    await server.close()
