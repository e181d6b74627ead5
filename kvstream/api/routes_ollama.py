"""Ollama's API as a second front, on the same port, in front of any backend: apps and the
official ``ollama`` clients written for Ollama point at KVStream unchanged.

In front of a real Ollama these routes are Ollama's own and pass through (generations still
admitted). In front of anything else KVStream answers them itself: ``/api/chat`` and
``/api/generate`` are translated into the same GenerateRequest the OpenAI routes make and go
through the same engine (queue, admission, KV accounting), answered as Ollama answers:
NDJSON when streaming, one object otherwise, durations in nanoseconds, ``done_reason``,
Ollama's ``{"error": "..."}`` bodies. ``/api/tags``, ``/api/ps``, ``/api/show``,
``/api/version`` describe the backend's models; ``/api/embed`` goes to an OpenAI-compatible
runtime's ``/v1/embeddings``, or the in-process engine computes it (``/api/embeddings`` too).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any

from aiohttp import web

from kvstream.api import cors
from kvstream.api.errors import ERROR_SHAPE, REQUEST_ID, APIError, counted, failure_outcome, from_exception
from kvstream.api.ollama_template import TemplateUnsupported, render_generate_template
from kvstream.api.routes_openai import default_model, parse_deadline, read_object, resolve_model
from kvstream.api.routes_passthrough import forward
from kvstream.api.schemas import is_prefill
from kvstream.api.state import CACHE_SALT, STATE, AppState
from kvstream.api.streaming import GuardedResponse
from kvstream.engine import Generation
from kvstream.jsonfast import dumps
from kvstream.scheduler import Priority, SchedulerError
from kvstream.types import BackendError, GenerateRequest, ModelInfo, Token, TokenLogprob

logger = logging.getLogger(__name__)
routes = web.RouteTableDef()

# The Ollama release whose API this front follows, the version /api/version reports: 0.12.11
# brought logprobs to /api/chat and /api/generate, the newest of its fields answered here.
OLLAMA_API_VERSION = "0.12.11"

# Ollama's options -> the OpenAI field KVStream sends (or reads itself).
SAMPLING_OPTIONS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed", "num_predict": "max_tokens",
    "stop": "stop", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repeat_penalty", "min_p": "min_p", "typical_p": "typical_p", "repeat_last_n": "repeat_last_n",
}
# Each option's type, as Ollama's own Options checks it (api/types.go): a wrong type is a 400
# naming the option; an integer option takes any JSON number, truncated, as Ollama does.
INTEGER_OPTIONS = {"num_predict", "top_k", "seed", "repeat_last_n", "num_ctx", "num_batch", "num_gpu", "main_gpu",
                   "num_thread", "num_keep", "draft_num_predict"}
NUMBER_OPTIONS = {"temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty", "frequency_penalty"}
BOOLEAN_OPTIONS = {"use_mmap", "numa", "low_vram", "penalize_newline"}
CHAT_FIELDS = {"model", "messages", "stream", "format", "options", "keep_alive", "tools", "think"}


class OllamaError(APIError):
    """An error in Ollama's shape: ``{"error": "message"}``."""

    def body(self) -> dict:
        return {"error": self.message}


def ollama_answers_itself(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """In front of a real Ollama these routes are its own: pass through (generations admitted)."""

    @functools.wraps(handler)
    async def route(request: web.Request) -> web.StreamResponse:
        if request.app[STATE].engine.backend.name == "ollama":
            return await forward(request)
        return await handler(request)

    return route


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _messages(raw: Any) -> list[dict[str, Any]]:
    """Ollama chat messages as OpenAI messages (base64 ``images`` become image parts, tool
    call arguments become JSON strings, a ``tool`` result answers the earlier calls (the one
    its ``tool_name`` names, else the first unanswered) as their ``tool_call_id``, which
    templates that pair calls with results render; an earlier answer's ``thinking`` is left
    out, as templates drop it from the history)."""
    if not isinstance(raw, list):
        raise OllamaError(400, "messages must be a list")
    out: list[dict[str, Any]] = []
    unanswered: list[dict[str, Any]] = []  # the last assistant turn's calls not yet answered
    for message in raw:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise OllamaError(400, "each message needs a role")
        content = message.get("content") or ""
        if not isinstance(content, str):
            raise OllamaError(400, "message content must be a string")
        converted: dict[str, Any] = {"role": message["role"], "content": content}
        images = message.get("images")
        if images:
            parts: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
            parts += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}} for image in images]
            converted["content"] = parts
        calls = message.get("tool_calls")
        if calls:
            converted["tool_calls"] = [_tool_call(call, len(out), i) for i, call in enumerate(_listed(calls))]
            unanswered = list(converted["tool_calls"])
        elif message["role"] == "assistant":
            unanswered = []
        if message.get("tool_name"):
            converted["name"] = message["tool_name"]
        if message["role"] == "tool" and unanswered:
            named = [c for c in unanswered if c["function"]["name"] == message.get("tool_name")]
            answered = (named or unanswered)[0]
            unanswered.remove(answered)
            converted["tool_call_id"] = answered["id"]
        out.append(converted)
    return out


def _listed(calls: Any) -> list[Any]:
    if not isinstance(calls, list):
        raise OllamaError(400, "tool_calls must be a list of tool calls")
    return calls


def _tool_call(call: Any, turn: int, index: int) -> dict[str, Any]:
    """One of an assistant turn's ``tool_calls`` the OpenAI way; 400 for one malformed.
    Arguments are Ollama's object (a JSON string, OpenAI's form, is taken as it is)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise OllamaError(400, "each tool call needs a function with a name")
    arguments = function.get("arguments")
    if arguments is None or isinstance(arguments, dict):
        arguments = dumps(arguments or {}).decode()
    elif not isinstance(arguments, str):
        raise OllamaError(400, "tool call arguments must be an object")
    return {"id": f"call_{turn}_{index}", "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _request(body: dict[str, Any], request_id: str, messages: list[dict[str, Any]] | None, prompt: str | None) -> GenerateRequest:
    """The GenerateRequest for an Ollama body: options mapped, ``format`` as response_format."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise OllamaError(400, "options must be an object")
    fields: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in options.items():
        value = _option(key, value)
        if value is None:
            continue
        target = SAMPLING_OPTIONS.get(key)
        if target in ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop"):
            fields[target] = value
        elif target is not None:
            extra[target] = value
        # Load-time options (num_ctx, num_gpu, ...) belong to the runtime's own config.
    if fields.get("max_tokens") is not None and fields["max_tokens"] <= 0:
        fields.pop("max_tokens")  # Ollama's -1 (and 0, and -2): no limit, until the model stops
    fmt = body.get("format")
    if fmt == "json":
        extra["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):  # (null and "" are "not set" in Ollama too)
        raise OllamaError(400, f'invalid format: {dumps(fmt).decode()}; expected "json" or a valid JSON Schema object')
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise OllamaError(400, "tools must be a list of tools (objects)")
    if tools:
        extra["tools"] = tools
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise OllamaError(400, "stream must be a boolean")
    _check_keep_alive(body.get("keep_alive"))
    think = body.get("think")
    if think is not None:
        if not isinstance(think, bool) and think not in ("low", "medium", "high"):  # Ollama's own rule
            raise OllamaError(400, "think must be a boolean or one of \"low\", \"medium\", \"high\"")
        extra["think"] = think  # a thinking model thinks or not (Ollama's own; the in-process engine's template)
    fields["logprobs"] = _logprobs(body)
    try:
        return GenerateRequest(
            model=None, messages=messages, prompt=prompt, extra=extra, request_id=request_id,
            stream=body.get("stream", True) is not False,
            continue_final_message=messages is not None and is_prefill(messages),  # Ollama continues it
            **fields,
        )
    except TypeError as exc:
        raise OllamaError(400, str(exc)) from None


def _option(key: str, value: Any) -> Any:
    """One option's value, checked against its type as Ollama checks it (null: unset)."""
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key in INTEGER_OPTIONS:
        if not number:
            raise OllamaError(400, f'option "{key}" must be of type integer')
        return int(value)
    if key in NUMBER_OPTIONS:
        if not number:
            raise OllamaError(400, f'option "{key}" must be of type float')
        return float(value)
    if key in BOOLEAN_OPTIONS and not isinstance(value, bool):
        raise OllamaError(400, f'option "{key}" must be of type boolean')
    if key == "stop":
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise OllamaError(400, 'option "stop" must be of type array of strings')
    return value


def _logprobs(body: dict[str, Any]) -> int | None:
    """Ollama's ``logprobs`` (a boolean) and ``top_logprobs`` (0-20) as GenerateRequest.logprobs."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise OllamaError(400, "logprobs must be a boolean")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise OllamaError(400, "top_logprobs must be an integer between 0 and 20")
    return (top or 0) if wanted else None


def _logprob_entry(entry: TokenLogprob) -> dict[str, Any]:
    """One token's log-probability in Ollama's shape (its client's ``Logprob``)."""
    return {
        "token": entry.token, "logprob": entry.logprob, "bytes": entry.bytes,
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in entry.top],
    }


async def _model(state: AppState, body: dict[str, Any]) -> str | None:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        if name is None:
            return state.engine.backend.model or await default_model(state)
        raise OllamaError(400, "model is required")
    try:
        return await resolve_model(state, name)
    except APIError:
        raise OllamaError(404, f'model "{name}" not found, try pulling it first') from None


class OllamaAnswer:
    """Builds Ollama's objects for one generation: chat ``message`` or generate ``response``."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model = model
        self.chat = chat
        self.text: list[str] = []
        self.thinking: list[str] = []  # a reasoning model's (reasoning_content deltas)
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.logprobs: list[dict[str, Any]] = []  # every token's, for a non-streamed answer

    def piece(self, token: Token) -> dict[str, Any] | None:
        """The object for one token, or None for a tool-call fragment (sent whole at the end)."""
        delta = token.chat_delta()
        for call in delta.get("tool_calls") or ():
            merged = self.tool_calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
            function = call.get("function") or {}
            merged["name"] += function.get("name") or ""
            merged["arguments"] += function.get("arguments") or ""
        text = delta.get("content") or (token.text if token.delta is None else "")
        thinking = delta.get("reasoning_content") or ""
        logprobs = [_logprob_entry(e) for e in token.token_logprobs or ()]
        if not text and not logprobs and not thinking:
            return None
        self.text.append(text)
        self.thinking.append(thinking)
        obj = self._object(text, done=False, thinking=thinking)
        if logprobs:
            self.logprobs.extend(logprobs)
            obj["logprobs"] = logprobs
        return obj

    def _object(self, text: str, done: bool, thinking: str = "") -> dict[str, Any]:
        obj: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.chat:
            obj["message"] = {"role": "assistant", "content": text}
            if thinking:
                obj["message"]["thinking"] = thinking
        else:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = done
        return obj

    def final(self, gen: Generation, finish_reason: str | None, whole: bool) -> dict[str, Any]:
        """The ``done: true`` object: the whole text when not streaming, and the counters."""
        obj = self._object("".join(self.text) if whole else "", done=True, thinking="".join(self.thinking) if whole else "")
        if self.chat and self.tool_calls:
            obj["message"]["tool_calls"] = [
                {"function": {"name": call["name"], "arguments": _arguments(call["arguments"])}}
                for _, call in sorted(self.tool_calls.items())
            ]
        if whole and self.logprobs:
            obj["logprobs"] = self.logprobs
        obj["done_reason"] = "length" if finish_reason == "length" else "stop"
        now = time.monotonic()
        usage = gen.usage
        first = gen.first_token_at or now
        obj.update(
            total_duration=int((now - gen.arrived_at) * 1e9),
            load_duration=0,
            prompt_eval_count=usage.prompt_tokens if usage else len(gen.seq.prompt_token_ids),
            prompt_eval_duration=int(max(0.0, first - (gen.upstream_at or first)) * 1e9),
            eval_count=usage.completion_tokens if usage else gen.num_tokens,
            eval_duration=int(max(0.0, now - first) * 1e9),
        )
        return obj


def _arguments(text: str) -> Any:
    from kvstream.jsonfast import loads

    try:
        return loads(text) if text else {}
    except ValueError:
        return text


def _check_message_count(state: AppState, messages: object) -> None:
    """413 past ``server.max_messages`` (Ollama's messages become as many OpenAI ones)."""
    if isinstance(messages, list) and len(messages) > state.settings.server.max_messages:
        raise OllamaError(413, f"too many messages (the limit is {state.settings.server.max_messages})")


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    arrived_at = time.monotonic()
    try:
        body = await read_object(request)
    except APIError as exc:  # its status kept: a body too large is a 413, one too slow a 408
        raise OllamaError(exc.status, exc.message) from None
    request_id = request[REQUEST_ID]
    if chat:
        _check_message_count(state, body.get("messages"))  # before translating them all
        generate = _request(body, request_id, _messages(body.get("messages", [])), None)
    else:
        prompt = body.get("prompt") or ""
        if not isinstance(prompt, str):
            raise OllamaError(400, "prompt must be a string")
        suffix, images, system = body.get("suffix"), body.get("images"), body.get("system")
        context = body.get("context")
        if context is not None and not (isinstance(context, list) and all(type(t) is int and t >= 0 for t in context)):
            raise OllamaError(400, "context must be an array of token ids (the context of an earlier answer)")
        if suffix is not None and not isinstance(suffix, str):
            raise OllamaError(400, "suffix must be a string")
        if images is not None and not (isinstance(images, list) and all(isinstance(i, str) for i in images)):
            raise OllamaError(400, "images must be a list of base64-encoded images")
        if images and context:  # a context continues as token ids, which carry no image
            raise OllamaError(400, "images cannot follow a context here: send the conversation as messages to /api/chat")
        template = body.get("template")
        if template is not None and not isinstance(template, str):
            raise OllamaError(400, "template must be a string")
        if body.get("raw") or suffix:
            # The prompt as it is (raw), or a fill-in-the-middle between the prompt and the
            # suffix (code completion): a completion, the suffix in OpenAI's field.
            if images:
                raise OllamaError(400, "this runtime takes images in a templated prompt only: leave raw and suffix out")
            if body.get("raw") and (system or context or template):
                raise OllamaError(400, "raw mode does not support template, system, or context")
            if template:  # (Ollama's would place the suffix by .Suffix, which is not read here)
                raise OllamaError(400, "a suffix cannot go with a template here: leave the template out")
            if context:
                raise OllamaError(400, "context continues a templated prompt: leave suffix out")
            generate = _request(body, request_id, None, prompt)
            if suffix:
                generate.extra["suffix"] = suffix
        elif template:  # the client's own template for this request, rendered here and sent as it is
            if images:
                raise OllamaError(400, "images cannot go with a template here: leave the template out")
            try:
                rendered = render_generate_template(template, system if isinstance(system, str) else "", prompt)
            except TemplateUnsupported as exc:
                raise OllamaError(400, str(exc)) from None
            generate = _request(body, request_id, None, rendered)
        else:  # Ollama templates a generate prompt as a user turn (with its system prompt and images)
            messages = ([{"role": "system", "content": system}] if isinstance(system, str) and system else [])
            user = {"role": "user", "content": prompt} | ({"images": images} if images else {})
            generate = _request(body, request_id, messages + _messages([user]), None)
    raw = not chat and bool(body.get("raw") or body.get("suffix"))
    model_name = body.get("model") if isinstance(body.get("model"), str) else None
    generate.model = await _model(state, body)
    if _has_images(generate.messages):
        await _check_vision(state, generate.model)
    if not generate.messages if chat else not prompt:
        # An empty chat or prompt loads the model in Ollama (unloads it with keep_alive 0):
        # the backend's model is loaded already and stays so; nothing is generated.
        done = {"done_reason": "unload" if _is_zero_duration(body.get("keep_alive")) else "load", "done": True}
        text = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        return web.json_response({"model": model_name or generate.model, "created_at": now_iso()} | text | done)
    if not chat and body.get("context"):
        generate = await _continued(state, generate, body["context"])
    _check_message_count(state, generate.messages)
    generate.cache_salt = request.get(CACHE_SALT)
    generate.session = request.headers.get("X-KVStream-Session") or None
    try:
        generate.queue_deadline_s = parse_deadline(request)
    except APIError as exc:
        raise OllamaError(400, exc.message) from None
    cors.follow_runtime(request, [generate])
    try:
        gen = await state.engine.submit(generate, Priority.NORMAL, arrived_at)
    except (SchedulerError, BackendError) as exc:
        raise _ollama_error(exc) from None
    answer = OllamaAnswer(model_name or generate.model or "", chat)
    outcome = "cancelled"
    stream = aiter(gen)
    try:
        try:
            await gen.admitted()
        except SchedulerError as exc:
            raise _ollama_error(exc) from None
        headers = {"X-Request-Id": request_id, "X-KVStream-Queue-Ms": f"{gen.queue_ms:.1f}"}
        if not generate.stream:
            async for token in stream:
                if token.finish_reason is not None:
                    outcome = "finished"
                    final = answer.final(gen, token.finish_reason, whole=True) | await _context_after(state, generate, answer, raw)
                    return web.Response(body=dumps(final), content_type="application/json", headers=headers)
                answer.piece(token)
            raise BackendError("the runtime ended the stream without finishing the generation")
        # The first token before the headers: a runtime that fails at once gets its own status.
        first = await anext(stream, None)
        if first is None:
            raise BackendError("the runtime ended the stream without finishing the generation")
        response = GuardedResponse(headers=headers | {"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        try:
            async for token in _chain(first, stream):
                if token.finish_reason is not None:
                    final = answer.final(gen, token.finish_reason, whole=False) | await _context_after(state, generate, answer, raw)
                    await response.write_eof(dumps(final) + b"\n")
                    outcome = "finished"
                    return response
                piece = answer.piece(token)
                if piece is not None:
                    await response.write(dumps(piece) + b"\n")
            raise BackendError("the runtime ended the stream without finishing the generation")
        except BackendError as exc:
            outcome = "failed"
            logger.warning("[%s] backend failed mid-stream: %s", request_id, exc.message)
            # Ollama ends a failed stream with an error line.
            await response.write_eof(dumps({"error": exc.message}) + b"\n")
            return response
        except ConnectionError:
            return response
    except BackendError as exc:
        outcome = failure_outcome(exc)
        raise _ollama_error(exc) from None
    finally:
        await stream.aclose()
        gen.close(outcome)


# A Go duration, as Ollama's keep_alive takes one ("5m", "1h30m", "-1s", "0"); a bare number
# of seconds in a string ("-1", "300") is taken too, as apps send it so (Go would want a unit).
_GO_DURATION = re.compile(r"[+-]?(?:(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+|\d+(?:\.\d*)?)")


def _check_keep_alive(value: object) -> None:
    """400 for a ``keep_alive`` that is no duration: seconds (a number) or a Go duration string."""
    if value is None or value == "" or isinstance(value, (int, float)) and not isinstance(value, bool):
        return
    if not isinstance(value, str) or not _GO_DURATION.fullmatch(value.strip()):
        raise OllamaError(400, f"time: invalid duration {dumps(value).decode()}")


def _has_images(messages: list[dict[str, Any]] | None) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image_url" for p in m["content"])
               for m in messages or ())


async def _check_vision(state: AppState, model: str | None) -> None:
    """400 for images sent to a model the backend says cannot see them (its capabilities
    known and without ``vision``: llama-server without a projector answers a 500 for them)."""
    info = next((m for m in await _models(state) if m.id == model), None)
    if info is not None and info.capabilities and "vision" not in info.capabilities:
        raise OllamaError(400, f"{model} does not support image input (the runtime loaded no vision projector)"
                          if state.engine.backend.name == "llamacpp" else f"{model} does not support image input")


def _is_zero_duration(value: object) -> bool:
    """Whether an Ollama ``keep_alive`` (seconds, or a Go duration such as "0", "0s", "0m")
    is zero: unload now."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    return isinstance(value, str) and re.fullmatch(r"[+-]?(?:0+(?:\.0*)?(?:ns|us|µs|ms|s|m|h)?)+", value.strip()) is not None


async def _continued(state: AppState, generate: GenerateRequest, context: list[int]) -> GenerateRequest:
    """/api/generate with an earlier answer's ``context`` (Ollama's deprecated conversation
    memory): the prompt is that context's tokens, then this prompt templated as a turn of its
    own (its system prompt and images too; a template that opens every prompt with a default
    system prompt or a BOS in its text opens this turn so too), as Ollama builds it. Needs a
    backend that tokenizes a chat exactly (llama-server, the in-process engine)."""
    try:
        turn = await state.engine.backend.tokenize(generate)
    except BackendError as exc:
        raise _ollama_error(exc) from None
    if not turn:
        raise OllamaError(400, f"context needs the model's own tokens, which the {state.engine.backend.name} backend "
                               "cannot give: send the conversation as messages to /api/chat instead")
    return replace(generate, messages=None, prompt=None, prompt_token_ids=[*context, *turn], continue_final_message=False)


async def _context_after(state: AppState, generate: GenerateRequest, answer: OllamaAnswer, raw: bool) -> dict[str, Any]:
    """Ollama's ``context`` on a templated /api/generate answer (the model's template or the
    request's own): the prompt's tokens and the answer's, for the next request to continue
    from (Ollama too tokenizes the answer's text). Empty where the prompt's tokens were
    estimated; none in raw mode (or a fill-in-the-middle), as in Ollama."""
    if answer.chat or raw:
        return {}
    prompt = generate.control.prompt_token_ids
    text = "".join(answer.text)
    try:
        tokens = await state.engine.backend.plain_text_ids(text) if text else []
    except BackendError as exc:
        logger.debug("[%s] tokenizing the answer for its context failed: %s", generate.request_id, exc.message)
        tokens = None
    return {"context": [*prompt, *tokens] if prompt and tokens is not None else []}


async def _chain(first: Token, rest: AsyncIterator[Token]) -> AsyncIterator[Token]:
    yield first
    async for token in rest:
        yield token


def _ollama_error(exc: Exception) -> OllamaError:
    error = from_exception(exc)
    return OllamaError(error.status, error.message, retry_after=error.retry_after)


@routes.post("/api/chat")
@counted("ollama_chat")
@ollama_answers_itself
async def api_chat(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


@routes.post("/api/generate")
@counted("ollama_generate")
@ollama_answers_itself
async def api_generate(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


# Ollama's expiry of a model loaded with keep_alive < 0 (never unloaded): now plus Go's
# longest duration, which its CLI shows as "Forever" (a time in the past: "Stopping...").
_NEVER_EXPIRES = timedelta(microseconds=(2**63 - 1) // 1000)


def _model_entry(info: ModelInfo, context: int | None) -> dict[str, Any]:
    """A model as Ollama lists it, with the details the backend knows (ModelInfo.details).
    Its ``digest`` is a stable hash of what the backend says the model is: Ollama's own
    CLI prints its first 12 characters (``ollama list``/``ps`` fail on a shorter one)."""
    details = {"parent_model": "", "format": "gguf", "family": "", "families": [], "parameter_size": "", "quantization_level": ""}
    details |= info.details
    if details["family"]:
        details["families"] = [details["family"]]
    digest = hashlib.sha256(dumps([info.id, info.owned_by, info.size, info.details])).hexdigest()
    return {
        "name": info.id, "model": info.id, "modified_at": now_iso(), "size": info.size, "digest": digest, "details": details,
        **({"context_length": context} if context else {}),
    }


async def _models(state: AppState) -> list[Any]:
    try:
        return await state.engine.models()
    except BackendError as exc:
        raise _ollama_error(exc) from None


@routes.get("/api/tags")
@ollama_answers_itself
async def api_tags(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    return web.json_response({"models": [_model_entry(m, None) for m in await _models(state)]})


@routes.get("/api/ps")
@ollama_answers_itself
async def api_ps(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    # The backend's models are always loaded: nothing expires (Ollama's keep_alive -1). The
    # context is the one loaded (a request's, as the runtime reported it), not the trained.
    expires = (datetime.now(timezone.utc) + _NEVER_EXPIRES).isoformat().replace("+00:00", "Z")
    loaded = state.engine.limits.n_ctx_per_request
    models = [_model_entry(m, loaded or m.context_length) | {"expires_at": expires, "size_vram": m.size_vram}
              for m in await _models(state)]
    return web.json_response({"models": models})


@routes.post("/api/show")
@ollama_answers_itself
async def api_show(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_object(request)
    name = await _model(state, body)
    info = next((m for m in await _models(state) if m.id == name), None)
    if info is None:
        raise OllamaError(404, f'model "{body.get("model")}" not found, try pulling it first')
    return web.json_response({
        "modelfile": "", "parameters": "", "template": "",
        "details": _model_entry(info, None)["details"],
        "model_info": _model_info(info),
        "capabilities": list(info.capabilities) or ["completion"],
        "modified_at": now_iso(),
    })


def _model_info(info: ModelInfo) -> dict[str, Any]:
    """/api/show's ``model_info`` (a GGUF's metadata, in Ollama) as far as the backend knows
    it. Apps find the context as ``<general.architecture>.context_length`` (VS Code's Copilot
    falls back to 4,096 tokens without it; others refuse the model) and show
    ``general.basename`` as the model's name: an architecture the backend does not report
    is named ``unknown`` so that the context is found still, the name is the model's id
    where its file's own is unknown."""
    family = info.details.get("family") or info.metadata.get("general.architecture") or "unknown"
    out: dict[str, Any] = {"general.basename": info.id} | info.metadata | {"general.architecture": family}
    if info.context_length:
        out[f"{family}.context_length"] = info.context_length
    return out


def unless_the_runtime_keeps_a_store(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Routes of Ollama's model store: passed through to a runtime that may keep one (Ollama,
    or whatever a generic OpenAI-compatible backend fronts: ``may_keep_ollama_store``);
    answered by KVStream for the others (the in-process engine, llama-server, LM Studio...),
    whose models it serves through its own Ollama front."""

    @functools.wraps(handler)
    async def route(request: web.Request) -> web.StreamResponse:
        backend = request.app[STATE].engine.backend
        if backend.may_keep_ollama_store and backend.upstream() is not None:
            return await forward(request)
        return await handler(request)

    return route


@routes.post("/api/pull")
@unless_the_runtime_keeps_a_store
async def api_pull(request: web.Request) -> web.StreamResponse:
    """Apps pull a model before they use it: one the backend serves is present, so the pull
    succeeds at once (streamed as one NDJSON status line unless ``stream`` is false)."""
    state = request.app[STATE]
    body = await read_object(request)
    name = body.get("model") or body.get("name")
    if not isinstance(name, str):
        raise OllamaError(400, "model is required")
    await _model(state, {"model": name})  # 404 for a model it does not serve
    if body.get("stream", True) is False:
        return web.json_response({"status": "success"})
    return web.Response(body=dumps({"status": "success"}) + b"\n", content_type="application/x-ndjson")


async def _not_managed_here(request: web.Request) -> web.StreamResponse:
    """Creating, copying, pushing or deleting models is a model store's, which the backend
    is not: its models are the in-process engine's or its runtime's own."""
    backend = request.app[STATE].engine.backend
    whose = ("the in-process engine's, loaded at start (kvstream serve --model)" if backend.upstream() is None
             else "its runtime's own")
    raise OllamaError(501, f"{request.path} manages Ollama's model store; the {backend.name} backend's models are {whose}, "
                           "not managed through KVStream")


for _method, _path in [("POST", "/api/create"), ("POST", "/api/copy"), ("POST", "/api/push"), ("DELETE", "/api/delete")]:
    routes.route(_method, _path)(unless_the_runtime_keeps_a_store(_not_managed_here))


@routes.get("/api/version")
@ollama_answers_itself
async def api_version(request: web.Request) -> web.StreamResponse:
    """The Ollama release whose API this front speaks, not KVStream's own version: apps check
    it before they connect (VS Code's Copilot refuses a server below 0.6.4) and gate features
    on it. KVStream's own version is in its ``Via`` header and ``/status``."""
    return web.json_response({"version": OLLAMA_API_VERSION})


@routes.post("/api/embed")
@counted("ollama_embed")
@ollama_answers_itself
async def api_embed(request: web.Request) -> web.StreamResponse:
    """Ollama's embeddings: the in-process engine's own, or an OpenAI-compatible runtime's
    /v1/embeddings. An empty input gets no embeddings (apps send one to load the model)."""
    state = request.app[STATE]
    body = await read_object(request)
    name = await _model(state, body)
    started = time.monotonic()
    vectors, tokens = await _embeddings(state, name, _embed_inputs(body.get("input")), body)
    return web.json_response({
        "model": body.get("model") or name, "embeddings": vectors,
        "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0, "prompt_eval_count": tokens,
    })


@routes.post("/api/embeddings")
@counted("ollama_embed")
@ollama_answers_itself
async def api_embeddings(request: web.Request) -> web.StreamResponse:
    """Ollama's older embedding route: ``prompt`` in, one ``embedding`` out."""
    state = request.app[STATE]
    body = await read_object(request)
    name = await _model(state, body)
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise OllamaError(400, "prompt must be a string")
    vectors, _ = await _embeddings(state, name, [prompt] if prompt else [], body)
    return web.json_response({"embedding": vectors[0] if vectors else []})


async def _embeddings(state: AppState, name: str | None, inputs: list[str], body: dict[str, Any]) -> tuple[list[Any], int]:
    """The vectors of ``inputs`` and the tokens read: the in-process engine's (_embed_here),
    or an OpenAI-compatible runtime's /v1/embeddings, admitted like any forward pass; each
    input cut to the context unless ``truncate`` is false, and the vectors to ``dimensions``
    (renormalized), as Ollama does."""
    truncate, dimensions = body.get("truncate", True), body.get("dimensions")
    if not isinstance(truncate, bool):
        raise OllamaError(400, "truncate must be a boolean")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1):
        raise OllamaError(400, "dimensions must be a positive integer")
    backend = state.engine.backend
    session = backend.upstream() if backend.forwards_body else None
    if session is None and not backend.serves_embeddings:
        raise OllamaError(501, f"the {backend.name} backend does not serve embeddings")
    if not inputs:
        return [], 0
    if session is None:
        vectors, tokens = await _embed_here(state, inputs, truncate)
    else:
        sent = await _fitted(state, inputs, truncate)
        gen = state.engine.reserve(len(dumps(sent)), 0)
        outcome = "cancelled"
        try:
            try:
                await gen.admitted()
                result = await session.post_json("/v1/embeddings", {"model": name, "input": sent})
            except (SchedulerError, BackendError) as exc:
                outcome = failure_outcome(exc)
                raise _ollama_error(exc) from None
            outcome = "finished"
        finally:
            gen.close(outcome)
        data = sorted(result.get("data") or [], key=lambda d: d.get("index", 0))
        vectors, tokens = [d.get("embedding") for d in data], (result.get("usage") or {}).get("prompt_tokens", 0)
    if dimensions is not None and vectors and isinstance(vectors[0], list) and dimensions < len(vectors[0]):
        vectors = [_unit(v[:dimensions]) for v in vectors]
    return vectors, tokens


async def _fitted(state: AppState, inputs: list[str], truncate: bool) -> list[str | list[int]]:
    """``inputs`` for a runtime's /v1/embeddings, each within the context a request may use:
    one longer is cut to it (as token ids, which /v1/embeddings takes) or, without
    ``truncate``, a 400 as Ollama answers. Only an input of more UTF-8 bytes than the context
    has tokens can be longer (a token is at least a byte), so the others are sent as they
    are, untokenized; where the runtime's tokens or context are unknown, all are."""
    limit = state.engine.limits.n_ctx_per_request
    if not limit:
        return list(inputs)
    fitted: list[str | list[int]] = []
    for text in inputs:
        ids = await _prompt_ids(state, text) if len(text.encode()) > limit else None
        if ids is not None and len(ids) > limit:
            if not truncate:
                raise OllamaError(400, "the input length exceeds the context length")
            fitted.append(ids[:limit])
        else:
            fitted.append(text)
    return fitted


async def _prompt_ids(state: AppState, text: str) -> list[int] | None:
    """``text``'s tokens as the runtime reads an input (its BOS too, where the model adds
    one: a cut input sent as ids keeps it); None where the backend cannot tell."""
    try:
        return await state.engine.backend.tokenize(GenerateRequest(model=None, prompt=text)) or None
    except BackendError:
        return None  # the runtime judges the input itself


def _embed_inputs(value: Any) -> list[str]:
    """``input`` as Ollama takes it: a string or a list of strings; empty strings dropped."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise OllamaError(400, "invalid input type: input must be a string or a list of strings")
    return [item for item in value if item]


async def _embed_here(state: AppState, inputs: list[str], truncate: bool) -> tuple[list[list[float]], int]:
    """The in-process engine's embeddings of ``inputs``, cut to the context unless
    ``truncate`` is false."""
    try:
        result = await state.engine.backend.embed(list(inputs), truncate=truncate)
    except (SchedulerError, BackendError) as exc:
        raise _ollama_error(exc) from None
    return result.vectors, result.prompt_tokens


def _unit(vector: list[float]) -> list[float]:
    norm = sum(x * x for x in vector) ** 0.5
    return [x / norm for x in vector] if norm else vector


def _ollama_shaped(error: APIError) -> APIError:
    """``error`` in Ollama's shape: what the routes raise is already; an error from outside
    them (aiohttp's 413 for a body past ``server.max_body_bytes``) is made so."""
    return error if isinstance(error, OllamaError) else OllamaError(error.status, error.message, retry_after=error.retry_after)


for _route in routes:  # (errors.py's middleware asks the route's handler for its shape)
    setattr(_route.handler, ERROR_SHAPE, _ollama_shaped)
