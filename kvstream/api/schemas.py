"""Pydantic models of the OpenAI request bodies KVStream accepts.

They accept what the OpenAI API accepts (``stop`` as a string or list, ``content`` as a string,
a list of parts or null, unknown fields kept and passed through to the runtime) and reject
what it rejects (no messages, an unknown role, out-of-range sampling values).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from kvstream.api.cache_control import chat_breakpoints, without_cache_control
from kvstream.types import CacheBreakpoint, GenerateRequest

Role = Literal["system", "user", "assistant", "tool", "developer", "function"]
# Choices one request may ask for: n, or prompts x n for a completions batch.
MAX_BATCH_PROMPTS = 128


# strict: a value of the wrong JSON type is refused (400), not coerced: OpenAI refuses
# "stream": "yes" and "max_tokens": "10", so a client that sends them learns it here, not
# when it moves to OpenAI. (Strict still takes an integer where a number is expected.)
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str

    @model_validator(mode="after")
    def _text_is_text(self) -> ContentPart:
        if self.type == "text" and not isinstance(getattr(self, "text", None), str):
            raise ValueError("a text part needs 'text' as a string")
        return self


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> Message:
        if self.content is None and self.role not in ("assistant", "function") and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by chat and completions requests."""

    model_config = ConfigDict(extra="allow", strict=True)

    # Optional, as single-model runtimes have it: the backend's model serves the request.
    model: str | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    n: int = Field(1, ge=1, le=MAX_BATCH_PROMPTS)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # OpenAI's: "24h" keeps the whole prompt cached a day (cache_control.py); passed on too.
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # KVStream's own fields; never sent upstream. priority: also the X-KVStream-Priority
    # header. reuse / blend_ratio: the in-process engine's reuse of moved chunks (hf only).
    priority: str | int | None = None
    reuse: Literal["exact", "blend"] | None = None
    blend_ratio: float | None = Field(None, ge=0, le=1)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    OWN_FIELDS: ClassVar[set[str]] = {
        "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream", "stream_options",
        "priority", "reuse", "blend_ratio",
    }

    def passthrough(self) -> dict[str, Any]:
        """The fields KVStream does not interpret, for the runtime."""
        return self.model_dump(exclude_none=True, exclude=self.OWN_FIELDS | self._own_extra())

    def _own_extra(self) -> set[str]:
        return set()

    @property
    def candidates(self) -> int:
        """Choices the backend generates (completions' ``best_of`` may ask for more than ``n``)."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def is_prefill(messages: list[dict[str, Any]]) -> bool:
    """Whether a chat ends with the assistant's own text, which Anthropic's Messages API and
    Ollama's chat continue (the "prefill") rather than answer."""
    last = messages[-1] if messages else {}
    content = last.get("content")
    return last.get("role") == "assistant" and not last.get("tool_calls") and bool(content) and (
        isinstance(content, str) or all(isinstance(p, dict) and p.get("type") == "text" for p in content))


class ChatCompletionRequest(_Sampling):
    """Body of POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    # Passed on as they are; only their shape is checked (a list of objects: a string reached
    # a chat template as an attribute error, and llama-server answers it with a 500).
    tools: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's and llama-server's: the last (assistant) message continued, not answered.
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None

    @field_validator("add_generation_prompt")
    @classmethod
    def _one_final_turn(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("continue_final_message"):  # as vLLM and llama-server refuse it
            raise ValueError("cannot be true together with 'continue_final_message'")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):  # as OpenAI refuses it
            raise ValueError("needs 'logprobs' set to true")
        return value

    _breakpoints: tuple[CacheBreakpoint, ...] = PrivateAttr(())

    @model_validator(mode="after")
    def _cache_breakpoints(self) -> ChatCompletionRequest:
        tools = self.tools
        if self.prompt_cache_retention is not None or _marked(self.messages, tools):  # (the hot path skips the rest)
            messages = [m.model_dump(exclude_none=True) for m in self.messages]
            self._breakpoints = chat_breakpoints(messages, tools, self.prompt_cache_retention)
        return self

    def _own_extra(self) -> set[str]:
        return {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "continue_final_message",
                "add_generation_prompt"}

    def to_generate(self, request_id: str) -> GenerateRequest:
        extra = self.passthrough()
        messages = [m.model_dump(exclude_none=True) for m in self.messages]
        if self._breakpoints:  # (templates render a tool's every key)
            messages, tools = without_cache_control(messages, extra.get("tools"))
            if tools is not None:
                extra["tools"] = tools
        return GenerateRequest(
            model=self.model,
            messages=messages,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop or [],  # type: ignore[arg-type]
            extra=extra,
            request_id=request_id,
            reuse=self.reuse,
            blend_ratio=self.blend_ratio,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            cache_breakpoints=self._breakpoints,
            continue_final_message=self.continue_final_message,
            # No assistant header after the messages (vLLM's add_generation_prompt false).
            prefix_only=self.add_generation_prompt is False,
        )


def _marked(messages: list[Message], tools: Any) -> bool:
    """Whether a message, a content part or a tool carries ``cache_control``."""
    for message in messages:
        if message.model_extra and "cache_control" in message.model_extra:
            return True
        if isinstance(message.content, list) and any(part.model_extra and "cache_control" in part.model_extra for part in message.content):
            return True
    return isinstance(tools, list) and any(isinstance(tool, dict) and "cache_control" in tool for tool in tools)


class CompletionRequest(_Sampling):
    """Body of POST /v1/completions: a prompt as text or token ids, or a batch of them (a
    list of texts or of token-id lists; prompt_batch.py serves each as its own request)."""

    # Candidates generated, the n most likely returned (hf/best_of.py); before ``prompt``, so
    # that the prompt count is checked against it.
    best_of: int | None = Field(None, ge=1, le=MAX_BATCH_PROMPTS)
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)  # the legacy API's: alternatives per token
    echo: bool = False

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1  # (n and stream are validated first)
        if value is not None and value < n:  # as OpenAI and vLLM refuse it
            raise ValueError(f"must be at least n ({n})")
        if value is not None and value > n and info.data.get("stream"):
            raise ValueError("above n cannot be streamed: the best candidates are known only when every one has ended")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any, info: ValidationInfo) -> Any:
        batch = value if isinstance(value, list) and value and isinstance(value[0], str | list) else [value]
        if len(batch) * max(info.data.get("n") or 1, info.data.get("best_of") or 1) > MAX_BATCH_PROMPTS:
            raise ValueError(f"at most {MAX_BATCH_PROMPTS} prompts per request, each choice counted (prompts x best_of or n)")
        if any(isinstance(p, list) and (not p or min(p) < 0) for p in batch):
            raise ValueError("a token-id prompt is a non-empty list of token ids (integers >= 0)")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the batch's in order."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]

    def _own_extra(self) -> set[str]:
        return {"prompt", "logprobs", "echo", "best_of"}

    @property
    def candidates(self) -> int:
        """Choices the backend generates: ``best_of`` where it asks for more than ``n``."""
        return max(self.n, self.best_of or 1)

    def to_generate(self, request_id: str, prompt: str | list[int] | None = None) -> GenerateRequest:
        """The request for ``prompt`` (default: the first, and for a single prompt the only)."""
        prompt = self.prompts()[0] if prompt is None else prompt
        ids = prompt if isinstance(prompt, list) else None
        return GenerateRequest(
            model=self.model,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=ids,  # type: ignore[arg-type]
            echo=self.echo,
            best_of=self.best_of if self.candidates > self.n else None,
            max_tokens=self.max_tokens if self.max_tokens is not None else 16,  # OpenAI's default
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop or [],  # type: ignore[arg-type]
            extra=self.passthrough(),
            request_id=request_id,
            reuse=self.reuse,
            blend_ratio=self.blend_ratio,
            logprobs=self.logprobs,
            cache_breakpoints=chat_breakpoints([], None, self.prompt_cache_retention),
        )


# KVStream's own body fields: read by KVStream, never sent upstream.
OWN_BODY_FIELDS = ("priority", "reuse", "blend_ratio")


def forwarded_request(data: dict[str, Any], chat: bool, request_id: str) -> GenerateRequest:
    """A GenerateRequest for a runtime that speaks OpenAI itself: the body goes upstream as
    the client sent it (KVStream's own fields removed) and the runtime judges every value.
    KVStream reads only what it schedules by (the prompt, for counting; ``max_tokens``, for
    the KV reservation; ``stream``), and never refuses a shape the runtime might accept:
    what it cannot read it estimates."""
    body = {k: v for k, v in data.items() if k not in OWN_BODY_FIELDS}
    model = body.get("model")
    limit = next((body[k] for k in ("max_completion_tokens", "max_tokens", "n_predict") if _non_negative_int(body.get(k))), None)
    choices = max((body[k] for k in ("n", "best_of") if _non_negative_int(body.get(k))), default=None)
    if limit is not None and choices is not None and choices > 1:
        # n choices (best_of candidates) share the prompt's KV in the runtime and grow n outputs.
        limit *= choices
    request = GenerateRequest(
        model=model if isinstance(model, str) and model else None,
        max_tokens=limit,
        request_id=request_id,
        stream=body.get("stream") is True,
        body=body,
    )
    if chat:
        messages = body.get("messages")
        # Counted (or estimated) from what is there; the runtime decides whether it is valid.
        request.messages = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    else:
        prompt = body.get("prompt")
        # Another shape (token ids, several prompts) is estimated by its text.
        request.prompt = prompt if isinstance(prompt, str) else ("" if prompt is None else str(prompt))
    return request


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class WarmRequest(BaseModel):
    """Body of POST /v1/warm: a prefix to prefill now so later requests find it cached.

    ``messages`` (a chat prefix, typically the system prompt), ``prompt`` (raw text, for
    completions), or ``system`` (shorthand for ``messages: [{"role": "system", ...}]``).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    prompt: str | None = Field(None, min_length=1)
    system: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> WarmRequest:
        given = [name for name in ("messages", "prompt", "system") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'messages', 'prompt' or 'system'")
        return self

    def to_generate(self, request_id: str) -> GenerateRequest:
        messages = [m.model_dump(exclude_none=True) for m in self.messages] if self.messages else None
        if self.system is not None:
            messages = [{"role": "system", "content": self.system}]
        return GenerateRequest(model=self.model, messages=messages, prompt=self.prompt, request_id=request_id)
