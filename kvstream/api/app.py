"""``create_app``: the aiohttp application with its routes, middlewares and lifecycle."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily

from kvstream import __version__
from kvstream.api import (
    cors, routes_conversations, routes_embeddings, routes_messages, routes_ollama, routes_openai, routes_ops, routes_passthrough,
    responses_file, routes_llamacpp, routes_responses,
)
from kvstream.api.background import BACKGROUND, BackgroundRuns
from kvstream.api.errors import MAX_BODY_BYTES, REQUEST_ID, APIError, error_middleware
from kvstream.api.state import CACHE_SALT, KEY_IN_FLIGHT, STATE, AppState, KeyInFlight
from kvstream.api.stream_sessions import STREAM_SESSIONS, StreamSessions
from kvstream.types import BackendError
from kvstream.config import Settings
from kvstream.engine import KVStreamEngine
from kvstream.metrics import Metrics
from kvstream.scheduler import SchedulerError

logger = logging.getLogger(__name__)

# Reachable without a key, so that a load balancer can tell the process is alive.
PUBLIC_PATHS = frozenset({"/health"})


# Routes that run the model: the per-key concurrency cap counts them.
GENERATION_PATHS = (
    routes_openai.GENERATION_PATHS
    | {routes_openai.WARM_PATH}
    | routes_passthrough.GENERATION_PATHS
    | routes_passthrough.FORWARD_ONLY_PATHS
)


def tenant_salt(key: str) -> str:
    """A key's cache salt: stable across restarts (slot files and disk caches outlive the
    process), and telling nothing about the key."""
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"kvstream-salt").hexdigest()


def auth_middleware(keys: list[str], max_concurrent_per_key: int | None = None, isolate: bool = False):
    """Require ``Authorization: Bearer KEY`` (or, as Anthropic's clients send it, ``x-api-key:
    KEY``) on every route but /health (constant-time),
    optionally cap the generations each key has in flight, and with ``isolate`` tag each
    request with its key's cache salt (tenant isolation of cached prefixes)."""
    encoded = [k.encode() for k in keys]
    salts = [tenant_salt(k) for k in keys]
    in_flight = [KeyInFlight(max_concurrent_per_key) for _ in keys]

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        # CORS preflights carry no credentials by design (browsers never send them); they
        # compute nothing and pass through to the runtime.
        if request.path in PUBLIC_PATHS or request.method == "OPTIONS":
            return await handler(request)
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:  # Anthropic's clients send the key as x-api-key
            scheme, token = "bearer", request.headers.get("x-api-key", "")
        # surrogateescape: a header byte that is not UTF-8 is just a wrong key, not a crash.
        presented = token.strip().encode("utf-8", "surrogateescape") if scheme.lower() == "bearer" else b""
        # Compare against every key so that timing does not reveal which one matched.
        matched = -1
        for index, key in enumerate(encoded):
            if hmac.compare_digest(presented, key):
                matched = index
        if matched < 0:
            raise APIError(
                401,
                "Missing or invalid API key. Send 'Authorization: Bearer <key>'."
                if presented or header
                else "This server requires an API key. Send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )
        if isolate:
            request[CACHE_SALT] = salts[matched]
        if max_concurrent_per_key is None or request.path not in GENERATION_PATHS:
            return await handler(request)
        held = request[KEY_IN_FLIGHT] = in_flight[matched]
        if not held.take():
            raise APIError(
                429, f"This API key already has {max_concurrent_per_key} requests in flight.",
                code="concurrency_limit", retry_after=1,
            )
        try:
            return await handler(request)
        finally:
            held.give()

    return middleware


async def warm_prefixes(engine: KVStreamEngine, prompts: list[str]) -> None:
    """Prefill the configured system prompts before serving; a failure is logged, not fatal
    (the runtime may still be starting: the prompts are then simply computed on first use)."""
    for text in prompts:
        try:
            result = await engine.warm(text)
        except (SchedulerError, BackendError) as exc:
            logger.warning("warming a %d-character prompt failed: %s", len(text), exc)
            continue
        logger.info("warmed a %d-token prefix in %.0f ms", result["prompt_tokens"], result["elapsed_ms"])


def create_app(settings: Settings, engine: KVStreamEngine) -> web.Application:
    """The KVStream application. The engine is started and closed with the app."""
    keys = settings.accepted_keys()
    # Preflights first: they carry no credentials and compute nothing (cors.py).
    middlewares = [cors.preflight_middleware(settings.server.cors_origins), error_middleware]
    if keys:
        isolate = settings.prefix_cache.tenant_isolation is not False  # default (None): on with keys
        middlewares.append(auth_middleware(keys, settings.server.max_concurrent_per_key, isolate))
    app = web.Application(client_max_size=settings.server.max_body_bytes, middlewares=middlewares)
    if engine.metrics is None:
        engine.attach_metrics(Metrics())
    app[STATE] = AppState(engine=engine, settings=settings)
    app[MAX_BODY_BYTES] = settings.server.max_body_bytes
    app[BACKGROUND] = BackgroundRuns()
    app[STREAM_SESSIONS] = StreamSessions()
    engine.metrics.registry.register(_StoresCollector(app))  # type: ignore[union-attr]
    app.add_routes(routes_openai.routes)
    app.add_routes(routes_ollama.routes)
    app.add_routes(routes_embeddings.routes)
    app.add_routes(routes_responses.routes)
    app.add_routes(routes_conversations.routes)
    app.add_routes(routes_messages.routes)
    app.add_routes(routes_llamacpp.routes)
    app.add_routes(routes_ops.routes)
    app.add_routes(routes_passthrough.routes)  # last: it takes every route the others did not

    async def engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
        state, kept = app[STATE], settings.server.responses_file
        if kept is not None:
            responses_file.load(kept, state.responses, state.conversations)
        await engine.start()
        await warm_prefixes(engine, settings.prefix_cache.warm)
        every = settings.server.responses_save_interval_s
        saver = (asyncio.create_task(responses_file.keep_saved(kept, state.responses, state.conversations, every,
                                                               app[BACKGROUND]))
                 if kept is not None and every > 0 else None)
        yield
        if saver is not None:
            saver.cancel()
            await asyncio.gather(saver, return_exceptions=True)
        await app[BACKGROUND].close()  # before the engine: each run releases its generation
        await app[STREAM_SESSIONS].close()
        await engine.close()
        if kept is not None:
            responses_file.save(kept, state.responses, state.conversations)

    app.cleanup_ctx.append(engine_lifecycle)
    app.on_response_prepare.append(add_via)
    app.on_response_prepare.append(cors.grant_on_prepare(settings.server.cors_origins))
    return app


class _StoresCollector:
    """The Responses API's stores on /metrics, read at scrape time."""

    def __init__(self, app: web.Application) -> None:
        self.app = app

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = self.app[STATE]
        yield GaugeMetricFamily("kvstream_responses_stored", "Responses kept for previous_response_id and retrieval.",
                                value=len(state.responses))
        yield GaugeMetricFamily("kvstream_responses_stored_bytes", "Bytes of the stored responses, as JSON.",
                                value=state.responses.bytes)
        yield GaugeMetricFamily("kvstream_responses_running", "Background responses running.", value=len(self.app[BACKGROUND]))
        yield GaugeMetricFamily("kvstream_conversations_stored", "Conversations kept.", value=len(state.conversations))


VIA = f"1.1 kvstream/{__version__}"


async def add_via(request: web.Request, response: web.StreamResponse) -> None:
    """Name KVStream in ``Via`` on every answer, passed-through ones included (RFC 9110
    7.6.3: a proxy adds itself): what tells a client, or another KVStream probing for a
    runtime, that this is a proxy and not the runtime whose routes it relays."""
    via = response.headers.get("Via")
    response.headers["Via"] = f"{via}, {VIA}" if via else VIA


__all__ = ["REQUEST_ID", "create_app"]
