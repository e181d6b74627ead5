"""Another vendor's generation API served on the chat route's path: OpenAI's Responses API
(routes_responses.py) and Anthropic's Messages API (routes_messages.py).

In front of a runtime that speaks OpenAI itself, whose own implementation of the API is the
one the client means, the route passes through, admitted like any generation
(routes_passthrough.py). In front of a backend KVStream translates for (the in-process engine,
Ollama's native API, as the chat route does) ``serve`` answers it: the body is read as the
chat completion it amounts to (the API's ``chat_body``), validated by the chat route's own
schema and run on its path (queue, admission, prefix cache, tool calls, structured output,
thinking), and each token becomes the API's objects or, streamed, its server-sent events
(the API's answer builder). Every error of the request is answered in the API's shape
(``ERROR_SHAPE``), naming the API's own fields. Streamed with llama-server's
``X-Conversation-Id`` where KVStream is the runtime, the events are recorded and followed
again as the chat route's are (stream_sessions.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from pydantic import ValidationError

from kvstream.api import cors, llama_timings
from kvstream.api.errors import ERROR_SHAPE, REQUEST_ID, APIError, counted, failure_outcome, from_exception
from kvstream.api.routes_openai import (
    _error_kind,
    _next,
    check_message_count,
    parse_deadline,
    parse_priority,
    read_object,
    retry_after,
    serving_model,
)
from kvstream.api.routes_passthrough import forward
from kvstream.api.schemas import ChatCompletionRequest
from kvstream.api.state import CACHE_SALT, KEY_IN_FLIGHT, STATE
from kvstream.api.stream_sessions import CONVERSATION_HEADER, STREAM_SESSIONS, StreamSession, answer_following
from kvstream.api.streaming import GuardedResponse
from kvstream.jsonfast import dumps
from kvstream.types import BackendError, GenerateRequest, Token, Usage

if TYPE_CHECKING:
    from kvstream.engine import Generation

logger = logging.getLogger(__name__)


class Answer(Protocol):
    """One generation's answer in the API's terms."""

    def started(self, prompt_tokens: int) -> list[dict[str, Any]]:
        """The events before the first token."""

    def add(self, token: Token) -> list[dict[str, Any]]:
        """The events one token makes."""

    def finish(self, last: Token, usage: Usage | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The whole answer, and the events that end its stream (``last``: the stream's last
        token, which says why it ended)."""

    def error_event(self, error: APIError) -> dict[str, Any]:
        """The event that ends a stream the runtime failed."""


@dataclass(frozen=True)
class TranslatedAPI:
    """What one API needs said: its body as a chat body, its answer, its error shape, and its
    token-count answer."""

    chat_body: Callable[[dict[str, Any]], dict[str, Any]]  # APIError (400) for what cannot be said so
    answer: Callable[[dict[str, Any], str], Answer]  # (the client's body, the model name it used)
    error_shape: Callable[[APIError], APIError]
    invalid: Callable[[str | None, str], APIError]  # (the chat field, the validation message) -> its 400
    counted: Callable[[int], dict[str, Any]]  # the count route's answer for this many prompt tokens
    count_defaults: dict[str, Any]  # what a count body may leave out that a generation needs
    # The body as the request means it, before it is translated (a Responses body continuing a
    # stored response: the conversation it continues put before its input); APIError if not.
    prepare: Callable[[web.Request, dict[str, Any]], dict[str, Any]] = lambda request, body: body
    # Called with each whole answer served (the prepared body, the answer): where it is kept.
    keep: Callable[[web.Request, dict[str, Any], dict[str, Any]], None] = lambda request, body, answer: None
    # Where a body asks to run detached from its request (the Responses API's ``background``):
    # called with the request, the prepared body, the submitted generation and its answer,
    # it takes the generation over and answers the request. None: nothing runs detached.
    detach: Callable[[web.Request, dict[str, Any], Any, Answer], Awaitable[web.StreamResponse]] | None = None
    # Fits the request to the model's context where the body asks it to (the Responses API's
    # ``truncation: "auto"``): called with the engine, the request and the prepared body.
    fit: Callable[[Any, GenerateRequest, dict[str, Any]], Awaitable[None]] | None = None
    # llama-server's extras of the API, streamed where a body asks: its answer's progress
    # reports (``return_progress``), and ``timings`` (``timings_per_token``) on these events
    # (the last event of the stream has them too). Empty: the API has none.
    timed_events: frozenset[str] = frozenset()
    # The body's list of turns, counted against ``server.max_messages`` as parsed, before it
    # is prepared or translated (Anthropic's messages, each one chat message or more; the
    # Responses API's input items, each at most one); the chat it becomes is counted after.
    turns_field: str | None = None


def sse(event: dict[str, Any]) -> bytes:
    """One event as both APIs stream them: its type named on the ``event:`` line."""
    return b"event: " + event["type"].encode() + b"\ndata: " + dumps(event) + b"\n\n"


async def count(request: web.Request, api: TranslatedAPI) -> web.StreamResponse:
    """The API's token-count route (Anthropic's ``/v1/messages/count_tokens``, OpenAI's
    ``/v1/responses/input_tokens``): the prompt the body would make, counted as a generation
    counts it (exact with the model's or runtime's tokenizer, else estimated: the
    ``X-KVStream-Tokens`` header says which). Passed through where ``serve`` passes through."""
    state = request.app[STATE]
    if state.engine.backend.forwards_body:
        return await forward(request)
    generate, _, _ = await _generate_request(request, api, api.count_defaults)
    ids, exact = await state.engine.prompt_tokens(generate)
    return web.json_response(api.counted(len(ids)), headers={"X-KVStream-Tokens": "exact" if exact else "estimated"})


async def _generate_request(request: web.Request, api: TranslatedAPI,
                            defaults: dict[str, Any]) -> tuple[GenerateRequest, dict[str, Any], str | None]:
    """The GenerateRequest the API's body amounts to (its model resolved), the body, and the
    model name the client used."""
    state = request.app[STATE]
    data = await read_object(request)
    if api.turns_field is not None:
        check_message_count(state, data.get(api.turns_field), api.turns_field)
    data = api.prepare(request, data)
    try:
        body = ChatCompletionRequest.model_validate(api.chat_body(defaults | data))
    except ValidationError as exc:
        error = exc.errors()[0]
        raise api.invalid(".".join(str(p) for p in error["loc"]) or None, error["msg"].removeprefix("Value error, ")) from None
    generate = body.to_generate(request[REQUEST_ID])
    check_message_count(state, generate.messages)
    generate.cache_salt = request.get(CACHE_SALT)
    named = generate.model
    generate.model = await serving_model(state, named)
    return generate, data, named


async def serve(request: web.Request, api: TranslatedAPI) -> web.StreamResponse:
    """Answer ``request`` in ``api``'s terms (or pass it through: see the module docstring)."""
    state = request.app[STATE]
    backend = state.engine.backend
    if backend.forwards_body:
        return await forward(request)  # the runtime's own
    arrived_at = time.monotonic()
    generate, data, named = await _generate_request(request, api, {})
    # This API's contract (OpenAI's Responses, Anthropic's Messages): a 400 for a prompt past
    # the context, whatever the runtime behind would make of it.
    generate.refuse_past_context = True
    if api.fit is not None:
        await api.fit(state.engine, generate, data)
    request_id = request[REQUEST_ID]
    generate.stream = data.get("stream") is True
    extras = bool(api.timed_events) and generate.stream
    generate.return_progress = extras and llama_timings.wants(data, "return_progress")
    timed = extras and llama_timings.wants(data, "timings_per_token")
    generate.queue_deadline_s = parse_deadline(request)
    priority = parse_priority(request, data.get("priority"))
    cors.follow_runtime(request, [generate])
    try:
        gen = await state.engine.submit(generate, priority, arrived_at)
    except Exception as exc:
        if isinstance(exc, BackendError):
            state.engine.metrics.backend_errors.inc(_error_kind(exc))  # type: ignore[union-attr]
        raise from_exception(exc, retry_after(state)) from None
    answer = api.answer(data, named or generate.model or "")
    if api.detach is not None and data.get("background") is True:
        return await api.detach(request, data, gen, answer)
    outcome = "cancelled"
    stream = aiter(gen)
    try:
        try:
            await gen.admitted()
            token = await _next(stream)
        except Exception as exc:
            raise from_exception(exc, retry_after(state)) from None
        headers = {"X-Request-Id": request_id, "X-KVStream-Queue-Ms": f"{gen.queue_ms:.1f}"}
        if not generate.stream:
            while token.finish_reason is None:
                answer.add(token)
                token = await _next(stream)
            answer.add(token)
            whole, _ = answer.finish(token, gen.usage)
            api.keep(request, data, whole)
            outcome = "finished"
            return web.Response(body=dumps(whole), content_type="application/json", charset="utf-8", headers=headers)
        session_id = request.headers.get(CONVERSATION_HEADER)
        if session_id and backend.upstream() is None:
            # llama-server's resumable stream (stream_sessions.py): recorded, and run to its end
            # whoever follows it; the generation goes to the recording's task.
            sessions = request.app[STREAM_SESSIONS]
            session = sessions.open(request.get(CACHE_SALT), session_id)
            sessions.run(session, _record(request, session, api, data, gen, stream, answer, token, timed),
                         request.get(KEY_IN_FLIGHT))
            outcome = "detached"
            return await answer_following(request, session, 0, headers)
        out = GuardedResponse(headers=headers | {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                 "X-Accel-Buffering": "no"})
        outcome = await _write_events(request, out, api, data, gen, stream, answer, token, timed)
        return out
    except BackendError as exc:
        outcome = failure_outcome(exc)
        state.engine.metrics.backend_errors.inc(_error_kind(exc))  # type: ignore[union-attr]
        raise from_exception(exc, retry_after(state)) from None
    finally:
        if outcome != "detached":
            await _release(gen, stream, outcome)


async def _release(gen: Generation, stream: Any, outcome: str) -> None:
    try:
        await stream.aclose()
    finally:
        gen.close(outcome)


async def _record(request: web.Request, session: StreamSession, api: TranslatedAPI, data: dict[str, Any],
                  gen: Generation, stream: Any, answer: Answer, first: Token, timed: bool) -> None:
    """Write the stream into ``session`` to its end (or until stopped), then release it."""
    outcome = "cancelled"
    try:
        outcome = await _write_events(request, session, api, data, gen, stream, answer, first, timed)
    finally:
        await _release(gen, stream, outcome)


async def _write_events(request: web.Request, out: web.StreamResponse | StreamSession, api: TranslatedAPI,
                        data: dict[str, Any], gen: Generation, stream: Any, answer: Answer, token: Token,
                        timed: bool) -> str:
    """The API's events from ``token`` on, written to ``out`` (the client's response, or a
    recording); returns the outcome (finished, failed, cancelled)."""
    await out.prepare(request)

    def timed_events(token: Token) -> list[dict[str, Any]]:
        """The events ``token`` makes, with timings where asked."""
        events = answer.add(token)
        if timed:
            for event in events:
                if event["type"] in api.timed_events:
                    event["timings"] = (llama_timings.progress_timings(token.progress) if token.progress is not None
                                        else llama_timings.of_generation(gen))
        return events

    try:
        held = [sse(event) for event in answer.started(len(gen.seq.prompt_token_ids))]
        while token.finish_reason is None:
            held += [sse(event) for event in timed_events(token)]
            if not token.more:  # nothing else is ready: send what we hold now
                await out.write(b"".join(held))
                held.clear()
            token = await _next(stream)
        held += [sse(event) for event in timed_events(token)]
        whole, events = answer.finish(token, gen.usage)
        if timed and events:
            events[-1]["timings"] = llama_timings.of_generation(gen)
        api.keep(request, data, whole)  # before the last event: a client continuing at once finds it
        await out.write_eof(b"".join(held + [sse(event) for event in events]))
        return "finished"
    except BackendError as exc:
        logger.warning("[%s] backend failed mid-stream: %s", request[REQUEST_ID], exc.message)
        try:
            await out.write_eof(sse(answer.error_event(api.error_shape(from_exception(exc)))))
        except ConnectionError:
            pass  # the client is gone too: nobody is left to tell
        return "failed"
    except ConnectionError:
        return "cancelled"  # the client went away: the generation is cancelled on the way out


def api_routes(api: TranslatedAPI, label: str, paths: tuple[str, ...], count_suffix: str) -> web.RouteTableDef:
    """The API's generation route at each of ``paths`` and its token-count route at each
    path + ``count_suffix``, counted in ``kvstream_requests_total`` as ``label`` and
    ``label``_count."""
    routes = web.RouteTableDef()

    @counted(label)
    async def generation(request: web.Request) -> web.StreamResponse:
        return await serve(request, api)

    @counted(f"{label}_count")
    async def token_count(request: web.Request) -> web.StreamResponse:
        return await count(request, api)

    for handler in (generation, token_count):
        setattr(handler, ERROR_SHAPE, api.error_shape)  # every error of these routes in the API's shape
    for path in paths:
        routes.post(path)(generation)
        routes.post(path + count_suffix)(token_count)
    return routes
