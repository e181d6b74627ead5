"""An OpenAI-compatible upstream that answers at once: the baseline for proxy overhead.

    python benchmarks/_instant_upstream.py --port 9100 --tokens 8
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web


def _event(choices: list, **extra) -> bytes:
    obj = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "bench", "choices": choices, **extra}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def make_app(tokens: int) -> web.Application:
    """Chat completions with ``tokens`` tokens, streamed one event per token or whole."""
    usage = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens}
    token_events = [_event([{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]) for i in range(tokens)]
    tail = _event([{"index": 0, "delta": {}, "finish_reason": "length"}]) + _event([], usage=usage) + b"data: [DONE]\n\n"
    message = {"role": "assistant", "content": "".join(f"t{i} " for i in range(tokens))}
    whole = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "bench",
                        "choices": [{"index": 0, "message": message, "finish_reason": "length"}], "usage": usage}).encode()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=whole, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in token_events:
            await resp.write(event)
        await resp.write(tail)
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model", "created": 0, "owned_by": "bench"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    web.run_app(make_app(args.tokens), host="127.0.0.1", port=args.port, access_log=None, print=None)
