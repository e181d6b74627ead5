"""Operator routes: /health (liveness), /ready (the backend answers), /status (snapshot)."""

from __future__ import annotations

from aiohttp import web

from kvstream.api.background import BACKGROUND
from kvstream.api.openapi import build_spec
from kvstream.api.state import STATE
from kvstream.metrics import CONTENT_TYPE

routes = web.RouteTableDef()


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """The proxy process is alive. Never depends on the backend (that is /ready)."""
    return web.json_response({"status": "ok"})


@routes.get("/ready")
async def ready(request: web.Request) -> web.Response:
    """200 when the backend answers its health probe, else 503 with the reason."""
    engine = request.app[STATE].engine
    if await engine.refresh():
        return web.json_response({"status": "ready", "backend": engine.backend.name})
    body = {
        "status": "unavailable",
        "backend": engine.backend.name,
        "error": {
            "message": f"backend {engine.backend.name} at {engine.backend.base_url or '(undiscovered)'} is not answering",
            "type": "server_error",
            "param": None,
            "code": "backend_unavailable",
        },
    }
    return web.json_response(body, status=503, headers={"Retry-After": "5"})


@routes.get("/status")
async def status(request: web.Request) -> web.Response:
    """A JSON snapshot of backend, queue, KV pool and counters, and the stored responses and
    conversations."""
    state = request.app[STATE]
    responses = state.responses.describe() | {"running": len(request.app[BACKGROUND])}
    return web.json_response(state.engine.snapshot() | {"responses": responses,
                                                        "conversations": state.conversations.describe()})


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format (see the metrics table in the README): KVStream's families,
    then the runtime's own unless ``server.runtime_metrics`` is off."""
    state = request.app[STATE]
    assert state.engine.metrics is not None
    # llama-server's header, where the engine is in-process (a runtime's comes with its series).
    in_process = state.engine.backend.upstream() is None
    own = {"Process-Start-Time-Unix": str(int(state.engine.stats.started_at))} if in_process else {}
    if not state.settings.server.runtime_metrics:
        return web.Response(body=state.engine.metrics.render(), headers=own | {"Content-Type": CONTENT_TYPE})
    body, carried = await state.engine.metrics.render_with_runtime()
    return web.Response(body=body, headers=own | carried | {"Content-Type": CONTENT_TYPE})


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI description of these routes."""
    return web.json_response(build_spec())
