"""Streamed answers that a client cannot hold open by not reading them.

A write waits for the socket to drain once aiohttp's buffer is full; a client that never
reads would park that write, and the request's batch slot and KV blocks with it, forever
(and ``backend.read_timeout_s`` never fires: the proxy has stopped reading upstream).
``GuardedResponse`` gives every write ``server.write_timeout_s``; past it the connection is
dropped and the write raises ``ConnectionResetError``, which the routes already treat as a
client that left: the request is cancelled and its slot freed.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from kvstream.api.errors import REQUEST_ID
from kvstream.api.state import STATE

logger = logging.getLogger(__name__)


class ClientStalled(ConnectionResetError):
    """The client read nothing of its answer for ``server.write_timeout_s``."""


class GuardedResponse(web.StreamResponse):
    """A StreamResponse whose every write must complete within the server's write timeout."""

    _timeout: float | None = None
    _request: web.Request | None = None

    async def prepare(self, request: web.BaseRequest):  # type: ignore[override]
        self._request = request  # type: ignore[assignment]
        self._timeout = request.app[STATE].settings.server.write_timeout_s
        return await self._guarded(super().prepare(request))

    async def write(self, data: bytes | bytearray | memoryview) -> None:  # type: ignore[override]
        await self._guarded(super().write(data))

    async def write_eof(self, data: bytes = b"") -> None:
        await self._guarded(super().write_eof(data))

    async def _guarded(self, write):  # type: ignore[no-untyped-def]
        if self._timeout is None:
            return await write
        try:
            async with asyncio.timeout(self._timeout):
                return await write
        except TimeoutError:
            request = self._request
            assert request is not None
            logger.warning(
                "[%s] the client read nothing for %gs: dropping its connection and cancelling the request",
                request.get(REQUEST_ID, "-"), self._timeout,
            )
            if request.transport is not None:
                request.transport.abort()  # the unread buffer is discarded with the socket
            raise ClientStalled(f"the client read nothing for {self._timeout:g}s") from None
