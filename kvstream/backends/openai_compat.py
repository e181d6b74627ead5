"""Any OpenAI-compatible server (vLLM, SGLang, another KVStream): the base for the llama.cpp,
LM Studio and Foundry Local adapters, which add their runtime's quirks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvstream.config import Settings
from kvstream.backends.base import BaseBackend
from kvstream.types import (
    BackendError,
    BackendInterrupted,
    GenerateRequest,
    ModelInfo,
    RuntimeLimits,
    Token,
    TokenLogprob,
    Usage,
    as_burst,
)
from kvstream.backends.http import DONE, EventReader, UpstreamSession, cors_grant, raise_for_upstream_status, read_json


def usage_from(payload: dict[str, Any] | None) -> Usage | None:
    """An OpenAI ``usage`` object (with ``prompt_tokens_details.cached_tokens``, what the
    runtime reports it reused, when present)."""
    if not isinstance(payload, dict) or "prompt_tokens" not in payload:
        return None
    details = payload.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(
        prompt_tokens=int(payload.get("prompt_tokens") or 0),
        completion_tokens=int(payload.get("completion_tokens") or 0),
        cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) else None,
    )


def cache_n(event: dict[str, Any]) -> int | None:
    """llama-server's ``timings.cache_n``: prompt tokens its slot cache supplied."""
    timings = event.get("timings")
    value = timings.get("cache_n") if isinstance(timings, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def with_cached(usage: Usage | None, cached: int | None) -> Usage | None:
    """``usage`` with the runtime's reused-token count filled in from ``timings`` when its
    usage object did not carry one."""
    if usage is not None and usage.cached_tokens is None and cached is not None:
        usage.cached_tokens = cached
    return usage


def _bytes_of(entry: dict[str, Any], token: str) -> list[int]:
    raw = entry.get("bytes")
    return raw if isinstance(raw, list) and all(isinstance(b, int) for b in raw) else list(token.encode())


def _entry(entry: Any) -> TokenLogprob | None:
    if not isinstance(entry, dict) or isinstance(entry.get("logprob"), bool) or not isinstance(entry.get("logprob"), int | float):
        return None
    token = str(entry.get("token", ""))
    return TokenLogprob(token, float(entry["logprob"]), _bytes_of(entry, token))


def logprobs_from(value: Any, top: int | None = None) -> list[TokenLogprob] | None:
    """A runtime's OpenAI ``logprobs`` object (chat's ``content`` list, or the legacy
    completions lists) as TokenLogprobs, at most ``top`` alternatives each (None: all it
    sent); None when absent or unreadable."""
    if not isinstance(value, dict):
        return None
    content = value.get("content")
    if isinstance(content, list):
        out = []
        for item in content:
            entry = _entry(item)
            if entry is not None:
                entry.top = [e for e in map(_entry, item.get("top_logprobs") or ()) if e is not None][:top]
                out.append(entry)
        return out or None
    tokens, values = value.get("tokens"), value.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        return None
    tops = value.get("top_logprobs")
    tops = tops if isinstance(tops, list) else [None] * len(tokens)
    out = []
    for token, logprob, top in zip(tokens, values, tops, strict=False):
        entry = _entry({"token": token, "logprob": logprob})
        if entry is not None:
            pairs = top.items() if isinstance(top, dict) else ()
            entry.top = [e for t, lp in pairs if (e := _entry({"token": t, "logprob": lp})) is not None][:top]
            out.append(entry)
    return out or None


def with_thinking_switch(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with Ollama's ``think`` (its front's) said the OpenAI-compatible way:
    ``true``/``false`` as ``chat_template_kwargs.enable_thinking`` (what llama-server, vLLM
    and SGLang read; Qwen3's and DeepSeek's templates' switch), a level as
    ``reasoning_effort``. A runtime would ignore ``think``: the model thought anyway."""
    think = fields.pop("think", None)
    if isinstance(think, bool):
        kwargs = fields.get("chat_template_kwargs")
        fields["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": think}
    elif think in ("low", "medium", "high"):
        fields.setdefault("reasoning_effort", think)
    return fields


class OpenAICompatibleBackend(BaseBackend):
    """Streams every request upstream (even when the client did not ask to stream), so that
    tokens are counted as they come and a client that leaves stops the runtime at once."""

    name = "openai"
    may_keep_ollama_store = True  # it may front an Ollama (its /v1 routes)
    default_url = "http://127.0.0.1:8000"
    chat_path = "/v1/chat/completions"
    completions_path = "/v1/completions"
    models_path = "/v1/models"
    health_path = "/v1/models"

    def __init__(
        self, base_url: str | None = None, model: str | None = None, settings: Settings | None = None, **overrides: Any
    ) -> None:
        super().__init__(base_url, model, settings, **overrides)
        self.session: UpstreamSession | None = None
        self._probed: Any = None  # the last health probe's answer

    async def start(self) -> None:
        self.session = self.open_session()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def upstream(self) -> UpstreamSession | None:
        return self.session

    @property
    def http(self) -> UpstreamSession:
        if self.session is None:
            raise RuntimeError(f"{self.name} backend used before start()")
        return self.session

    # ---------------------------------------------------------------- requests
    # The client's body is forwarded as it is (GenerateRequest.body): this runtime speaks the
    # client's protocol, so it judges every field itself and its answer comes back whole.
    forwards_body = True

    def build_body(self, request: GenerateRequest) -> dict[str, Any]:
        """The upstream JSON body: the client's own (``model`` resolved; when streaming,
        usage asked for so KVStream can count), or one built from the request's fields."""
        if request.body is not None:
            body = dict(request.body)
            model = request.model or self.model
            if model is not None:
                body["model"] = model
            options = body.get("stream_options")
            if request.stream and (options is None or isinstance(options, dict)):
                # Anything else is the runtime's to refuse; KVStream then counts without it.
                body["stream_options"] = {**(options or {}), "include_usage": True}
            return body
        body = with_thinking_switch(dict(request.extra))
        body["model"] = request.model or self.model
        if request.is_chat:
            body["messages"] = request.messages
        else:
            body["prompt"] = request.prompt if request.prompt_token_ids is None else request.prompt_token_ids
        for key in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
            value = getattr(request, key)
            if value is not None:
                body[key] = value
        if request.stop:
            body["stop"] = request.stop
        if request.logprobs is not None:  # asked through another API (Ollama's): OpenAI's fields
            # llama-server takes top_logprobs 0 as "no log-probabilities at all": left out then,
            # and the alternatives it adds anyway are trimmed from its answer (stream below).
            top = {"top_logprobs": request.logprobs} if request.logprobs else {}
            body |= {"logprobs": True, **top} if request.is_chat else {"logprobs": request.logprobs}
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        return body

    def generate(self, request: GenerateRequest) -> AsyncIterator[Token]:
        return self.stream(request, self.build_body(request))

    async def stream(self, request: GenerateRequest, body: dict[str, Any]) -> AsyncIterator[Token]:
        """POST ``body`` to the chat or completions route and yield its tokens; the last one
        carries the finish reason and usage. With a forwarded client body, tokens carry the
        runtime's own chunks (``events``) or, not streaming, its whole answer (``payload``)."""
        path = self.chat_path if request.is_chat else self.completions_path
        forwarded = request.body is not None
        async with self.http.request("POST", path, json_body=body, headers=request.headers) as resp:
            request.control.runtime_grant = cors_grant(resp.headers)
            await raise_for_upstream_status(resp)
            # The answer's own type decides how it is read (a runtime may stream for a
            # "stream" value KVStream does not take as true, or not stream at all).
            if resp.content_type != "text/event-stream":
                payload = await read_json(resp)
                yield self._final_from_payload(payload, request)
                return
            # KVStream may stop this stream from outside (preemption): the pending read
            # then raises BackendInterrupted, and closing the response stops the runtime.
            request.control.on_interrupt(lambda: resp.content.set_exception(BackendInterrupted()))
            # Forwarded: the usage chunk KVStream asked for reaches the client only if it did.
            options = (request.body or {}).get("stream_options")
            keep_usage = forwarded and isinstance(options, dict) and options.get("include_usage") is True
            finish_reason: str | None = None
            usage: Usage | None = None
            cached: int | None = None  # llama-server's timings.cache_n, from any chunk
            pending: list[dict[str, Any]] = []  # chunks not yet attached to a token
            events = EventReader(resp)
            while batch := await events.read():
                tokens = []
                for event in batch:
                    if event is DONE:
                        break
                    if not isinstance(event, dict):
                        raise BackendError("the runtime sent a stream event that is not a JSON object")
                    if "usage" in event:
                        usage = usage_from(event["usage"]) or usage
                    cached = cache_n(event) if "timings" in event else cached
                    self.observe_event(event, request)
                    choices = event.get("choices") or ()
                    if forwarded and (choices or keep_usage or "usage" not in event):
                        pending.append(event)
                    for choice in choices:
                        token = self._token_from_choice(choice, request.is_chat)
                        if token is not None:
                            if forwarded:
                                token.events, pending = pending, []
                            elif request.logprobs is not None:  # KVStream's body: the client reads them translated
                                token.token_logprobs = logprobs_from(token.logprobs, request.logprobs)
                            tokens.append(token)
                        finish_reason = choice.get("finish_reason") or finish_reason
                if events.ended and finish_reason is not None:
                    tokens.append(self._final(finish_reason, with_cached(usage, cached), pending if forwarded else None))
                for token in as_burst(tokens):
                    yield token
                if events.ended and finish_reason is not None:
                    return
            if finish_reason is None:
                # [DONE] or EOF without a finish_reason: the runtime stopped mid-generation.
                raise BackendError("the runtime ended the stream before the generation finished")
            yield self._final(finish_reason, with_cached(usage, cached), pending if forwarded else None)

    @staticmethod
    def _final(finish_reason: str, usage: Usage | None, events: list[dict[str, Any]] | None) -> Token:
        return Token(finish_reason=finish_reason, usage=usage, events=events)

    @staticmethod
    def _final_from_payload(payload: Any, request: GenerateRequest) -> Token:
        """The one Token of a non-streamed answer: its finish reason, usage and the body."""
        if not isinstance(payload, dict):
            raise BackendError("the runtime's answer is not a JSON object")
        choices = payload.get("choices") or [{}]
        first = choices[0] if isinstance(choices[0], dict) else {}
        message = first.get("message") or {}
        text = (message.get("content") if request.is_chat else first.get("text")) or ""
        return Token(
            text=text if isinstance(text, str) else "",
            finish_reason=first.get("finish_reason") or "stop",
            usage=with_cached(usage_from(payload.get("usage")), cache_n(payload)),
            payload=payload,
        )

    def observe_event(self, event: dict[str, Any], request: GenerateRequest) -> None:
        """Hook for adapters that read runtime-specific fields (llama.cpp ``timings``)."""

    @staticmethod
    def _token_from_choice(choice: dict[str, Any], is_chat: bool) -> Token | None:
        if is_chat:
            delta = dict(choice.get("delta") or {})
            delta.pop("role", None)  # KVStream sends its own role chunk first
            if not any(v not in (None, "", []) for v in delta.values()):
                return None
            return Token(text=delta.get("content") or "", delta=delta, logprobs=choice.get("logprobs"))
        text = choice.get("text") or ""
        if not text:
            return None
        return Token(text=text, logprobs=choice.get("logprobs"))

    # ------------------------------------------------------------------ probes
    async def health(self) -> bool:
        try:
            self._probed = await self.http.get_json(self.health_path, timeout=3.0)
        except BackendError:
            return False
        return True

    async def limits(self) -> RuntimeLimits:
        """``backend.parallel``, and the context vLLM reports per model (``max_model_len``
        in /v1/models, read from the health probe that precedes this call): a request with
        no max_tokens may run to it."""
        context = None
        payload = self._probed if self.health_path == self.models_path else None
        for entry in payload.get("data", []) if isinstance(payload, dict) else []:
            length = entry.get("max_model_len") if isinstance(entry, dict) else None
            if isinstance(length, int) and length > 0 and (self.model is None or entry.get("id") == self.model):
                context = length
                break
        return RuntimeLimits(n_ctx_per_request=context, parallel=self.settings.backend.parallel)

    async def models(self) -> list[ModelInfo]:
        payload = await self.http.get_json(self.models_path)
        data = payload.get("data", []) if isinstance(payload, dict) else []
        models = [
            ModelInfo(
                id=str(m["id"]),
                owned_by=str(m.get("owned_by") or self.name),
                created=int(m.get("created") or 0),
                context_length=(m.get("meta") or {}).get("n_ctx_train") if isinstance(m.get("meta"), dict) else None,
            )
            for m in data
            if isinstance(m, dict) and "id" in m
        ]
        return models
