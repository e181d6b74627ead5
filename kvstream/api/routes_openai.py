"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models.

Each generation goes through the engine (queue, admission, KV accounting); the response is
written token by token the moment the backend yields it.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import replace
from pathlib import PurePath
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from kvstream.api import cors, llama_timings
from kvstream.api.body import read_bytes
from kvstream.api.errors import REQUEST_ID, APIError, counted, failure_outcome, from_exception, json_body_error
from kvstream.api.openai_format import DONE, Aggregate, StreamFormatter
from kvstream.api.prompt_batch import PromptBatch
from kvstream.api.schemas import ChatCompletionRequest, CompletionRequest, WarmRequest, forwarded_request
from kvstream.api.routes_passthrough import forward, managed_route_headers
from kvstream.api.state import CACHE_SALT, KEY_IN_FLIGHT, STATE, AppState
from kvstream.api.stream_sessions import CONVERSATION_HEADER, STREAM_SESSIONS, StreamSession, answer_following
from kvstream.api.streaming import GuardedResponse
from kvstream.types import BackendError, BackendRejected, BackendUnavailable, GenerateRequest, RequestControl, Token
from kvstream.engine import Generation
from kvstream.jsonfast import dumps, loads
from kvstream.scheduler import Priority, SchedulerError

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()

PRIORITY_HEADER = "X-KVStream-Priority"


async def read_object(request: web.Request) -> dict[str, Any]:
    """The JSON object body: 400 if it is not JSON or not an object, 413 past the limit,
    408 past the body timeout (a compressed body is inflated, bounded)."""
    raw = await read_bytes(request)
    try:
        data = loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise json_body_error(exc) from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    return data


async def read_body(request: web.Request, model: type[BaseModel]) -> Any:
    """Parse and validate a JSON body; 400 ``invalid_request_error`` for any bad value, as
    OpenAI answers (never 422)."""
    data = await read_object(request)
    check_message_count(request.app[STATE], data.get("messages"))  # before validating them all
    return validated(data, model)


def validated(data: dict[str, Any], model: type[BaseModel]) -> Any:
    """``data`` as ``model``; 400 ``invalid_request_error`` naming the first bad value."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        raise APIError(400, f"Invalid value for '{loc}': {message}." if loc else f"{message}.", param=loc or None, code="invalid_value") from None


DEADLINE_HEADER = "X-KVStream-Deadline-Ms"
# Several replicas: requests with the same session id go to the same replica.
SESSION_HEADER = "X-KVStream-Session"


def parse_deadline(request: web.Request) -> float | None:
    """The client's own queue deadline in seconds (``X-KVStream-Deadline-Ms``), if it sent
    one: past it, waiting for a slot is pointless and the request gets 503."""
    value = request.headers.get(DEADLINE_HEADER)
    if value is None:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if not 0 < ms < 86_400_000 or ms != ms:
        raise APIError(400, f"{DEADLINE_HEADER} must be a positive number of milliseconds.", param=DEADLINE_HEADER, code="invalid_value")
    return ms / 1000


def parse_priority(request: web.Request, body_value: object) -> Priority:
    value = request.headers.get(PRIORITY_HEADER, body_value)
    if value is None:
        return Priority.NORMAL
    try:
        return Priority.parse(value)
    except ValueError as exc:
        raise APIError(400, str(exc), param="priority", code="invalid_value") from None


async def resolve_model(state: AppState, name: str) -> str:
    """The runtime's id for ``name``: the configured alias, an exact id, or its file name with
    or without the extension (llama-server names its model by path). A name the runtime does
    not list is served by its one model when it serves a single model (the model fallback);
    otherwise 404, as the runtime would answer."""
    backend = state.settings.backend
    name = backend.model_aliases.get(name, name)
    try:
        models = await state.engine.models()
    except BackendError:
        return name  # the runtime is down; the request itself will get the 503
    if not models:
        return name
    configured = state.engine.backend.model
    if configured and name == configured:
        return name
    resolved = model_aliases(models).get(name)
    if resolved is not None:
        return resolved
    fallback = backend.model_fallback if backend.model_fallback is not None else state.engine.backend.serves_any_model_name
    if fallback and len(models) == 1:
        return models[0].id
    known = ", ".join(m.id for m in models[:10])
    raise APIError(404, f"The model '{name}' does not exist on this server (available: {known}).", param="model", code="model_not_found")


# Model file extensions a runtime may name its model by (llama-server: its path).
MODEL_FILE_SUFFIXES = frozenset({".gguf", ".ggml", ".bin"})


@functools.lru_cache(maxsize=8)
def _aliases(ids: tuple[str, ...]) -> dict[str, str]:
    aliases: dict[str, str] = {}
    for model_id in reversed(ids):  # the first model wins a shared alias
        path = PurePath(model_id)
        aliases[path.name] = model_id
        if path.suffix.lower() in MODEL_FILE_SUFFIXES:  # (not "llama3.2:latest"'s ".2:latest")
            aliases[path.stem] = model_id
        if model_id.endswith(":latest"):  # Ollama's default tag: "llama3.2" is "llama3.2:latest" there
            aliases[model_id.removesuffix(":latest")] = model_id
        elif ":" not in path.name and path.suffix.lower() in MODEL_FILE_SUFFIXES:
            aliases[f"{path.stem}:latest"] = model_id
    # Apps written for Ollama send "qwen2.5-7b:latest" for an untagged id (LM Studio's, a GGUF's).
    aliases.update({f"{model_id}:latest": model_id for model_id in ids if ":" not in PurePath(model_id).name})
    aliases.update({model_id: model_id for model_id in ids})  # an exact id beats any alias
    return aliases


def model_aliases(models: list[Any]) -> dict[str, str]:
    """Every name a client may use for the runtime's models -> the model's id (computed
    once per model list: this runs on every request)."""
    return _aliases(tuple(m.id for m in models))


def retry_after(state: AppState) -> int:
    """Seconds a rejected client should wait: the queue ahead drained at the recent rate
    (the median end-to-end time of the last minute's requests, 1 s when there were none)."""
    sched = state.engine.scheduler
    per_request = state.engine.recent_e2e_median_s() or 1.0
    waves = (len(sched.waiting) + 1) / max(1, sched.config.max_batch_size)
    return max(1, min(60, math.ceil(per_request * waves)))


def _error_kind(exc: BackendError) -> str:
    if isinstance(exc, BackendUnavailable):
        return "unavailable"
    if isinstance(exc, BackendRejected):
        return "rejected"
    return "timeout" if exc.status == 504 else "error"


async def _parse(request: web.Request, state: AppState, chat: bool) -> tuple[list[GenerateRequest], Priority, bool, str | None]:
    """The request as the backend needs it (one per prompt of a completions batch), its
    priority, whether the client asked for the usage chunk, and the model name the client
    used (KVStream's own chunks echo it).

    A runtime that speaks OpenAI itself gets the client's body as it is and judges it; for
    a backend that translates (Ollama's native API, the in-process engine) KVStream
    validates the body first and answers 400 for what it cannot translate."""
    request_id = request[REQUEST_ID]
    prompts: list[str | list[int]] = []  # a translated completions request's prompts
    if state.engine.backend.forwards_body:
        data = await read_object(request)
        check_message_count(state, data.get("messages"))
        generate = forwarded_request(data, chat, request_id)
        generate.headers = managed_route_headers(request)
        priority = parse_priority(request, data.get("priority"))
        options = data.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
    else:
        body = await read_body(request, ChatCompletionRequest if chat else CompletionRequest)
        if body.candidates != 1 and not state.engine.backend.serves_n:
            field = "n" if body.n != 1 else "best_of"
            raise APIError(400, f"This backend serves one choice per request ({field} must be 1).", param=field,
                           code="unsupported_value")
        generate = body.to_generate(request_id)
        backend = state.engine.backend
        prompts = [] if chat else body.prompts()
        if any(isinstance(p, list) for p in prompts) and not backend.serves_token_prompts:
            raise APIError(400, f"The {backend.name} backend takes the prompt as text, not token ids.", param="prompt",
                           code="unsupported_value")
        if generate.echo and not backend.serves_echo:
            raise APIError(400, f"The {backend.name} backend does not echo the prompt.", param="echo", code="unsupported_value")
        generate.stream = body.stream
        generate.n = body.n
        # llama-server's report of the prompt's computation: one prompt's stream (a batch
        # of prompts streams several generations as one).
        generate.return_progress = body.stream and len(prompts) <= 1 and llama_timings.wants(generate.extra, "return_progress")
        priority = parse_priority(request, body.priority)
        include_usage = body.include_usage
    check_message_count(state, generate.messages)
    generate.cache_salt = request.get(CACHE_SALT)
    generate.queue_deadline_s = parse_deadline(request)
    generate.session = request.headers.get(SESSION_HEADER) or None
    named = generate.model
    if generate.model is not None:
        generate.model = await resolve_model(state, generate.model)
    elif not state.engine.backend.forwards_body and state.engine.backend.model is None:
        # No model named: a translating backend needs one, so the runtime's first serves.
        generate.model = await default_model(state)
    batch = [generate]
    if len(prompts) > 1:
        # The batch's other prompts: the same request otherwise, each its own generation.
        for i, prompt in enumerate(prompts[1:], start=1):
            other = body.to_generate(f"{request_id}.{i}", prompt)
            batch.append(replace(generate, prompt=other.prompt, prompt_token_ids=other.prompt_token_ids,
                                 request_id=other.request_id, control=RequestControl()))
    return batch, priority, include_usage, named


def check_message_count(state: AppState, messages: object, param: str = "messages") -> None:
    """413 past ``server.max_messages`` (every route that takes messages): on the body's list
    (``param``) as parsed, before it is validated or translated (validating 45,000 messages
    only to refuse them held the event loop, and every stream it serves, for a quarter of a
    second); again on the request made of it (a Responses conversation's stored turns)."""
    max_messages = state.settings.server.max_messages
    count = len(messages) if isinstance(messages, list) else 0
    if count > max_messages:
        raise APIError(413, f"Too many messages ({count}; the limit is {max_messages}).",
                       param=param, code="too_many_messages")


async def default_model(state: AppState) -> str | None:
    """The runtime's first model (None while it cannot be asked: the request gets the 503)."""
    try:
        models = await state.engine.models()
    except BackendError:
        return None
    return models[0].id if models else None


async def serving_model(state: AppState, name: str | None) -> str | None:
    """The model a request naming ``name`` (or none) is served by: the name resolved, else
    the configured model, else the runtime's first."""
    if name:
        return await resolve_model(state, name)
    return state.engine.backend.model or await default_model(state)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    arrived_at = time.monotonic()
    state = request.app[STATE]
    batch, priority, include_usage, named = await _parse(request, state, chat)
    generate = batch[0]
    request_id = request[REQUEST_ID]
    cors.follow_runtime(request, batch)
    try:
        gens = await state.engine.submit_all(batch, priority, arrived_at)
    except Exception as exc:
        if isinstance(exc, BackendError):
            state.engine.metrics.backend_errors.inc(_error_kind(exc))  # type: ignore[union-attr]
        raise from_exception(exc, retry_after(state)) from None
    gen: Generation | PromptBatch = gens[0] if len(gens) == 1 else PromptBatch(gens, generate.n)
    outcome = "cancelled"
    stream = aiter(gen)
    try:
        try:
            await gen.admitted()
        except Exception as exc:
            raise from_exception(exc, retry_after(state)) from None
        first = await _next(stream)
        hit, source = gen.verified_hit()
        headers = {
            "X-Request-Id": request_id,
            "X-KVStream-Queue-Ms": f"{gen.queue_ms:.1f}",
            "X-KVStream-Prefix-Hit-Tokens": str(hit),
            "X-KVStream-Prefix-Hit-Source": source,
        }
        if generate.control.replica is not None:  # several replicas: which one, and why
            headers["X-KVStream-Backend"] = generate.control.replica
            headers["X-KVStream-Route"] = generate.control.route or ""
        fmt = StreamFormatter(
            model=named or generate.model or "", chat=chat,
            include_usage=include_usage, n=generate.n * len(batch),
        )
        if isinstance(gen, Generation) and generate.stream and llama_timings.wants(generate.extra, "timings_per_token"):
            fmt.timings = functools.partial(llama_timings.of_generation, gen)
        if first.payload is not None:  # the runtime's own non-streamed answer, as it sent it
            outcome = "finished"
            return web.Response(body=dumps(first.payload), content_type="application/json", charset="utf-8", headers=headers)
        session_id = request.headers.get(CONVERSATION_HEADER)
        if generate.stream and session_id and state.engine.backend.upstream() is None:
            # llama-server's resumable stream: recorded, and run to its end whoever follows it.
            sessions = request.app[STREAM_SESSIONS]
            session = sessions.open(request.get(CACHE_SALT), session_id)
            sessions.run(session, _record(request, session, gen, stream, first, fmt), request.get(KEY_IN_FLIGHT))
            outcome = "detached"  # the recording's task holds the generation now
            return await answer_following(request, session, 0, headers)
        if generate.stream:
            response = GuardedResponse(
                headers=headers | {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
            outcome = await _write_stream(request, response, gen, stream, first, fmt)
            return response
        aggregate = Aggregate()
        token = first
        while token.finish_reason is None:
            aggregate.add(token)
            token = await _next(stream)
        aggregate.add(token)
        assert gen.usage is not None
        outcome = "finished"
        # The whole answer is in: the runtime's own count of what it reused, if it gave one.
        hit, headers["X-KVStream-Prefix-Hit-Source"] = gen.verified_hit()
        headers["X-KVStream-Prefix-Hit-Tokens"] = str(hit)
        build = aggregate.chat_response if chat else aggregate.completion_response
        return web.Response(body=dumps(build(fmt, gen.usage)), content_type="application/json", charset="utf-8", headers=headers)
    except BackendError as exc:
        outcome = failure_outcome(exc)
        state.engine.metrics.backend_errors.inc(_error_kind(exc))  # type: ignore[union-attr]
        log = logger.info if outcome == "refused" else logger.warning
        log("[%s] %s: %s", request_id, "the runtime refused the request" if outcome == "refused" else "backend error", exc.message)
        raise from_exception(exc, retry_after(state)) from None
    finally:
        if outcome != "detached":
            try:
                await _close_quietly(stream)
            finally:
                # Even if this handler is cancelled while closing (the client hung up right
                # after the last byte), the slot and the blocks must be released.
                gen.close(outcome)


async def _record(request: web.Request, session: StreamSession, gen: Generation | PromptBatch, stream: Any,
                  first: Token, fmt: StreamFormatter) -> None:
    """Write the stream into ``session`` to its end (or until stopped), then release it."""
    outcome = "cancelled"
    try:
        outcome = await _write_stream(request, session, gen, stream, first, fmt)
    finally:
        try:
            await _close_quietly(stream)
        finally:
            gen.close(outcome)


async def _next(stream: Any) -> Token:
    try:
        return await anext(stream)
    except StopAsyncIteration:
        raise BackendError("the runtime ended the stream without finishing the generation") from None


async def _close_quietly(stream: Any) -> None:
    try:
        await stream.aclose()
    except Exception as exc:  # the upstream is already gone; nothing more to release
        logger.warning("closing the upstream stream failed: %r", exc)


async def _write_stream(
    request: web.Request, response: web.StreamResponse | StreamSession, gen: Generation | PromptBatch, stream: Any,
    first: Token, fmt: StreamFormatter,
) -> str:
    """Write the SSE response; returns the outcome (finished, failed, cancelled)."""
    try:
        await response.prepare(request)  # the headers go out with the first write
        # The runtime's own chunks are forwarded when it sent them (its role chunk too);
        # otherwise KVStream builds OpenAI's framing itself.
        role = fmt.role_chunk() if first.events is None else None
        held = [role] if role else []
        token = first
        while token.finish_reason is None:
            if token.events is not None:
                held.append(fmt.forward(token.events))
            elif token.choice_finish_reason is not None:
                held.append(fmt.choice_finish_chunk(token))
            elif token.progress is not None:
                held.append(fmt.progress_chunk(token.progress))
            else:
                held.append(fmt.token_chunk(token))
            if not token.more:  # nothing else is ready: send what we hold now
                await response.write(b"".join(held))
                held.clear()
            token = await _next(stream)
        if token.events is not None:
            held.append(fmt.forward(token.events) + DONE)
        else:
            held.append(fmt.finish_chunks(token.finish_reason, gen.usage, token.index))
        await response.write_eof(b"".join(held))
        return "finished"
    except BackendError as exc:
        request.app[STATE].engine.metrics.backend_errors.inc(_error_kind(exc))  # type: ignore[union-attr]
        logger.warning("[%s] backend failed mid-stream: %s", request[REQUEST_ID], exc.message)
        try:
            await response.write(fmt.error_event(from_exception(exc).body()))
            await response.write_eof()
        except ConnectionError:
            pass  # the client is gone too: nobody is left to tell
        return "failed"
    except ConnectionError:
        return "cancelled"  # the client went away; the finally upstream cancels the runtime


# llama-server serves OpenAI's chat route without the /v1 prefix too. Its unprefixed
# /completions is its native completion route, not OpenAI's: that one passes through.
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
COMPLETION_PATHS = ("/v1/completions",)
GENERATION_PATHS = frozenset(CHAT_PATHS + COMPLETION_PATHS)


@counted("chat")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


@counted("completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


@counted("chat_count")
async def chat_input_tokens(request: web.Request) -> web.StreamResponse:
    """llama-server's ``/v1/chat/completions/input_tokens``: the prompt a chat body would
    make, counted as its generation counts it (exact with the model's or runtime's tokenizer,
    else estimated: the ``X-KVStream-Tokens`` header says which), as the other APIs' count
    routes are. A runtime that reads the body itself answers it (llama-server does)."""
    state = request.app[STATE]
    if state.engine.backend.forwards_body:
        return await forward(request)
    generate = (await read_body(request, ChatCompletionRequest)).to_generate(request[REQUEST_ID])
    check_message_count(state, generate.messages)
    generate.cache_salt = request.get(CACHE_SALT)
    generate.model = await serving_model(state, generate.model)
    ids, exact = await state.engine.prompt_tokens(generate)
    return web.json_response({"input_tokens": len(ids), "object": "response.input_tokens"},
                             headers={"X-KVStream-Tokens": "exact" if exact else "estimated"})


for _path in CHAT_PATHS:
    routes.post(_path)(chat_completions)
    routes.post(_path + "/input_tokens")(chat_input_tokens)
for _path in COMPLETION_PATHS:
    routes.post(_path)(completions)


WARM_PATH = "/v1/warm"


@routes.post(WARM_PATH)
@counted("warm")
async def warm(request: web.Request) -> web.Response:
    """Prefill a prefix (KVStream's own route): queued at low priority like any request,
    under the same limits (message count, per-key concurrency) and counted as one."""
    state = request.app[STATE]
    body = await read_body(request, WarmRequest)
    generate = body.to_generate(request[REQUEST_ID])
    check_message_count(state, generate.messages)
    generate.cache_salt = request.get(CACHE_SALT)
    try:
        generate.model = await serving_model(state, body.model)
        result = await state.engine.warm(generate)
    except (SchedulerError, BackendError) as exc:
        raise from_exception(exc, retry_after(state)) from None
    return web.json_response({"object": "kvstream.warm", "model": generate.model, **result})


def _model_object(info: Any) -> dict[str, Any]:
    return {"id": info.id, "object": "model", "created": info.created, "owned_by": info.owned_by}


async def list_models(request: web.Request) -> web.StreamResponse:
    """The runtime's own list when it speaks OpenAI (every field it sends kept), else the
    models as KVStream knows them."""
    state = request.app[STATE]
    if state.engine.backend.forwards_body:
        return await forward(request)
    try:
        models = await state.engine.models()
    except BackendError as exc:
        raise from_exception(exc) from None
    return web.json_response({"object": "list", "data": [_model_object(m) for m in models]})


async def get_model(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if state.engine.backend.forwards_body:
        return await forward(request)
    name = await resolve_model(state, request.match_info["model"])
    for info in await state.engine.models():
        if info.id == name:
            return web.json_response(_model_object(info))
    raise APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")


for _prefix in ("/v1", ""):
    routes.get(f"{_prefix}/models")(list_models)
    routes.get(f"{_prefix}/models/{{model:.+}}")(get_model)
