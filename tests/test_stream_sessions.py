"""The registry of resumable streams (llama-server's ``X-Conversation-Id``): what it keeps,
what it forgets first, and what it refuses. Streams through the server:
tests/hf/test_llamacpp_native.py."""

from __future__ import annotations

import asyncio

import pytest

from kvstream.api import stream_sessions
from kvstream.api.errors import APIError
from kvstream.api.state import KeyInFlight
from kvstream.api.stream_sessions import StreamSessions


async def test_recordings_are_per_key_replaced_by_id_and_the_oldest_ended_go_first(monkeypatch):
    monkeypatch.setattr(stream_sessions, "MAX_SESSIONS", 3)
    sessions = StreamSessions()
    held = KeyInFlight(limit=None)
    release = asyncio.Event()

    async def record(session, text: bytes) -> None:
        await session.write(text)
        await release.wait()
        await session.write_eof(b"!")

    first = sessions.open(None, "a")
    sessions.run(first, record(first, b"one"), held)
    other_key = sessions.open("key-2", "a")  # the same id under another key: another stream
    sessions.run(other_key, record(other_key, b"two"), held)
    await asyncio.sleep(0)
    assert held.count == 2 and sessions.get(None, "a") is first and sessions.get("key-2", "a") is other_key
    assert sessions.get("key-3", "a") is None

    replaced = sessions.open(None, "a")  # a new stream under a running id stops the old one
    sessions.run(replaced, record(replaced, b"three"), held)
    await asyncio.gather(first.task, return_exceptions=True)
    await asyncio.sleep(0)  # its done callback
    assert first.task.cancelled() and first.ended_at is not None and sessions.get(None, "a") is replaced
    third = sessions.open(None, "b")
    sessions.run(third, record(third, b"four"), held)
    with pytest.raises(APIError) as err:  # three running: no room
        sessions.open(None, "c")
    assert err.value.status == 429

    release.set()
    await asyncio.gather(replaced.task, other_key.task, third.task)
    assert held.count == 0 and bytes(replaced.data) == b"three!"
    assert [chunk async for chunk in replaced.follow(2)] == [b"ree!"]
    ended = sorted([replaced, other_key, third], key=lambda session: session.ended_at)
    fourth = sessions.open(None, "c")  # the oldest ended recording made room
    assert len(sessions) == 3 and fourth is sessions.get(None, "c")
    assert sessions.get(ended[0].owner, ended[0].id) is None
    assert all(sessions.get(s.owner, s.id) is s for s in ended[1:])
    assert await sessions.stop(None, "c") and not await sessions.stop(None, "c")
    await sessions.close()
    assert len(sessions) == 0
