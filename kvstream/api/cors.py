"""CORS: which web pages of other origins may read KVStream's answers in a browser. Where
KVStream is the runtime (the in-process engine), by its own policy, as llama-server and
Ollama answer it; in front of a runtime, by the runtime's.

In front of a runtime the runtime's own policy answers, unchanged: preflights pass through
to it like any route (routes_passthrough.py), and so do its answers' grants. An answer KVStream
builds from the runtime's (a scheduled generation: the runtime's chunks re-sent, or translated)
carries the grant the runtime gave its answer to this request; the page's origin goes upstream
with the request so that the runtime judges it as it would directly. An answer KVStream gives
alone in front of the runtime (a refusal: 429, 503, a body it could not translate; a stored
response) carries the grant the runtime last gave that origin, if it gave one in the last
ten minutes (a browser's preflight asks the runtime before every such request).

Where KVStream is the runtime it answers them itself: a preflight
(``OPTIONS`` with ``Access-Control-Request-Method``) on any path gets a 200, and every answer
to an allowed origin carries ``Access-Control-Allow-Origin`` (the origin, reflected) with
credentials allowed. ``server.cors_origins`` lists the allowed ones: ``localhost`` (any
scheme and port on localhost, 127.0.0.1 or [::1], llama-server's ``--cors-origins localhost``
and Ollama's default), exact origins, or ``*`` (any, llama-server's default). The default is
``localhost``: any web page a user opens could otherwise read the model's answers through
their browser.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

from aiohttp import web

from kvstream.api.state import STATE
from kvstream.types import GenerateRequest, RequestControl

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
METHODS = "GET, POST, DELETE, OPTIONS"
# Headers of KVStream's answers a page's script may read.
EXPOSED = "X-Request-Id, Retry-After"
# In front of a runtime: how long the grant the runtime gave an origin stands for KVStream's
# own answers to that origin, and how many origins are remembered (the Origin header is the
# client's to choose: a bound, not one entry per value sent).
GRANT_TTL_S = 600.0
MAX_ORIGINS = 256
# The generations a request submitted, whose runtime answers carry its grant.
RUNTIME_CONTROLS = web.RequestKey("runtime_controls", list)
# The grant on the runtime's answer a pass-through forwards (its headers go as they came).
PASSED_GRANT = web.RequestKey("passed_grant", dict)


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


def follow_runtime(request: web.Request, batch: Sequence[GenerateRequest]) -> None:
    """Before ``batch`` (one request's generations) is submitted: the page's origin goes to
    the runtime with each (a body KVStream translates carries no client header otherwise),
    and the answer will carry the grant the runtime gives it."""
    origin = request.headers.get("Origin")
    if not origin or _is_runtime(request):
        return
    for generate in batch:
        if generate.headers is None:
            generate.headers = {"Origin": origin}
    request[RUNTIME_CONTROLS] = [generate.control for generate in batch]


class RuntimeGrants:
    """The grant the runtime last gave each origin (its preflight answers, its answers to
    requests from that origin), for the answers KVStream gives that origin alone."""

    def __init__(self) -> None:
        self._grants: OrderedDict[str, tuple[float, dict[str, str]]] = OrderedDict()

    def learn(self, origin: str, grant: dict[str, str]) -> None:
        self._grants[origin] = (time.monotonic(), grant)
        self._grants.move_to_end(origin)
        while len(self._grants) > MAX_ORIGINS:
            self._grants.popitem(last=False)

    def recall(self, origin: str) -> dict[str, str]:
        learned = self._grants.get(origin)
        if learned is None or time.monotonic() - learned[0] > GRANT_TTL_S:
            return {}
        return learned[1]


def _answered_grant(controls: Sequence[RequestControl]) -> dict[str, str] | None:
    """The grant of the runtime's answer to this request's generations (None: none came)."""
    for control in controls:
        if control.runtime_grant is not None:
            return control.runtime_grant
    return None


def grant_on_prepare(allowed: list[str]):
    """An ``on_response_prepare`` handler (it runs as the head is sent, streamed answers too).
    KVStream as the runtime: an answer to an allowed origin carries its grant. In front of a
    runtime: the runtime's grant, as the module's docstring says."""
    learned = RuntimeGrants()

    async def grant(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin", "")
        if not origin:
            return
        if not _is_runtime(request):
            follow(origin, request, response)
            return
        response.headers.add("Vary", "Origin")
        if origin_allowed(origin, allowed):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Credentials"] = "true"
            response.headers["Access-Control-Expose-Headers"] = EXPOSED

    def follow(origin: str, request: web.Request, response: web.StreamResponse) -> None:
        passed = request.get(PASSED_GRANT)
        if passed is not None:  # the runtime's own answer, forwarded with its headers
            learned.learn(origin, passed)
            return
        given = _answered_grant(request.get(RUNTIME_CONTROLS, ()))
        if given is not None:
            learned.learn(origin, given)
        else:
            given = learned.recall(origin)
        if given:
            response.headers.update(given)
            response.headers.add("Vary", "Origin")

    return grant
