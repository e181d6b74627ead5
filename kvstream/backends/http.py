"""HTTP plumbing shared by the remote adapters: one session per upstream, the stale
keep-alive retry, SSE and NDJSON readers, and upstream error bodies mapped to BackendErrors."""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from kvstream.types import BackendError, BackendRejected, BackendUnavailable
from kvstream.jsonfast import dumps, loads

logger = logging.getLogger(__name__)

# Failures of a request sent on a pooled keep-alive connection the server had already closed:
# nothing reached the runtime's handler and no byte came back, so one retry is safe.
_STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
_JSON_HEADERS = {"Content-Type": "application/json"}

# This process's name in the Via header of every request it sends upstream (RFC 9110 7.6.3:
# a proxy adds itself to Via in both directions). A request that arrives carrying it has gone
# round a loop: a backend URL that leads back to this KVStream, directly or through other
# proxies that keep Via. Answered at once with 508; otherwise each hop would open another
# connection to itself until the listener's cap.
INSTANCE_ID = secrets.token_hex(8)
_VIA_HOP = f"1.1 kvstream ({INSTANCE_ID})"

# The headers of an answer that let a web page of another origin read it (the Fetch
# standard's CORS response headers). A page reads an answer KVStream builds from the runtime's
# only if it carries the grant the runtime gave: without it, a browser app that works against
# the runtime directly fails through KVStream.
CORS_ANSWER_HEADERS = ("Access-Control-Allow-Origin", "Access-Control-Allow-Credentials", "Access-Control-Expose-Headers")


def cors_grant(headers: Mapping[str, str]) -> dict[str, str]:
    """The CORS grant among an answer's headers ({} when it grants nothing)."""
    return {name: headers[name] for name in CORS_ANSWER_HEADERS if name in headers}


def via_with_this_hop(incoming: str | None) -> str:
    """The Via header a request sends upstream: what it came with, then this KVStream."""
    return f"{incoming}, {_VIA_HOP}" if incoming else _VIA_HOP


def came_through_here(via: str | None) -> bool:
    """Whether a request's Via names this process: the request went round a loop."""
    return bool(via) and f"({INSTANCE_ID})" in via


async def cli_output(*args: str, timeout: float = 10.0) -> str | None:
    """What a runtime's own CLI prints (``foundry server status``, ``lms server status``);
    None when the CLI is not installed or does not answer within ``timeout``."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
    except (FileNotFoundError, PermissionError):
        return None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None
    return out.decode("utf-8", "replace")


def split_credentials(url: str) -> tuple[str, str | None]:
    """``url`` without its ``user:password@`` part, and those credentials as the value of a
    basic ``Authorization`` header (RFC 7617; None when it has none). KVStream shows, logs
    and puts in error messages only the first. (aiohttp's BasicAuth and sessions' ``auth``
    are deprecated, gone in aiohttp 4: the header is sent as a session default.)"""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    clean = urllib.parse.urlunsplit(parts._replace(netloc=hostport))
    pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()
    return clean, "Basic " + base64.b64encode(pair).decode("ascii")


def api_root(url: str) -> str:
    """``url`` without a trailing ``/v1``: OpenAI-compatible runtimes give their base URL for
    clients that way (LM Studio's ``http://localhost:1234/v1``, vLLM's, Ollama's OpenAI
    routes), and users paste it; KVStream adds ``/v1/...`` itself, and the runtimes' native
    routes (``/props``, ``/api/tags``, ``/health``) live at the root. A path in front of it
    (a gateway's ``/llm/v1``) stays."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        return url
    return urllib.parse.urlunsplit(parts._replace(path=path[: -len("/v1")]))


class UpstreamSession:
    """Two aiohttp sessions to one runtime: a pooled one for normal traffic and a
    close-after-use one for the single retry after a stale pooled connection."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        deadline: float | None = None,
        headers: dict[str, str],
    ):
        """``read_timeout``: longest the runtime may send nothing; ``deadline``: longest a
        whole request may take, streaming included (aiohttp's total timeout runs until the
        body is read); ``headers``: sent with every request, the runtime's credential among
        them (a configured key, or the URL's user and password: ``base_url`` is the URL
        without them, as it is shown)."""
        self.base_url = base_url
        self.deadline = deadline
        timeout = aiohttp.ClientTimeout(total=deadline, sock_connect=connect_timeout, sock_read=read_timeout)
        # No connection limit: the scheduler bounds what is in flight (aiohttp's default of
        # 100 would queue requests the scheduler had admitted). No cookie jar: a proxy must
        # not carry one client's upstream cookies into another client's requests.
        # Every request names this hop in Via, the side requests (tokenize, slots, probes)
        # too; a forwarded client request replaces it with the client's chain plus this hop.
        headers = {"Via": _VIA_HOP, **headers}
        self._pooled = aiohttp.ClientSession(
            timeout=timeout, headers=headers, connector=aiohttp.TCPConnector(limit=0),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._fresh = aiohttp.ClientSession(
            timeout=timeout, headers=headers, connector=aiohttp.TCPConnector(limit=0, force_close=True),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        # The runtime's own credential (URL credentials or a configured key) wins over one a
        # caller passes on: the runtime must see KVStream's configured one.
        self._own_credentials = any(name.lower() == "authorization" for name in headers)

    async def close(self) -> None:
        await self._pooled.close()
        await self._fresh.close()

    @asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        timeout: float | None = None,
        data: Any = None,
        headers: dict[str, str] | None = None,
        raw: bool = False,
        deadline: bool = True,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Send a request; yields the response once its headers arrived.

        ``json_body`` is serialized (``headers`` go with it, its Content-Type KVStream's; an
        Authorization among ``headers`` is dropped when the session has credentials of its own);
        ``data`` (bytes, or an async iterator of bytes that is streamed) and ``headers`` go
        as given; ``raw`` leaves the response's content
        encoding alone (a pass-through forwards the bytes it got). ``timeout`` replaces the
        session's deadline for this request; ``deadline=False`` drops it (only the read
        timeout holds: a runtime's admin route, such as a model download, may rightly run
        for an hour while it reports progress). Connection failures become
        BackendUnavailable; a stale pooled connection is retried once on a fresh one when
        the body can be sent again.
        """
        url = self.base_url + path
        kwargs: dict[str, Any] = {}
        if headers and self._own_credentials:
            headers = {name: value for name, value in headers.items() if name.lower() != "authorization"}
        if json_body is not None:
            kwargs = {"data": dumps(json_body), "headers": {**headers, **_JSON_HEADERS} if headers else _JSON_HEADERS}
        elif data is not None or headers is not None:
            kwargs = {"data": data, "headers": headers}
        if raw:
            kwargs["auto_decompress"] = False
        limit = timeout if timeout is not None else self.deadline if deadline else None
        if limit != self.deadline:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=limit, sock_connect=self.connect_timeout, sock_read=self.read_timeout)
        replayable = data is None or isinstance(data, bytes)
        started = time.monotonic()
        response = None
        for session in (self._pooled, self._fresh):
            try:
                response = await session.request(method, url, **kwargs)
                break
            except aiohttp.ClientConnectorError as exc:
                raise BackendUnavailable(f"cannot connect to the runtime at {self.base_url} ({exc.strerror or exc})") from None
            except _STALE_CONNECTION as exc:
                if session is self._fresh or not replayable:
                    # A fresh connection closed too: the runtime dropped this request itself.
                    raise BackendError(f"the runtime at {self.base_url} closed the connection without answering ({exc})") from None
                logger.debug("stale keep-alive connection to %s, retrying once on a fresh one", self.base_url)
            except TimeoutError:
                raise self._timeout_error(started, limit) from None
            except aiohttp.ClientError as exc:  # an answer that is not valid HTTP
                raise BackendError(f"the runtime at {self.base_url} sent a malformed answer ({exc.__class__.__name__})") from None
        assert response is not None
        try:
            yield response
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            response.close()
            raise BackendError(f"the runtime closed the stream mid-response ({exc.__class__.__name__})") from None
        except TimeoutError:
            response.close()
            raise self._timeout_error(started, limit) from None
        except BaseException:
            # Cancelled (the client left) or failed: closing the connection is what makes
            # the runtime stop generating; returning it to the pool would not.
            response.close()
            raise
        else:
            response.release()

    def _timeout_error(self, started: float, limit: float | None) -> BackendError:
        """Which of the two limits ran out: the request's deadline, or the read timeout."""
        elapsed = time.monotonic() - started
        if limit is not None and elapsed >= limit - 0.05:
            message = f"the runtime's answer did not finish within the request deadline ({limit:g}s)"
        else:
            message = f"the runtime at {self.base_url} sent nothing for too long (read timeout after {elapsed:.0f}s)"
        return BackendError(message, 504, code="backend_timeout")

    async def probe_json(self, path: str, timeout: float = 3.0) -> Any:
        """GET a JSON document from the runtime itself: None for an error status, a body
        that is not JSON, or an answer that came through a KVStream (its ``Via`` header
        names it: a KVStream passes its runtime's routes through, so only that tells them
        apart)."""
        try:
            async with self.request("GET", path, timeout=timeout) as resp:
                if resp.status >= 400 or "kvstream" in resp.headers.get("Via", "").lower():
                    return None
                return loads(await resp.read())
        except (BackendError, ValueError):
            return None

    async def get_json(self, path: str, timeout: float = 5.0) -> Any:
        """GET a JSON document; raises for any non-2xx answer."""
        async with self.request("GET", path, timeout=timeout) as resp:
            await raise_for_upstream_status(resp)
            return await read_json(resp)

    async def get_text(self, path: str, timeout: float = 5.0, max_bytes: int = 8 * 1024 * 1024) -> str:
        """GET a text document (a Prometheus scrape) of at most ``max_bytes``; raises for any
        non-2xx answer or a larger one."""
        async with self.request("GET", path, timeout=timeout) as resp:
            await raise_for_upstream_status(resp)
            raw = await resp.content.read(max_bytes + 1)
            if len(raw) > max_bytes:
                raise BackendError(f"the runtime's {path} is larger than {max_bytes} bytes")
            return raw.decode("utf-8", "replace")

    async def post_json(self, path: str, body: Any, timeout: float | None = None) -> Any:
        async with self.request("POST", path, json_body=body, timeout=timeout) as resp:
            await raise_for_upstream_status(resp)
            return await read_json(resp)


async def read_json(resp: aiohttp.ClientResponse) -> Any:
    try:
        return loads(await resp.read())
    except ValueError:
        raise BackendError(f"the runtime sent a body that is not JSON (HTTP {resp.status})") from None


def error_message(body: Any) -> tuple[str, str | None, str | None]:
    """(message, code, param) from any runtime's error body shape."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, str):
            return err, None, None
        if isinstance(err, dict):
            code = err.get("code")
            return (
                str(err.get("message") or err.get("detail") or err),
                str(code) if code is not None and not isinstance(code, int) else err.get("type"),
                err.get("param"),
            )
    return str(body)[:500], None, None


def plain_text(raw: bytes, content_type: str) -> str:
    """A non-JSON error body fit for a one-line message: an HTML page (a reverse proxy's
    error page, a login form) is named, not quoted; other text is cut to one short line."""
    if "html" in content_type or raw.lstrip()[:1] == b"<":
        return f"an HTML page ({len(raw)} bytes) instead of an API error"
    text = " ".join(raw.decode("utf-8", "replace").split())
    return text if len(text) <= 200 else text[:200] + "..."


async def raise_for_upstream_status(resp: aiohttp.ClientResponse) -> None:
    """Map an upstream error status to the BackendError KVStream answers with."""
    if resp.status < 400:
        return
    raw = await resp.read()
    try:
        body: Any = loads(raw)
    except ValueError:
        body = plain_text(raw, resp.content_type)
    message, code, param = error_message(body)
    if resp.status == 503 or resp.status == 429:
        raise BackendUnavailable(f"runtime busy or not ready: {message}", 503, code=code or "backend_unavailable")
    if resp.status in (400, 404, 413, 422, 501):  # 501: what the runtime does not implement (embeddings...)
        own = body if isinstance(body, dict) else None
        raise BackendRejected(message, resp.status, code=code or ("not_implemented" if resp.status == 501 else "invalid_request"),
                              param=param, body=own)
    if resp.status == 508:  # a loop (see INSTANCE_ID): the innermost hop's words say what to fix
        raise BackendError(message, 508, code=code or "proxy_loop")
    if resp.status == 403 and not raw and "Origin" in resp.request_info.headers:
        # The runtime's CORS policy refusing the web page the request came from (Ollama answers
        # a page outside OLLAMA_ORIGINS so, with no body): the client's, as it is directly.
        raise BackendRejected("The runtime refuses requests from this web page's origin.", 403, code="origin_refused")
    if resp.status == 401 or resp.status == 403:
        raise BackendError(f"the runtime refused KVStream's credentials: {message}", 502, code="backend_auth")
    raise BackendError(f"runtime error (HTTP {resp.status}): {message}", 502)


class _Skip:
    """A line that carries no event (blank, comment, or an SSE field KVStream ignores)."""


SKIP = _Skip()
# ``data: [DONE]``: the OpenAI stream's end marker.
DONE = None


def decode_sse_line(line: bytes) -> Any:
    """One SSE line: its JSON payload, SKIP, or DONE. An ``error:`` field (older
    llama-server) or a data payload with an ``error`` key raises BackendError."""
    if not line or line[0] == 58:  # b":" starts a keep-alive comment
        return SKIP
    field, _, value = line.partition(b":")
    value = value.strip()
    if field == b"data":
        if value == b"[DONE]":
            return DONE
        try:
            payload = loads(value)
        except ValueError:
            raise BackendError("the runtime sent a malformed stream event") from None
        if payload is None:
            return SKIP  # llama-server streams `data: null` between the prompts of a batch
        if isinstance(payload, dict) and "error" in payload and not payload.get("choices"):
            raise BackendError(f"the runtime failed mid-stream: {error_message(payload)[0]}")
        return payload
    if field == b"error":
        try:
            message = error_message({"error": loads(value)})[0]
        except ValueError:
            message = value.decode("utf-8", "replace")
        raise BackendError(f"the runtime failed mid-stream: {message}")
    return SKIP  # "event:", "id:" and "retry:" carry nothing the OpenAI stream needs


def decode_ndjson_line(line: bytes) -> Any:
    """One NDJSON line (Ollama): its object, or SKIP; an ``error`` key raises."""
    if not line.strip():
        return SKIP
    try:
        obj = loads(line)
    except ValueError:
        raise BackendError("the runtime sent a malformed NDJSON line") from None
    if not isinstance(obj, dict):
        raise BackendError("the runtime sent an NDJSON line that is not an object")
    if "error" in obj:
        raise BackendError(f"the runtime failed mid-stream: {error_message(obj)[0]}")
    return obj


class EventReader:
    """Decodes a streamed body (SSE or NDJSON) as it arrives, a network read at a time.

    Each ``await read()`` returns every event completed by the next chunk, so a burst of
    tokens costs one await rather than one per line (this is the proxy's hot path).
    After ``data: [DONE]`` nothing more is read and DONE is the batch's last item.
    """

    def __init__(self, resp: aiohttp.ClientResponse, decode: Callable[[bytes], Any] = decode_sse_line) -> None:
        self._content = resp.content
        self._decode = decode
        self._pending = b""
        self._failure: BackendError | None = None
        self.ended = False

    async def read(self) -> list[Any]:
        """The next events, in order; ``[]`` once the body (or the stream) has ended."""
        while not self.ended:
            chunk = await self._content.readany()
            if not chunk:  # end of body: a last line may lack its newline
                self.ended = True
                lines, self._pending = [self._pending], b""
            else:
                lines = (self._pending + chunk if self._pending else chunk).split(b"\n")
                self._pending = lines.pop()
            events = []
            for line in lines:
                try:
                    event = self._decode(line.rstrip(b"\r"))
                except BackendError as exc:
                    if not events:
                        raise
                    # The events before the failure reach the client first.
                    self._failure, self.ended = exc, True
                    break
                if event is SKIP:
                    continue
                events.append(event)
                if event is DONE:
                    self.ended = True
                    break
            if events:
                return events
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        return []
