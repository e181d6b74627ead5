"""``create_app``: the aiohttp application with its routes, middlewares and lifecycle."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from kvstream.api import routes_ops, routes_openai
from kvstream.api.errors import MAX_BODY_BYTES, REQUEST_ID, APIError, error_middleware
from kvstream.api.state import STATE, AppState
from kvstream.config import Settings
from kvstream.engine import KVStreamEngine
from kvstream.metrics import Metrics

logger = logging.getLogger(__name__)

# Reachable without a key, so that a load balancer can tell the process is alive.
PUBLIC_PATHS = frozenset({"/health"})


def auth_middleware(keys: list[str]):
    """Require ``Authorization: Bearer KEY`` on every route but /health (constant-time)."""
    encoded = [k.encode() for k in keys]

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        presented = token.strip().encode() if scheme.lower() == "bearer" else b""
        # Compare against every key so that timing does not reveal which one matched.
        matched = False
        for key in encoded:
            matched |= hmac.compare_digest(presented, key)
        if not matched:
            raise APIError(
                401,
                "Missing or invalid API key. Send 'Authorization: Bearer <key>'."
                if presented or header
                else "This server requires an API key. Send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )
        return await handler(request)

    return middleware


def create_app(settings: Settings, engine: KVStreamEngine) -> web.Application:
    """The KVStream application. The engine is started and closed with the app."""
    keys = settings.accepted_keys()
    middlewares = [error_middleware]
    if keys:
        middlewares.append(auth_middleware(keys))
    app = web.Application(client_max_size=settings.server.max_body_bytes, middlewares=middlewares)
    if engine.metrics is None:
        engine.attach_metrics(Metrics())
    app[STATE] = AppState(engine=engine, settings=settings)
    app[MAX_BODY_BYTES] = settings.server.max_body_bytes
    app.add_routes(routes_openai.routes)
    app.add_routes(routes_ops.routes)

    async def engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.close()

    app.cleanup_ctx.append(engine_lifecycle)
    return app


__all__ = ["REQUEST_ID", "create_app"]
