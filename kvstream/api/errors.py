"""OpenAI-shaped errors and the middleware that guarantees every failure becomes one.

Body: ``{"error": {"message", "type", "param", "code"}}`` with the right status, never a
traceback. Every response, error or not, carries ``X-Request-Id``.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kvstream.api.openai_format import random_hex
from kvstream.api.state import STATE
from kvstream.backends.http import came_through_here
from kvstream.types import BackendError, BackendRejected, BackendUnavailable
from kvstream.scheduler import SchedulerError

logger = logging.getLogger(__name__)

REQUEST_ID = web.RequestKey("request_id", str)
_REQUEST_ID_FORMAT = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
MAX_BODY_BYTES = web.AppKey("max_body_bytes", int)
# A route answering in another API's error shape (Anthropic's) carries its converter as its
# handler's ``error_shape`` attribute (translated_api.api_routes). Every error of a request to
# it, wherever it is raised (the API-key check, the body limit, a scheduler refusal, a passed-
# through runtime's failure), is then answered in that shape: aiohttp matches the route before
# any middleware runs.
ERROR_SHAPE = "error_shape"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: int | None = None,
        should_retry: bool | None = None,
        raw_body: dict | None = None,
    ) -> None:
        """``raw_body``: answer with this body instead of building one (a runtime's own
        error, passed through unchanged)."""
        super().__init__(message)
        self.raw_body = raw_body
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after
        self.should_retry = should_retry

    def body(self) -> dict:
        if self.raw_body is not None:
            return self.raw_body
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, request_id: str | None = None) -> web.Response:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        if self.should_retry is not None:
            # The OpenAI SDKs obey this before their own retry rules.
            headers["x-should-retry"] = "true" if self.should_retry else "false"
        if request_id:
            headers["X-Request-Id"] = request_id
        return web.json_response(self.body(), status=self.status, headers=headers)


def is_refusal(status: int) -> bool:
    """Whether a runtime's error status refuses the request rather than fails it: a 4xx (the
    client's own request is invalid) or a 501 (the runtime does not do what was asked, as
    llama-server's embeddings without ``--embeddings``: its configuration). Neither is a
    failure of the runtime or of KVStream, nor worth a warning in the log."""
    return 400 <= status < 500 or status == 501


def failure_outcome(exc: BaseException) -> str:
    """How a request that ended in ``exc`` is counted: ``refused`` where the runtime refused
    it (is_refusal), else ``failed``."""
    return "refused" if isinstance(exc, BackendRejected) and is_refusal(exc.status) else "failed"


def from_exception(exc: BaseException, retry_after: int = 1) -> APIError:
    """The APIError for any exception the request path can raise."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SchedulerError):
        retry = retry_after if exc.status in (429, 503) else None
        return APIError(exc.status, str(exc), code=exc.code, retry_after=retry, should_retry=exc.status != 400)
    if isinstance(exc, BackendRejected):
        return APIError(exc.status, exc.message, code=exc.code, param=exc.param, should_retry=False, raw_body=exc.body)
    if isinstance(exc, BackendUnavailable):
        return APIError(503, exc.message, code=exc.code, retry_after=retry_after)
    if isinstance(exc, BackendError):
        # A 429/503 from a backend (e.g. the in-process engine's queue) says when to retry too.
        retry = retry_after if exc.status in (429, 503) else None
        return APIError(exc.status, exc.message, code=exc.code, retry_after=retry)
    return APIError(500, "Internal error in KVStream; see its log.", code="internal_error")


_HTTP_CODES = {
    404: ("Unknown route.", "unknown_route"),
    405: ("Method not allowed on this route.", "method_not_allowed"),
    413: ("Request body too large.", "request_too_large"),
}


LOOP_MESSAGE = (
    "This request came back to the KVStream that sent it upstream: the backend URL leads to KVStream "
    "itself (directly or through another proxy). Point --backend-url at the runtime."
)


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Tag every request with an id and turn every failure into an OpenAI-shaped error."""
    incoming = request.headers.get("X-Request-Id", "")
    # A client's own id is kept for tracing only if it is a plain token: it goes into every
    # log line of the request, which must not let a client forge or garble them.
    request_id = incoming if _REQUEST_ID_FORMAT.fullmatch(incoming) else f"req-{random_hex(128)}"
    request[REQUEST_ID] = request_id
    if came_through_here(", ".join(request.headers.getall("Via", []))):
        logger.warning("[%s] %s %s came back to this KVStream: its backend URL leads to KVStream itself",
                       request_id, request.method, request.path)
        return _shaped(request, APIError(508, LOOP_MESSAGE, code="proxy_loop")).response(request_id)
    try:
        response = await handler(request)
    except APIError as exc:
        return _shaped(request, exc).response(request_id)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message, code = _HTTP_CODES.get(exc.status, (exc.reason, None))
        if exc.status == 413:
            limit = request.app.get(MAX_BODY_BYTES)
            message = f"Request body too large (the limit is {limit} bytes)." if limit else message
        return _shaped(request, APIError(exc.status, message, code=code)).response(request_id)
    except (SchedulerError, BackendError) as exc:
        return _shaped(request, from_exception(exc)).response(request_id)
    except (HttpProcessingError, RequestPayloadError) as exc:  # a body that cannot be read as sent (not gzip, ...)
        cause = exc.__cause__ if isinstance(exc, RequestPayloadError) and exc.__cause__ is not None else exc
        detail = getattr(cause, "message", "") or cause.__class__.__name__
        error = APIError(400, f"The request body cannot be read as sent ({detail}).", code="invalid_body")
        return _shaped(request, error).response(request_id)
    except Exception:
        logger.exception("[%s] unhandled error", request_id)
        return _shaped(request, from_exception(RuntimeError())).response(request_id)
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id
    return response


def _shaped(request: web.Request, error: APIError) -> APIError:
    """``error`` in the shape the request's route answers in (ERROR_SHAPE), OpenAI's by default."""
    shape = getattr(request.match_info.handler, ERROR_SHAPE, None)
    return shape(error) if callable(shape) else error


def json_body_error(exc: Exception) -> APIError:
    if isinstance(exc, UnicodeDecodeError):
        return APIError(400, "The request body is not valid UTF-8.", code="invalid_json")
    msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
    return APIError(400, f"The request body is not valid JSON ({msg}).", code="invalid_json")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def counted(route: str | Callable[[web.Request], str]) -> Callable[[Handler], Handler]:
    """Count a route's answers in ``kvstream_requests_total`` by route label (a string, or a
    function of the request) and status, errors and failures included."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def run(request: web.Request) -> web.StreamResponse:
            counter = request.app[STATE].engine.metrics.http_requests  # type: ignore[union-attr]
            label = route if isinstance(route, str) else route(request)
            try:
                response = await handler(request)
            except APIError as exc:
                counter.inc(label, str(exc.status))
                raise
            except Exception:
                counter.inc(label, "500")
                raise
            counter.inc(label, str(response.status))
            return response

        return run

    return wrap
