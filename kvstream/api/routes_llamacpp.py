"""llama-server's own routes where KVStream is the runtime: ``POST /completion`` (and its
other name ``/completions``), ``/infill``, ``/tokenize``, ``/detokenize`` and
``/apply-template``, ``GET /props`` and ``/slots``, and ``GET`` / ``DELETE /v1/stream``
(a stream sent with ``X-Conversation-Id``, here or on the OpenAI routes, followed again or
stopped: stream_sessions.py).

In front of a runtime these paths are the runtime's and pass through unchanged
(routes_passthrough.py): llama-server answers them itself. With no runtime behind KVStream
(the in-process engine) they are answered here as llama-server answers them
(llamacpp_format.py), on the same path as every generation (queue, admission, prefix cache),
so that a client written for llama-server works with the embedded model too. Their errors
come in llama-server's shape. A batch of prompts is answered as a list, each prompt its own
generation; streamed, one prompt at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvstream import __version__
from kvstream.api import cors
from kvstream.api import llamacpp_format as fmt
from kvstream.api.errors import REQUEST_ID, APIError, counted, failure_outcome, from_exception
from kvstream.api.llamacpp_format import CompletionAnswer, LlamaCppError, invalid
from kvstream.api.routes_openai import (
    _next,
    default_model,
    parse_deadline,
    parse_priority,
    read_body,
    read_object,
    retry_after,
    serving_model,
)
from kvstream.api.routes_passthrough import passthrough
from kvstream.api.schemas import ChatCompletionRequest
from kvstream.api.state import CACHE_SALT, KEY_IN_FLIGHT, STATE, AppState
from kvstream.api.stream_sessions import CONVERSATION_HEADER, STREAM_SESSIONS, StreamSession, answer_following
from kvstream.api.streaming import GuardedResponse
from kvstream.jsonfast import dumps
from kvstream.scheduler import Priority, SchedulerError
from kvstream.types import BackendError, GenerateRequest, InfillParts, RuntimeLimits, Token

if TYPE_CHECKING:
    from kvstream.backends.base import BaseBackend
    from kvstream.engine import Generation

logger = logging.getLogger(__name__)

routes = web.RouteTableDef()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The engine's (OpenAI's) names of fields this API sends under its own, for its errors.
OWN_NAMES = {"response_format": "json_schema", "logprobs": "n_probs"}


def answered_here(label: str) -> Callable[[Handler], Handler]:
    """The route answered by ``handler`` (counted as ``label``, errors in llama-server's
    shape) where there is no runtime; passed through to the runtime where there is one."""

    def wrap(handler: Handler) -> Handler:
        local = counted(label)(handler)

        @functools.wraps(handler)
        async def route(request: web.Request) -> web.StreamResponse:
            state = request.app[STATE]
            if state.engine.backend.upstream() is not None:
                return await passthrough(request)
            try:
                return await local(request)
            except LlamaCppError:
                raise
            except (APIError, SchedulerError, BackendError) as exc:
                error = from_exception(exc, retry_after(state))
                message, param = error.message, error.param
                if param in OWN_NAMES:  # the engine's name for a field this API names otherwise
                    message, param = message.replace(f"'{param}'", f"'{OWN_NAMES[param]}'"), OWN_NAMES[param]
                raise LlamaCppError(error.status, message, code=error.code, param=param,
                                    retry_after=error.retry_after) from None

        return route

    return wrap


def _tokenizer(state: AppState) -> Callable[[str, bool], list[int]]:
    """``(text, add_special) -> ids`` by the model's tokenizer (special tokens' spellings read
    as those tokens, as llama-server reads prompts)."""
    backend = state.engine.backend

    def tokenize(text: str, add_special: bool) -> list[int]:
        ids = backend.text_tokens(text, add_special=add_special, parse_special=True)
        if ids is None:  # a backend with neither a runtime nor a tokenizer (tests' doubles)
            raise LlamaCppError(404, "This backend has no tokenizer to serve llama-server's routes with.", code="unknown_route")
        return ids

    return tokenize


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be true or false.", name)
    return value


@routes.post("/tokenize")
@answered_here("llamacpp_tokenize")
async def tokenize(request: web.Request) -> web.StreamResponse:
    """``{"content", "add_special" (false), "parse_special" (true), "with_pieces" (false)}``
    -> ``{"tokens": [ids]}``, or with pieces ``[{"id", "piece"}]`` (a piece that is not
    whole UTF-8 as its bytes)."""
    state = request.app[STATE]
    body = await read_object(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise invalid("'content' must be a text.", "content")
    backend = state.engine.backend
    _tokenizer(state)("", False)  # 404 without a tokenizer
    add_special, parse_special = _flag(body, "add_special", False), _flag(body, "parse_special", True)
    # On a thread: a body of megabytes takes the tokenizer a while, which the loop must not wait for.
    ids = await asyncio.to_thread(backend.text_tokens, content, add_special, parse_special) or []
    if not _flag(body, "with_pieces", False):
        return web.json_response({"tokens": ids})
    pieces = []
    for token, raw in zip(ids, backend.token_bytes(ids) or [], strict=True):
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": token, "piece": piece})
    return web.json_response({"tokens": pieces})


@routes.post("/detokenize")
@answered_here("llamacpp_detokenize")
async def detokenize(request: web.Request) -> web.StreamResponse:
    """``{"tokens": [ids]}`` -> ``{"content": text}``."""
    state = request.app[STATE]
    body = await read_object(request)
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid("'tokens' must be a list of token ids.", "tokens")
    _tokenizer(state)("", False)
    try:
        content = await asyncio.to_thread(state.engine.backend.detokenize, tokens)
    except ValueError as exc:
        raise invalid(f"Invalid 'tokens': {exc}.", "tokens") from None
    return web.json_response({"content": content or ""})


@routes.post("/apply-template")
@answered_here("llamacpp_apply_template")
async def apply_template(request: web.Request) -> web.StreamResponse:
    """A chat body (``/v1/chat/completions``': messages, tools, ``chat_template_kwargs``...)
    -> ``{"prompt": text}``, the prompt the engine would compute for it, special tokens
    spelled out; ``add_generation_prompt: false`` leaves the assistant's header off,
    ``continue_final_message`` the assistant's last message open."""
    state = request.app[STATE]
    generate = (await read_body(request, ChatCompletionRequest)).to_generate(request[REQUEST_ID])
    backend = state.engine.backend
    _tokenizer(state)("", False)  # 404 without a tokenizer
    ids = await backend.tokenize(generate) or []
    return web.json_response({"prompt": await asyncio.to_thread(backend.detokenize, ids) or ""})


@routes.get("/props")
@answered_here("llamacpp_props")
async def props(request: web.Request) -> web.StreamResponse:
    """llama-server's server properties, of the in-process engine: the context a request may
    use, its batch lanes as slots, the default sampling, the chat template."""
    state = request.app[STATE]
    backend = state.engine.backend
    limits = await _ready_limits(state)
    model = await default_model(state) or ""  # the name it is served under
    return web.json_response({
        "default_generation_settings": {"n_ctx": limits.n_ctx_per_request, "params": fmt.default_settings(_server_defaults(backend))},
        "total_slots": limits.parallel,
        "model_alias": model,
        "model_path": backend.model or model,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True,
        "endpoint_props": False,
        "endpoint_metrics": True,
        "chat_template": backend.chat_template() or "",
        "build_info": f"kvstream {__version__}",
        "is_sleeping": False,
    })


@routes.get("/slots")
@answered_here("llamacpp_slots")
async def slots(request: web.Request) -> web.StreamResponse:
    """The engine's batch lanes as llama-server's slots (``?fail_on_no_slot=1``: 503 when
    every one is generating)."""
    state = request.app[STATE]
    limits = await _ready_limits(state)
    busy = len(state.engine.scheduler.running)
    lanes = limits.parallel or 0
    if request.query.get("fail_on_no_slot") not in (None, "", "0", "false") and busy >= lanes:
        raise LlamaCppError(503, "no slot available", code="no_slot_available")
    return web.json_response([{"id": i, "n_ctx": limits.n_ctx_per_request, "speculative": False, "is_processing": i < busy}
                              for i in range(lanes)])


@routes.post("/slots/{id_slot}")
@answered_here("llamacpp_slots_action")
async def slot_action(request: web.Request) -> web.StreamResponse:
    """Saving, restoring or erasing a slot: llama-server's 501 (the in-process engine has no slot files)."""
    raise LlamaCppError(501, "This server does not support slots action: the in-process engine keeps its KV in its "
                        "own prefix cache, not in slot files.", code="not_supported")


def _conversation(request: web.Request) -> str:
    conv_id = request.query.get("conv_id")
    if not conv_id:
        raise invalid("'conv_id' names the stream (the X-Conversation-Id it was sent with).", "conv_id")
    return conv_id


@routes.get("/v1/stream")
@answered_here("llamacpp_stream_resume")
async def stream_resume(request: web.Request) -> web.StreamResponse:
    """A recorded stream (``X-Conversation-Id``, stream_sessions.py) from byte ``from`` on,
    live while it runs; 404 if there is none under ``conv_id``."""
    offset = request.query.get("from", "0")
    if not offset.isdigit():
        raise invalid(f"'from' is a byte offset (an integer >= 0), not {offset!r}.", "from")
    session = request.app[STREAM_SESSIONS].get(request.get(CACHE_SALT), _conversation(request))
    if session is None:
        raise LlamaCppError(404, "File Not Found", code="not_found")
    return await answer_following(request, session, int(offset), {"X-Request-Id": request[REQUEST_ID]})


@routes.delete("/v1/stream")
@answered_here("llamacpp_stream_stop")
async def stream_stop(request: web.Request) -> web.StreamResponse:
    """Stop a recorded stream's generation and forget it: 204, whether there was one or not
    (llama-server's answer)."""
    await request.app[STREAM_SESSIONS].stop(request.get(CACHE_SALT), _conversation(request))
    return web.Response(status=204)


def _server_defaults(backend: BaseBackend) -> fmt.ServerDefaults:
    """The backend's defaults for a body that sets no bound or seed."""
    return fmt.ServerDefaults(backend.default_max_tokens(), backend.default_seed())


async def _ready_limits(state: AppState) -> RuntimeLimits:
    """The engine's limits; llama-server's 503 while the model loads."""
    limits = await state.engine.backend.limits()
    if limits.parallel is None:
        raise LlamaCppError(503, "Loading model", code="unavailable")
    return limits


async def _completion(request: web.Request) -> web.StreamResponse:
    """``/completion``: one prompt's answer, a batch's list of answers, or one prompt's stream."""
    arrived_at = time.monotonic()
    state = request.app[STATE]
    body = await read_object(request)
    if "prompt" not in body:
        raise invalid("'prompt' is required.", "prompt")
    # On a thread: the text pieces of a prompt mixing text and ids are tokenized here.
    prompts, batch = await asyncio.to_thread(fmt.prompts, body["prompt"], _tokenizer(state))
    return await _generate(request, body, prompts, batch, arrived_at)


@routes.post("/infill")
@answered_here("llamacpp_infill")
async def infill(request: web.Request) -> web.StreamResponse:
    """``/infill``: code between ``input_prefix`` and ``input_suffix``, answered as
    ``/completion`` answers; the prompt laid out as llama-server lays it out (other files of
    ``input_extra`` first) in the model's fill-in-the-middle tokens. A model without them
    answers llama-server's 501, whatever the body."""
    arrived_at = time.monotonic()
    state = request.app[STATE]
    backend = state.engine.backend
    body = await read_object(request)
    _tokenizer(state)("", False)  # 404 without a tokenizer
    try:
        parts = fmt.infill_parts(body)
    except LlamaCppError:  # a model without FIM tokens answers its 501 before any 400, as llama-server does
        await asyncio.to_thread(backend.infill_tokens, InfillParts("", ""))
        raise
    # On a thread: other files of megabytes take the tokenizer a while.
    ids = await asyncio.to_thread(backend.infill_tokens, parts)
    return await _generate(request, body, [ids or []], False, arrived_at, fill_in_middle=True)


async def _generate(request: web.Request, body: dict[str, Any], prompts: list[str | list[int]], batch: bool,
                    arrived_at: float, fill_in_middle: bool = False) -> web.StreamResponse:
    """``prompts`` generated as ``body`` asks (a batch as a list of answers, one prompt's
    stream as its events)."""
    state = request.app[STATE]
    tokenize = _tokenizer(state)
    end_ids = state.engine.backend.end_token_ids()
    requests = [fmt.generate_request(body, prompt, request[REQUEST_ID], tokenize, end_ids) for prompt in prompts]
    if batch and requests[0].stream:
        raise LlamaCppError(400, "Streaming several prompts at once is not served here: stream them one per request.",
                            param="stream", code="unsupported_parameter")
    named = requests[0].model
    model = await serving_model(state, named)
    priority = parse_priority(request, body.get("priority"))
    deadline = parse_deadline(request)
    for generate in requests:
        generate.model, generate.cache_salt, generate.queue_deadline_s = model, request.get(CACHE_SALT), deadline
        generate.fill_in_middle = fill_in_middle
    server = _server_defaults(state.engine.backend)
    answers = [CompletionAnswer(generate, body, named or model or "", index, server)
               for index, generate in enumerate(requests)]
    headers = {"X-Request-Id": request[REQUEST_ID]}
    cors.follow_runtime(request, requests)
    if requests[0].stream:
        return await _stream(request, requests[0], answers[0], priority, arrived_at, headers)
    try:
        async with asyncio.TaskGroup() as group:  # one failing cancels the others
            tasks = [group.create_task(_whole(state, generate, answer, priority, arrived_at))
                     for generate, answer in zip(requests, answers, strict=True)]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None  # the request's error: the first prompt's that failed
    results = [task.result() for task in tasks]
    return web.Response(body=dumps(results if batch else results[0]), content_type="application/json", headers=headers)


@dataclass
class _Run:
    """A submitted generation, its token stream, and how it ended (for its release)."""

    gen: Generation
    stream: AsyncGenerator[Token, None]
    outcome: str = "cancelled"


@contextlib.asynccontextmanager
async def _running(state: AppState, generate: GenerateRequest, priority: Priority, arrived_at: float) -> AsyncIterator[_Run]:
    """``generate`` submitted and admitted (a refusal raises here, before anything is sent);
    its stream closed and its generation released on the way out, as the run's outcome says."""
    gen = await state.engine.submit(generate, priority, arrived_at)
    run = _Run(gen, aiter(gen))
    try:
        await gen.admitted()
        yield run
    except BackendError as exc:
        run.outcome = failure_outcome(exc)
        raise
    finally:
        try:
            await run.stream.aclose()
        finally:
            gen.close(run.outcome)


async def _whole(state: AppState, generate: GenerateRequest, answer: CompletionAnswer, priority: Priority,
                 arrived_at: float) -> dict[str, Any]:
    async with _running(state, generate, priority, arrived_at) as run:
        token = await _next(run.stream)
        while token.finish_reason is None:
            answer.add(token, run.gen)
            token = await _next(run.stream)
        answer.add(token, run.gen)
        whole = answer.final(token, run.gen, _prompt_text(state, run.gen.seq.prompt_token_ids),
                             streamed=False)
        run.outcome = "finished"
        return whole


def _prompt_text(state: AppState, ids: list[int]) -> str:
    try:
        return state.engine.backend.detokenize(ids) or ""
    except ValueError:
        return ""


def _event(data: dict[str, Any]) -> bytes:
    """One server-sent event as llama-server sends them: ``data:`` alone, no ``[DONE]`` after the last."""
    return b"data: " + dumps(data) + b"\n\n"


async def _stream(request: web.Request, generate: GenerateRequest, answer: CompletionAnswer, priority: Priority,
                  arrived_at: float, headers: dict[str, str]) -> web.StreamResponse:
    state = request.app[STATE]
    async with contextlib.AsyncExitStack() as stack:
        run = await stack.enter_async_context(_running(state, generate, priority, arrived_at))
        first = await _next(run.stream)  # a failure before the first token is an HTTP error with its status
        session_id = request.headers.get(CONVERSATION_HEADER)
        if session_id:
            # llama-server's resumable stream: recorded, and run to its end whoever follows it;
            # the run (its stream and generation) goes to the recording's task.
            sessions = request.app[STREAM_SESSIONS]
            session = sessions.open(request.get(CACHE_SALT), session_id)
            sessions.run(session, _record(request, session, stack.pop_all(), run, answer, first), request.get(KEY_IN_FLIGHT))
            return await answer_following(request, session, 0, headers)
        out = GuardedResponse(headers=headers | {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                 "X-Accel-Buffering": "no"})
        await _write_events(request, out, run, answer, first)
        return out


async def _record(request: web.Request, session: StreamSession, held: contextlib.AsyncExitStack, run: _Run,
                  answer: CompletionAnswer, first: Token) -> None:
    """Write the stream into ``session`` to its end (or until stopped), then release the run."""
    async with held:
        await _write_events(request, session, run, answer, first)


async def _write_events(request: web.Request, out: web.StreamResponse | StreamSession, run: _Run,
                        answer: CompletionAnswer, token: Token) -> None:
    """The stream's events from ``token`` on, written to ``out`` (the client's response, or a
    recording); ``run.outcome`` says how it ended."""
    state = request.app[STATE]
    await out.prepare(request)
    try:
        held: list[bytes] = []
        while True:
            partial = answer.add(token, run.gen)
            if partial is not None:
                held.append(_event(partial))
            if token.finish_reason is not None:
                break
            if not token.more:  # nothing else is ready: send what is held now
                await out.write(b"".join(held))
                held.clear()
            token = await _next(run.stream)
        final = answer.final(token, run.gen, _prompt_text(state, run.gen.seq.prompt_token_ids),
                             streamed=True)
        await out.write_eof(b"".join(held) + _event(final))
        run.outcome = "finished"
    except BackendError as exc:
        run.outcome = "failed"
        logger.warning("[%s] backend failed mid-stream: %s", request[REQUEST_ID], exc.message)
        error = from_exception(exc)
        try:  # llama-server's later errors: a data event holding the error, and the stream ends
            await out.write_eof(_event(LlamaCppError(error.status, error.message).body()))
        except ConnectionError:
            pass
    except ConnectionError:
        pass  # the client left: the generation is cancelled on the way out


for _path in ("/completion", "/completions"):
    routes.post(_path)(answered_here("llamacpp_completion")(_completion))
