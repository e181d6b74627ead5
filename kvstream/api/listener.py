"""The listening socket's guard: at most ``server.max_connections`` client connections are
handed to aiohttp; past the cap a new connection gets one canned 503 and is closed.

The cap stays below the open-file limit (raised to its hard maximum first): past that
limit ``accept()`` fails, asyncio logs a traceback for every attempt, and clients that hold
a key are locked out by sockets that never sent a byte.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time

from aiohttp import web

logger = logging.getLogger(__name__)

# File descriptors kept free for what is not a client connection: upstream connections
# (one per request in flight), slot files, logs, the listening socket.
FD_RESERVE = 256
DEFAULT_MAX_CONNECTIONS = 4096
# A connection over the cap gets this and is closed; it never reaches aiohttp.
_REFUSAL_BODY = (
    b'{"error":{"message":"Too many open connections to KVStream; retry shortly.",'
    b'"type":"server_error","param":null,"code":"too_many_connections"}}'
)
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_REFUSAL_BODY)).encode() + b"\r\n\r\n" + _REFUSAL_BODY
)


def connection_cap(configured: int | None) -> int:
    """The most client connections to hold open: the configured cap, else 4096, never more
    than the open-file limit leaves room for (raised to its hard maximum first: past it,
    accept() fails and asyncio logs every attempt)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 65536 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # not allowed here: the cap follows the soft limit
            logger.debug("could not raise the open-file limit to %d (%s)", target, exc)
    room = soft - FD_RESERVE if soft >= 4 * FD_RESERVE else soft * 3 // 4
    return min(configured or DEFAULT_MAX_CONNECTIONS, room)


class _Refuse(asyncio.Protocol):
    """A connection over the cap: one 503, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(_REFUSAL)  # type: ignore[attr-defined]
        transport.close()


class CappedFactory:
    """The protocol factory of the listening socket: aiohttp's handler while fewer than
    ``cap`` connections are open, a refusal past it (logged at most every 10 s, never per
    connection: a flood must not become a log flood)."""

    def __init__(self, server: web.Server, cap: int) -> None:
        self.server = server
        self.cap = cap
        self.refused = 0
        self._logged_at = 0.0

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) < self.cap:
            return self.server()
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= 10.0:
            self._logged_at = now
            logger.warning("%d open connections (the cap): refusing new ones with 503 (%d so far)", self.cap, self.refused)
        return _Refuse()
