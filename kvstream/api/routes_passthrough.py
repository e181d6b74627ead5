"""Every route KVStream does not manage, passed to the runtime unchanged.

Method, path, query, headers (less the hop-by-hop ones and KVStream's own credentials) and
the body go upstream, the body streamed; the runtime's status, headers and body come back,
streamed as they arrive and still encoded as the runtime encoded them. The same auth, body
limit and request metrics apply as on the managed routes.

Generation routes that KVStream forwards without reading (llama.cpp's ``/completion``,
``/completions`` and ``/infill``, Ollama's own, and ``/v1/responses`` and Anthropic's
``/v1/messages`` in front of a runtime that speaks OpenAI: translated_api.py answers them
elsewhere) and the embedding and rerank routes still take a batch slot: a slot is a slot,
whoever parses the stream.

KVStream's own routes (``/health``, ``/ready``, ``/status``, ``/metrics``, ``/openapi.json``,
``/v1/warm``) shadow the runtime's; the runtime's are reached under ``/upstream/``
(``/upstream/metrics`` is llama-server's ``/metrics``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from kvstream.api.body import LimitedBody, content_encoding, inflate, read_raw, too_large
from kvstream.api.cors import PASSED_GRANT
from kvstream.api.errors import REQUEST_ID, APIError, counted, from_exception, is_refusal
from kvstream.api.state import STATE
from kvstream.api.streaming import GuardedResponse
from kvstream.backends.http import cors_grant, via_with_this_hop
from kvstream.jsonfast import loads
from kvstream.scheduler import Priority
from kvstream.types import BackendError

logger = logging.getLogger(__name__)

routes = web.RouteTableDef()

UPSTREAM_PREFIX = "/upstream"

# Connection-level headers (RFC 9110 section 7.6.1) and those the two legs set themselves.
HOP_BY_HOP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
        "transfer-encoding", "upgrade", "host",
    }
)

# Native generation routes: forwarded as bytes, admitted like any generation.
GENERATION_PATHS = frozenset(
    {"/completion", "/completions", "/infill", "/v1/responses", "/responses", "/v1/messages", "/api/generate", "/api/chat"}
)
# Routes that run the model without generating (one forward pass): admitted with no output.
FORWARD_ONLY_PATHS = frozenset(
    {"/v1/embeddings", "/embedding", "/embeddings", "/api/embed", "/api/embeddings", "/rerank", "/reranking", "/v1/rerank"}
)
# Fields a native route may cap its output with, in the order they are looked for.
LIMIT_FIELDS = ("n_predict", "max_tokens", "max_output_tokens", "max_completion_tokens")


def upstream_path(request: web.Request) -> str:
    """The runtime's path and query for this request (``/upstream/x`` -> ``/x``)."""
    path = request.rel_url.raw_path
    if path == UPSTREAM_PREFIX or path.startswith(UPSTREAM_PREFIX + "/"):
        path = path[len(UPSTREAM_PREFIX) :] or "/"
    query = request.rel_url.raw_query_string
    return f"{path}?{query}" if query else path


# Where a client sends its key: OpenAI's clients in Authorization, Anthropic's in x-api-key.
CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key"})


def forwarded_headers(request: web.Request, drop_authorization: bool) -> dict[str, str]:
    """The client's headers for the runtime: no hop-by-hop ones (nor those the Connection
    header names) and no credential (Authorization, x-api-key) when it was KVStream's own
    key. The body goes as sent, so its Content-Encoding and Content-Length stay."""
    named = {h.strip().lower() for h in request.headers.get("Connection", "").split(",") if h.strip()}
    headers = {}
    for name, value in request.headers.items():
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in named or (drop_authorization and lower in CREDENTIAL_HEADERS):
            continue
        if lower in ("x-request-id", "via"):
            continue  # KVStream's id for this request is sent below; Via, with this hop added
        headers[name] = value
    headers["X-Request-Id"] = request[REQUEST_ID]
    headers["Via"] = via_with_this_hop(", ".join(request.headers.getall("Via", [])) or None)
    return headers


# What the managed routes do not forward of the client's headers besides the hop-by-hop
# ones: the body's description (KVStream sends the JSON it re-serialized), the encodings it
# accepts (KVStream reads the answer), and its own controls (X-KVStream-*).
REWRITTEN_BODY_HEADERS = frozenset({"content-length", "content-type", "content-encoding", "accept-encoding"})


def drops_authorization(request: web.Request) -> bool:
    """Whether the client's Authorization stays here: it was KVStream's own key, or the
    runtime gets the credential KVStream was configured with."""
    settings = request.app[STATE].settings
    return bool(settings.accepted_keys()) or settings.backend.api_key is not None


def managed_route_headers(request: web.Request) -> dict[str, str]:
    """The client's headers that go upstream with a managed route's forwarded body."""
    return {
        name: value for name, value in forwarded_headers(request, drops_authorization(request)).items()
        if name.lower() not in REWRITTEN_BODY_HEADERS and not name.lower().startswith("x-kvstream-")
    }


def route_class(path: str) -> str:
    """The low-cardinality label a passed-through request is counted under."""
    return "passthrough_generation" if path in GENERATION_PATHS | FORWARD_ONLY_PATHS else "passthrough"


@routes.route("*", "/{tail:.*}")
@counted(lambda request: route_class(request.rel_url.raw_path))
async def passthrough(request: web.Request) -> web.StreamResponse:
    """Forward any route no other handler took (registered last)."""
    return await forward(request)


def unless_forwarded(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A route KVStream answers only where it answers the API itself: in front of a runtime
    that takes the body as sent (``forwards_body``), the runtime's own (stored responses and
    conversations are then the runtime's)."""

    @functools.wraps(handler)
    async def route(request: web.Request) -> web.StreamResponse:
        if request.app[STATE].engine.backend.forwards_body:
            return await forward(request)
        return await handler(request)

    return route


async def forward(request: web.Request) -> web.StreamResponse:
    """Pass ``request`` to the runtime and its answer back, admitting native generations."""
    state = request.app[STATE]
    engine = state.engine
    session = engine.backend.upstream()
    if session is None or not state.settings.server.passthrough:
        # The in-process engine has no runtime to ask; or the operator closed the door.
        raise APIError(404, "Unknown route.", code="unknown_route")
    target = upstream_path(request)
    limit = state.settings.server.max_body_bytes
    gen = None
    route = target.split("?", 1)[0]
    body: bytes | LimitedBody | None = None
    if request.method == "POST" and route in GENERATION_PATHS | FORWARD_ONLY_PATHS:
        # The body is read here (bounded: 413 past the limit, 408 past the body timeout)
        # to size the reservation; it goes upstream as sent.
        body = await read_raw(request)
        max_tokens = 0 if route in FORWARD_ONLY_PATHS else _limit_of(_decoded(body, content_encoding(request), limit))
        try:
            gen = engine.reserve(len(body), max_tokens, Priority.NORMAL)
        except Exception as exc:
            raise from_exception(exc) from None
    elif request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    elif request.body_exists:
        body = LimitedBody(request, limit, state.settings.server.body_timeout_s)
    outcome = "cancelled"
    response: web.StreamResponse | None = None
    try:
        if gen is not None:
            try:
                await gen.admitted()
            except Exception as exc:
                raise from_exception(exc) from None
        headers = forwarded_headers(request, drops_authorization(request))
        try:
            # Generations keep the request deadline; the runtime's other routes (a model
            # download, an upload) only the read timeout.
            async with session.request(
                request.method, target, data=body, headers=headers, raw=True, deadline=gen is not None
            ) as upstream:
                response = GuardedResponse(status=upstream.status, reason=upstream.reason)
                for name, value in upstream.headers.items():
                    if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                        response.headers.add(name, value)
                if upstream.content_length is not None and request.method != "HEAD":
                    response.content_length = upstream.content_length  # the raw bytes are forwarded
                response.headers["X-Request-Id"] = request[REQUEST_ID]
                request[PASSED_GRANT] = cors_grant(upstream.headers)
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                # The runtime's own 4xx (or 501) refuses the client's request; a 5xx is a failure.
                outcome = "finished" if upstream.status < 400 else "refused" if is_refusal(upstream.status) else "failed"
                return response
        except (BackendError, aiohttp.ClientError) as exc:
            outcome = "failed"
            if isinstance(body, LimitedBody) and body.failure is not None:
                raise body.failure from None
            if not isinstance(exc, BackendError):
                exc = BackendError(f"the runtime failed mid-response ({exc.__class__.__name__})")
            if response is None or not response.prepared:
                raise from_exception(exc) from None
            # Part of the answer is out: end the connection so the client sees it cut short.
            logger.warning("[%s] pass-through of %s failed mid-response: %s", request[REQUEST_ID], route, exc.message)
            response.force_close()
            return response
    finally:
        if gen is not None:
            gen.close(outcome)


def _decoded(body: bytes, encoding: str, limit: int) -> bytes:
    """The body decoded to find its output cap; an encoding KVStream cannot read is the
    runtime's to judge (the cap is then unknown)."""
    try:
        return inflate(body, encoding, limit)
    except APIError as exc:
        if exc.status == 415:
            return b""
        raise


def _limit_of(body: bytes) -> int | None:
    """The output cap a native generation body sets, when it is readable."""
    try:
        data = loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    for key in LIMIT_FIELDS:
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None
