"""Anthropic's Messages API, ``POST /v1/messages``: what the ``anthropic`` SDK and the agents
built on it send.

In front of a runtime that speaks OpenAI itself (llama-server, which serves ``/v1/messages``
too; vLLM, LM Studio...) the route passes through to the runtime's own, admitted like any
generation. In front of a backend KVStream translates for (the in-process engine, Ollama's
native API, as the chat route does) KVStream answers it: the body is read as the chat
completion it amounts to (messages_format.py), validated and run on the same path as
``/v1/chat/completions`` (queue, admission, prefix cache, tool calls, thinking), and answered
as Anthropic's message or, streamed, as its events; errors in Anthropic's shape.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web
from pydantic import ValidationError

from kvstream.api.errors import ERROR_SHAPE, REQUEST_ID, APIError, counted, from_exception
from kvstream.api.messages_format import MessageAnswer, chat_body, messages_error
from kvstream.api.routes_openai import (
    _error_kind,
    _next,
    check_message_count,
    default_model,
    parse_deadline,
    parse_priority,
    read_object,
    resolve_model,
    retry_after,
)
from kvstream.api.routes_passthrough import forward
from kvstream.api.schemas import ChatCompletionRequest
from kvstream.api.state import CACHE_SALT, STATE
from kvstream.api.streaming import GuardedResponse
from kvstream.jsonfast import dumps
from kvstream.types import BackendError

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()


def sse(event: dict) -> bytes:
    """One event as Anthropic streams it: its type named on the ``event:`` line."""
    return b"event: " + event["type"].encode() + b"\ndata: " + dumps(event) + b"\n\n"


@counted("messages")
async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    backend = state.engine.backend
    if backend.forwards_body:
        return await forward(request)  # the runtime's own Messages API
    request[ERROR_SHAPE] = messages_error  # every error of this request in Anthropic's shape
    arrived_at = time.monotonic()
    data = await read_object(request)
    try:
        body = ChatCompletionRequest.model_validate(chat_body(data))
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = ".".join(str(p) for p in error["loc"]) or None
        message = error["msg"].removeprefix("Value error, ")
        raise messages_error(APIError(400, f"{loc}: {message}" if loc else message, param=loc)) from None
    request_id = request[REQUEST_ID]
    generate = body.to_generate(request_id)
    generate.stream = data.get("stream") is True
    check_message_count(state, generate)
    generate.cache_salt = request.get(CACHE_SALT)
    generate.queue_deadline_s = parse_deadline(request)
    priority = parse_priority(request, None)
    named = generate.model
    generate.model = await resolve_model(state, generate.model) if generate.model else state.engine.backend.model or await default_model(state)
    try:
        gen = await state.engine.submit(generate, priority, arrived_at)
    except Exception as exc:
        if isinstance(exc, BackendError):
            state.engine.metrics.backend_errors.inc(_error_kind(exc))  # type: ignore[union-attr]
        raise from_exception(exc, retry_after(state)) from None
    answer = MessageAnswer(named or generate.model or "")
    outcome = "cancelled"
    stream = aiter(gen)
    try:
        try:
            await gen.admitted()
            first = await _next(stream)
        except Exception as exc:
            raise from_exception(exc, retry_after(state)) from None
        headers = {"X-Request-Id": request_id, "X-KVStream-Queue-Ms": f"{gen.queue_ms:.1f}"}
        token = first
        if not generate.stream:
            while token.finish_reason is None:
                answer.add(token)
                token = await _next(stream)
            answer.add(token)
            message, _ = answer.finish(token.finish_reason, gen.usage)
            outcome = "finished"
            return web.Response(body=dumps(message), content_type="application/json", charset="utf-8", headers=headers)
        out = GuardedResponse(headers=headers | {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                 "X-Accel-Buffering": "no"})
        await out.prepare(request)
        try:
            held = [sse(event) for event in answer.started(len(gen.seq.prompt_token_ids))]
            while token.finish_reason is None:
                held += [sse(event) for event in answer.add(token)]
                if not token.more:
                    await out.write(b"".join(held))
                    held.clear()
                token = await _next(stream)
            held += [sse(event) for event in answer.add(token)]
            _, events = answer.finish(token.finish_reason, gen.usage)
            await out.write_eof(b"".join(held + [sse(event) for event in events]))
            outcome = "finished"
        except BackendError as exc:
            outcome = "failed"
            logger.warning("[%s] backend failed mid-stream: %s", request_id, exc.message)
            try:
                await out.write_eof(sse(messages_error(from_exception(exc)).body()))
            except ConnectionError:
                pass
        except ConnectionError:
            pass  # the client went away: the finally below cancels the generation
        return out
    except BackendError as exc:
        outcome = "failed"
        state.engine.metrics.backend_errors.inc(_error_kind(exc))  # type: ignore[union-attr]
        raise from_exception(exc, retry_after(state)) from None
    finally:
        try:
            await stream.aclose()
        finally:
            gen.close(outcome)


routes.post("/v1/messages")(create_message)
