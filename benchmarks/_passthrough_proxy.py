"""The floor for any Python proxy: an aiohttp server that forwards the body to the
upstream and copies the answer back chunk by chunk, doing nothing else.

    python benchmarks/_passthrough_proxy.py --port 9101 --upstream http://127.0.0.1:9100

proxy_overhead.py runs it beside KVStream, so KVStream's cost is judged against what a
pass-through costs on the same machine in the same run.
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

SESSION = web.AppKey("session", aiohttp.ClientSession)


def make_app(upstream: str) -> web.Application:
    async def open_session(app: web.Application):
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        async with request.app[SESSION].post(upstream + request.path, data=body, headers=headers) as up:
            response = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "")})
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.cleanup_ctx.append(open_session)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", health)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    web.run_app(make_app(args.upstream), host="127.0.0.1", port=args.port, access_log=None, print=None)
