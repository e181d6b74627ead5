"""CORS where KVStream is the runtime (the in-process engine, no runtime behind it): which
web pages of other origins may call it from a browser, as llama-server and Ollama answer it.

In front of a runtime the runtime's own policy answers, unchanged: preflights pass through
to it like any route (routes_passthrough.py). Here KVStream answers them itself: a preflight
(``OPTIONS`` with ``Access-Control-Request-Method``) on any path gets a 200, and every answer
to an allowed origin carries ``Access-Control-Allow-Origin`` (the origin, reflected) with
credentials allowed. ``server.cors_origins`` lists the allowed ones: ``localhost`` (any
scheme and port on localhost, 127.0.0.1 or [::1], llama-server's ``--cors-origins localhost``
and Ollama's default), exact origins, or ``*`` (any, llama-server's default). The default is
``localhost``: any web page a user opens could otherwise read the model's answers through
their browser.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from kvstream.api.state import STATE

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
METHODS = "GET, POST, DELETE, OPTIONS"
# Headers of KVStream's answers a page's script may read.
EXPOSED = "X-Request-Id, Retry-After"


def origin_allowed(origin: str, allowed: list[str]) -> bool:
    """Whether a page of ``origin`` may read KVStream's answers under ``allowed``."""
    if not origin or origin == "null":
        return False
    for entry in allowed:
        if entry == "*" or entry.rstrip("/") == origin:
            return True
        if entry == "localhost":
            try:
                parts = urlsplit(origin)
            except ValueError:
                continue
            if parts.scheme in ("http", "https") and parts.hostname in LOCAL_HOSTS:
                return True
    return False


def _is_runtime(request: web.Request) -> bool:
    """Whether KVStream answers for itself here (no runtime behind it whose CORS applies)."""
    return request.app[STATE].engine.backend.upstream() is None


def preflight_middleware(allowed: list[str]):
    """A preflight on any path answered at once (it carries no credentials by design and
    computes nothing): 200, with the CORS grants where the origin is allowed."""

    @web.middleware
    async def middleware(request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers or not _is_runtime(request):
            return await handler(request)
        response = web.Response(status=200)
        if origin_allowed(request.headers.get("Origin", ""), allowed):
            response.headers["Access-Control-Allow-Methods"] = METHODS
            # The headers asked for, named (a "*" would not cover Authorization, and no
            # header at all under credentials: the Fetch standard).
            response.headers["Access-Control-Allow-Headers"] = request.headers.get("Access-Control-Request-Headers") or "*"
            response.headers["Access-Control-Max-Age"] = "600"
        return response

    return middleware


def grant_on_prepare(allowed: list[str]):
    """An ``on_response_prepare`` handler: an answer to an allowed origin carries its grant
    (streamed ones too: it runs as the head is sent)."""

    async def grant(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin", "")
        if not origin or not _is_runtime(request):
            return
        response.headers.add("Vary", "Origin")
        if origin_allowed(origin, allowed):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Credentials"] = "true"
            response.headers["Access-Control-Expose-Headers"] = EXPOSED

    return grant
