"""llama-server's resumable streams, for the routes KVStream answers itself (a backend it
translates for, such as the in-process engine): a streamed chat or completion sent with an
``X-Conversation-Id`` header is recorded under that id while it runs, and goes on to its end
even if its client leaves. ``GET /v1/stream?conv_id=...&from=N`` streams the recording from
byte N (0: from the start), following it live while it runs; ``DELETE`` stops the
generation and forgets the recording (routes_llamacpp.py). In front of a runtime, the header
and the routes are the runtime's own (passed through).

A recording belongs to the API key that made it (another key's id is not found), keeps the
key's place among the generations in flight while it runs, and is kept ``KEEP_ENDED_S`` after
it ended; at most ``MAX_SESSIONS`` are held, the oldest ended ones forgotten first. A new
stream under an id still running stops the old one. Closing the registry (the server's
shutdown) stops every recording.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from aiohttp import web

from kvstream.api.errors import APIError
from kvstream.api.state import KeyInFlight
from kvstream.api.streaming import GuardedResponse

logger = logging.getLogger(__name__)

CONVERSATION_HEADER = "X-Conversation-Id"
MAX_SESSIONS = 64
KEEP_ENDED_S = 600.0


class StreamSession:
    """One recorded stream: the bytes written so far, written as a response is (``prepare``,
    ``write``, ``write_eof``), and followed from any offset."""

    def __init__(self, owner: str | None, session_id: str) -> None:
        self.owner, self.id = owner, session_id
        self.data = bytearray()
        self.ended_at: float | None = None
        self.task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    async def prepare(self, request: web.BaseRequest) -> None:
        """(A response's first step; a recording has no headers to send.)"""

    async def write(self, data: bytes) -> None:
        self.data += data
        self._wake()

    async def write_eof(self, data: bytes = b"") -> None:
        self.data += data
        self.end()

    def end(self) -> None:
        if self.ended_at is None:
            self.ended_at = time.monotonic()
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, offset: int) -> AsyncIterator[bytes]:
        """The bytes from ``offset`` on, as they are written, until the stream ends."""
        while True:
            changed = self._changed
            if offset < len(self.data):
                chunk = bytes(self.data[offset:])
                offset += len(chunk)
                yield chunk
            elif self.ended_at is not None:
                return
            else:
                await changed.wait()


class StreamSessions:
    """The recordings held, by (API key, conversation id)."""

    def __init__(self) -> None:
        self._sessions: dict[tuple[str | None, str], StreamSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, owner: str | None, session_id: str) -> StreamSession | None:
        return self._sessions.get((owner, session_id))

    def open(self, owner: str | None, session_id: str) -> StreamSession:
        """A new recording of ``session_id`` (an earlier one under that id is stopped);
        APIError 429 when every place is taken by a recording still running."""
        old = self._sessions.pop((owner, session_id), None)
        if old is not None and old.task is not None:
            old.task.cancel()
        self._make_room()
        session = self._sessions[(owner, session_id)] = StreamSession(owner, session_id)
        return session

    def run(self, session: StreamSession, record: Coroutine[Any, Any, None], held: KeyInFlight | None) -> None:
        """Write ``session`` by ``record``, in a task of its own; ``held``, the requester's
        key's count of generations in flight, counts it until it ends."""
        if held is not None:
            held.keep()
        session.task = asyncio.get_running_loop().create_task(record, name=f"stream session {session.id}")

        def ended(task: asyncio.Task[None]) -> None:
            session.end()
            if held is not None:
                held.give()
            if not task.cancelled() and task.exception() is not None:
                logger.error("stream session %s ended badly", session.id, exc_info=task.exception())

        session.task.add_done_callback(ended)

    def _make_room(self) -> None:
        now = time.monotonic()
        for key, session in list(self._sessions.items()):
            if session.ended_at is not None and now - session.ended_at > KEEP_ENDED_S:
                del self._sessions[key]
        ended = sorted((key for key, s in self._sessions.items() if s.ended_at is not None),
                       key=lambda key: self._sessions[key].ended_at or 0.0)
        while len(self._sessions) >= MAX_SESSIONS and ended:
            del self._sessions[ended.pop(0)]
        if len(self._sessions) >= MAX_SESSIONS:
            raise APIError(429, f"Too many resumable streams running ({MAX_SESSIONS}); send it without "
                                f"{CONVERSATION_HEADER}, or later.", code="too_many_stream_sessions")

    async def stop(self, owner: str | None, session_id: str) -> bool:
        """Stop ``session_id``'s generation if it runs and forget its recording; whether
        there was one."""
        session = self._sessions.pop((owner, session_id), None)
        if session is None:
            return False
        if session.task is not None:
            session.task.cancel()
            await asyncio.gather(session.task, return_exceptions=True)
        return True

    async def close(self) -> None:
        """Stop every recording (the server is stopping)."""
        tasks = [s.task for s in self._sessions.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sessions.clear()


async def answer_following(request: web.Request, session: StreamSession, offset: int,
                           headers: dict[str, str]) -> web.StreamResponse:
    """Stream ``session`` to the client from byte ``offset``, live until it ends; the client
    leaving ends only this answer, never the recording."""
    out = GuardedResponse(headers=headers | {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                             "X-Accel-Buffering": "no"})
    await out.prepare(request)
    try:
        async for chunk in session.follow(offset):
            await out.write(chunk)
        await out.write_eof()
    except ConnectionError:
        pass  # the client left; the recording goes on
    return out


STREAM_SESSIONS = web.AppKey("stream_sessions", StreamSessions)
