"""Running the app: bind, serve until SIGINT/SIGTERM, then shut down gracefully (stop
accepting, give running requests ``server.shutdown_grace_s`` to finish, cancel the rest)."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import signal

from aiohttp import web

from kvstream.api.app import create_app
from kvstream.api.listener import CappedFactory, connection_cap
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
