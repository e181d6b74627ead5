"""UpstreamSession: the one retry after a stale keep-alive connection, and nothing else retried."""

from __future__ import annotations

import asyncio

import pytest

from kvstream.types import BackendError, BackendUnavailable
from kvstream.backends.http import UpstreamSession

pytestmark = pytest.mark.timeout(30)

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\nConnection: keep-alive\r\n\r\n{\"ok\":true}"


async def closing_server(requests_per_connection: int):
    """A server that, like llama-server, silently closes a kept-alive connection after a few
    requests: the client only learns when it sends the next request on it."""
    served = {"requests": 0, "connections": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served["connections"] += 1
        for n in range(requests_per_connection + 1):
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            if n == requests_per_connection:
                break  # the request arrived on a connection we are done with: drop it unanswered
            served["requests"] += 1
            writer.write(RESPONSE)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, served


async def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one():
    server, served = await closing_server(requests_per_connection=1)
    port = server.sockets[0].getsockname()[1]
    session = UpstreamSession(f"http://127.0.0.1:{port}", connect_timeout=2, read_timeout=5, headers={})
    try:
        for _ in range(5):
            assert await session.post_json("/x", {"a": 1}) == {"ok": True}
        assert served["requests"] == 5
    finally:
        await session.close()
        server.close()


async def test_connection_refused_is_unavailable_not_retried_forever(unused_tcp_port):
    session = UpstreamSession(f"http://127.0.0.1:{unused_tcp_port}", connect_timeout=2, read_timeout=5, headers={})
    try:
        with pytest.raises(BackendUnavailable, match="cannot connect"):
            await session.get_json("/health")
    finally:
        await session.close()


async def test_a_hanging_runtime_times_out_with_504():
    async def hang(reader, writer):
        await asyncio.sleep(30)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    session = UpstreamSession(f"http://127.0.0.1:{port}", connect_timeout=1, read_timeout=0.5, headers={})
    try:
        with pytest.raises(BackendError) as err:
            async with session.request("POST", "/v1/chat/completions", json_body={}) as resp:
                await resp.read()
        assert err.value.status == 504
    finally:
        await session.close()
        server.close()


async def test_upstream_cookies_are_never_replayed():
    """One client's Set-Cookie from the runtime must not ride along on another's request."""
    from aiohttp import web

    seen: list[str | None] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        response = web.json_response({"ok": True})
        response.set_cookie("session", "client-a-secret")
        return response

    app = web.Application()
    app.router.add_post("/x", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    # A host name, not an IP: aiohttp's default jar would keep this cookie.
    session = UpstreamSession(f"http://localhost:{port}", connect_timeout=2, read_timeout=5, headers={})
    try:
        for _ in range(3):
            assert await session.post_json("/x", {}) == {"ok": True}
        assert seen == [None, None, None]
    finally:
        await session.close()
        await runner.cleanup()


def test_api_root_drops_only_a_trailing_v1():
    from kvstream.backends.http import api_root

    assert api_root("http://127.0.0.1:1234/v1") == "http://127.0.0.1:1234"
    assert api_root("http://127.0.0.1:1234/v1/") == "http://127.0.0.1:1234"
    assert api_root("https://gateway.example/llm/v1") == "https://gateway.example/llm"  # a gateway's prefix stays
    assert api_root("http://127.0.0.1:11434") == "http://127.0.0.1:11434"
    assert api_root("http://127.0.0.1:8080/v1beta") == "http://127.0.0.1:8080/v1beta"
    assert api_root("http://127.0.0.1:8080/api/v10") == "http://127.0.0.1:8080/api/v10"
    assert api_root("http://127.0.0.1:8080/v1?key=x") == "http://127.0.0.1:8080?key=x"
    assert api_root("") == ""
