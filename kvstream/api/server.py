"""Running the app: bind, serve until SIGINT/SIGTERM, then shut down gracefully (stop
accepting, give running requests ``server.shutdown_grace_s`` to finish, cancel the rest)."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import resource
import signal
import time

from aiohttp import web

from kvstream.api.app import create_app
from kvstream.config import Settings
from kvstream.engine import KVStreamEngine

logger = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tune_gc() -> None:
    """Collect less often: each request allocates a few hundred short-lived objects, and by
    default CPython runs a young collection every 700 allocations and, now and then, a full
    one that rescans every object the imported libraries created. Freezing what startup made
    and raising the young threshold cut CPU per request by 10-20% at 128 concurrent requests
    (benchmarks/proxy_overhead.py). Reference cycles are still collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


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


def handler_options(settings: Settings) -> dict[str, object]:
    """How aiohttp must run KVStream's app (``serve`` and the tests use the same).

    handler_cancellation: a client that disconnects cancels its handler, and with it the
    upstream request and its KV blocks, streaming or not. keepalive_timeout: aiohttp arms it
    when a connection opens and after each answer, and new bytes do not extend it, so it
    also bounds how long a request head may take to arrive. auto_decompress off: a
    compressed body is inflated by the route that reads it, after auth and bounded by the
    body limit (``api/body.py``); aiohttp would inflate all of it in its parser first.
    """
    return {
        "handler_cancellation": True,
        "keepalive_timeout": settings.server.idle_timeout_s,
        "auto_decompress": False,
    }


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
        except (ValueError, OSError):
            pass
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


async def serve(settings: Settings, engine: KVStreamEngine, *, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set or the process gets SIGINT/SIGTERM."""
    server = settings.server
    if not is_loopback(server.host) and not settings.accepted_keys():
        logger.warning(
            "listening on %s without API keys: anyone who can reach this port can use the model "
            "and read /status and /metrics; set server.api_keys",
            server.host,
        )
    app = create_app(settings, engine)
    runner = web.AppRunner(app, shutdown_timeout=server.shutdown_grace_s, access_log=None, **handler_options(settings))
    await runner.setup()
    tune_gc()
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass  # not the main thread (tests) or not supported on this platform
    listener = None
    try:
        factory = CappedFactory(runner.server, connection_cap(server.max_connections))  # type: ignore[arg-type]
        listener = await loop.create_server(factory, server.host, server.port, reuse_address=True, backlog=1024)
        logger.info("KVStream listening on http://%s:%d/v1 (backend %s)", server.host, server.port, engine.backend.name)
        await stop.wait()
        logger.info("shutting down: no new requests, %ss for running ones", server.shutdown_grace_s)
    finally:
        if listener is not None:
            listener.close()  # stop accepting; open connections get the grace period
        await runner.cleanup()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError):
                pass
