"""Request bodies, read the one way every route reads them: bounded in size (413) and in
time (408), and inflated here, if the client compressed them, never past the size limit.

The server runs with aiohttp's own request decompression off (``server.py``): aiohttp
would inflate a ``Content-Encoding: gzip`` body in its parser, synchronously and before
auth or any limit, so one 4 MB request holding 4 GiB of zeros would stall every client.
Here a compressed body is inflated only by a route that reads it (after auth), in one
bounded step that stops at ``server.max_body_bytes`` of output.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator

from aiohttp import web

from kvstream.api.errors import APIError
from kvstream.api.state import STATE

# zlib window bits per Content-Encoding: gzip framing, and zlib framing for deflate (raw
# deflate, which some clients send under that name, is tried when zlib framing fails).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body too large (the limit is {limit} bytes).", code="request_too_large")


def body_timeout(seconds: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {seconds:g}s.", code="body_timeout")


def content_encoding(request: web.Request) -> str:
    """The body's encoding, lower-cased; "identity" when there is none."""
    return request.headers.get("Content-Encoding", "").strip().lower() or "identity"


def check_encoding(encoding: str) -> None:
    """415 for an encoding KVStream cannot read (it would have to forward what it cannot
    check, or fail later less clearly)."""
    if encoding != "identity" and encoding not in _WBITS:
        raise APIError(
            415, f"Content-Encoding '{encoding}' is not supported (gzip, deflate or identity).", code="unsupported_encoding"
        )


def inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """``raw`` decoded from ``encoding``: 413 once the output passes ``limit`` bytes (the
    rest is never inflated), 400 if it is not what its encoding says."""
    check_encoding(encoding)
    if encoding == "identity":
        return raw
    for wbits in (_WBITS[encoding], -zlib.MAX_WBITS):
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(raw, limit + 1)
        except zlib.error:
            if encoding == "deflate" and wbits > 0:
                continue  # raw deflate under the name "deflate"
            break
        if len(out) > limit or inflater.unconsumed_tail:
            raise too_large(limit)
        if inflater.eof:
            return out
        break
    raise APIError(400, f"The request body cannot be read as sent (not valid {encoding} data).", code="invalid_body")


async def read_raw(request: web.Request) -> bytes:
    """The body as sent (still encoded): 413 past the size limit (aiohttp's
    ``client_max_size``), 408 past ``server.body_timeout_s``."""
    seconds = request.app[STATE].settings.server.body_timeout_s
    try:
        async with asyncio.timeout(seconds):
            return await request.read()
    except TimeoutError:
        raise body_timeout(seconds) from None


async def read_bytes(request: web.Request) -> bytes:
    """The decoded body, bounded in size and time."""
    encoding = content_encoding(request)
    check_encoding(encoding)  # before reading: an unreadable body is not worth waiting for
    raw = await read_raw(request)
    return inflate(raw, encoding, request.app[STATE].settings.server.max_body_bytes)


class LimitedBody:
    """The request body as it arrives, streamed upstream as sent (encoded or not), stopped
    once it passes ``limit`` bytes or takes longer than ``seconds``. The upload then fails
    inside aiohttp's client (which reports a connection error); ``failure`` tells the
    handler what to answer instead of a runtime failure."""

    def __init__(self, request: web.Request, limit: int, seconds: float) -> None:
        self.request = request
        self.limit = limit
        self.seconds = seconds
        self.failure: APIError | None = None

    async def __aiter__(self) -> AsyncIterator[bytes]:
        seen = 0
        deadline = asyncio.get_running_loop().time() + self.seconds
        content = self.request.content
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    chunk = await content.readany()
            except TimeoutError:
                self.failure = body_timeout(self.seconds)
                raise self.failure from None
            if not chunk:
                return
            seen += len(chunk)
            if seen > self.limit:
                self.failure = too_large(self.limit)
                raise self.failure
            yield chunk
