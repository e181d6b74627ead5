"""OpenAI response objects: stream chunks, SSE framing, and the non-streamed aggregate.

The stream is framed exactly as OpenAI's: a role chunk first, one chunk per token, a final
chunk with an empty delta and the finish_reason, then (with include_usage) a chunk whose
``choices`` is ``[]`` and which carries ``usage``, then ``data: [DONE]``. llama-server's own
extras, where a request asks for them: ``prompt_progress`` chunks before the first token, and
``timings`` on token chunks and the last ones.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstream.types import PromptProgress, Token, TokenLogprob, Usage
from kvstream.jsonfast import dumps

SYSTEM_FINGERPRINT = "kvstream"
DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


def random_hex(bits: int) -> str:
    """A random id of ``bits // 4`` hex digits. Ids only need to be unique, not secret, so
    this avoids uuid4's system call on every request."""
    return f"{random.getrandbits(bits):0{bits // 4}x}"


def usage_dict(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
        if usage.cache_write_tokens is not None:
            body["prompt_tokens_details"]["cache_write_tokens"] = usage.cache_write_tokens
    if usage.reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return body


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """Chat's ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {
        "content": [
            {"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
             "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """The legacy completions' ``logprobs`` object; ``offset``: where the first token's text
    starts in the choice's text."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        # An echoed prompt's first token has no log-probability and no alternatives: null.
        "top_logprobs": [None if e.logprob is None else {t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


@dataclass
class StreamFormatter:
    """Builds the chunks of one response, chat or completions, with one id and timestamp."""

    model: str
    chat: bool
    include_usage: bool = False
    n: int = 1  # choices; chunks carry each one's index
    # llama-server's ``timings_per_token``: the timings so far, on each token chunk and the
    # last ones (llama_timings.py); None: none.
    timings: Callable[[], dict[str, Any]] | None = None
    id: str = field(default="")
    created: int = field(default_factory=lambda: int(time.time()))
    _adopted: bool = field(default=False, init=False)
    _text_offsets: dict[int, int] = field(default_factory=dict, init=False)  # completions' text_offset, per choice

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + random_hex(96)
        self._render_template()

    def _render_template(self) -> None:
        # Every token chunk is the same JSON but for the delta (or text): render the rest
        # once, so a token costs one small json.dumps (this is the proxy's hot path).
        marker = "\u0000KVSTREAM\u0000"
        template = self._chunk([{"index": 0, ("delta" if self.chat else "text"): marker, "logprobs": None, "finish_reason": None}])
        head, tail = sse(template).split(dumps(marker))
        self._head, self._tail = head, tail

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs(self, token: Token | None) -> dict[str, Any] | None:
        """A chunk's logprobs: the runtime's own, or the token's rendered in this API's shape."""
        if token is None:
            return None
        entries = token.token_logprobs
        if entries is None:
            return token.logprobs
        if self.chat:
            return chat_logprobs(entries)
        offset = self._text_offsets.get(token.index, 0)
        self._text_offsets[token.index] = offset + sum(len(e.token) for e in entries)
        return completion_logprobs(entries, offset)

    def _choice(self, token: Token | None, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
        if self.chat:
            delta = token.chat_delta() if token is not None else {}
            return {"index": index, "delta": delta, "logprobs": self._logprobs(token), "finish_reason": finish_reason}
        return {
            "index": index,
            "text": token.text if token is not None else "",
            "logprobs": self._logprobs(token),
            "finish_reason": finish_reason,
        }

    def forward(self, events: list[dict[str, Any]]) -> bytes:
        """The runtime's own chunks, as it sent them (its ``model`` and ids too: llama-server
        names its own model whatever the request said). Chunks KVStream has to build later (a
        stream resumed after preemption) take the runtime's id, model and timestamp."""
        out = []
        for event in events:
            if not self._adopted and isinstance(event.get("id"), str):
                self._adopted = True
                self.id, self.created = event["id"], int(event.get("created") or self.created)
                self.model = str(event.get("model") or self.model)
                self._render_template()
            out.append(sse(event))
        return b"".join(out)

    def role_chunk(self) -> bytes | None:
        """The first chat chunk of each choice (``role: assistant``); completions have none."""
        if not self.chat:
            return None
        return b"".join(
            sse(self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]))
            for i in range(self.n)
        )

    def progress_chunk(self, progress: PromptProgress) -> bytes:
        """llama-server's ``return_progress`` report: how far the prompt is computed, on a
        chunk that says nothing of any choice (an empty delta or text)."""
        chunk = self._chunk([self._choice(None, None)])
        chunk["prompt_progress"] = progress.as_json()
        return sse(chunk)

    def token_chunk(self, token: Token) -> bytes:
        if self.timings is not None:
            chunk = self._chunk([self._choice(token, None, token.index)])
            chunk["timings"] = self.timings()
            return sse(chunk)
        if token.logprobs is not None or token.token_logprobs is not None or token.index:
            return sse(self._chunk([self._choice(token, None, token.index)]))
        value = token.chat_delta() if self.chat else token.text
        return self._head + dumps(value) + self._tail

    def choice_finish_chunk(self, token: Token) -> bytes:
        """The end of one of n choices while the others go on."""
        return sse(self._chunk([self._choice(None, token.choice_finish_reason, token.index)]))

    def finish_chunks(self, finish_reason: str, usage: Usage | None, index: int = 0) -> bytes:
        timings = self.timings() if self.timings is not None else None
        last = self._chunk([self._choice(None, finish_reason, index)])
        if timings is not None:
            last["timings"] = timings
        out = sse(last)
        if self.include_usage and usage is not None:
            chunk = self._chunk([])
            chunk["usage"] = usage_dict(usage)
            if timings is not None:
                chunk["timings"] = timings
            out += sse(chunk)
        return out + DONE

    @staticmethod
    def error_event(body: dict[str, Any]) -> bytes:
        """A mid-stream failure: an error payload, after which the stream simply ends
        (no [DONE], so no client can mistake it for a complete answer)."""
        return sse(body)


@dataclass
class ChoiceParts:
    """One choice of a non-streamed response, collected from its tokens."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # each token's, when asked for

    def add(self, token: Token) -> None:
        if token.token_logprobs is not None:
            self.logprobs.extend(token.token_logprobs)
        delta = token.chat_delta()
        if delta.get("content"):
            self.text.append(delta["content"])
        elif token.delta is None and token.text:
            self.text.append(token.text)
        if delta.get("reasoning_content"):
            self.reasoning.append(delta["reasoning_content"])
        for call in delta.get("tool_calls") or []:
            index = call.get("index", len(self.tool_calls))
            merged = self.tool_calls.setdefault(index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            if call.get("id"):
                merged["id"] = call["id"]
            function = call.get("function") or {}
            merged["function"]["name"] += function.get("name") or ""
            merged["function"]["arguments"] += function.get("arguments") or ""

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text) if self.text or not self.tool_calls else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return message


@dataclass
class Aggregate:
    """Collects a stream into one non-streamed response (a translating backend's): every
    choice by its index. A runtime that speaks OpenAI answers non-streamed itself."""

    choices: dict[int, ChoiceParts] = field(default_factory=dict)

    def add(self, token: Token) -> None:
        """A token of a choice, or the end of one (``choice_finish_reason``, or the stream's
        last token's ``finish_reason``)."""
        parts = self.choices.setdefault(token.index, ChoiceParts())
        reason = token.choice_finish_reason or token.finish_reason
        if reason is not None:
            parts.finish_reason = reason
        else:
            parts.add(token)

    def _body(self, fmt: StreamFormatter, usage: Usage, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": fmt.id,
            "object": "chat.completion" if fmt.chat else "text_completion",
            "created": fmt.created,
            "model": fmt.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
            "usage": usage_dict(usage),
        }

    def chat_response(self, fmt: StreamFormatter, usage: Usage) -> dict[str, Any]:
        choices = [
            {"index": i, "message": parts.message(), "logprobs": chat_logprobs(parts.logprobs) if parts.logprobs else None,
             "finish_reason": parts.finish_reason}
            for i, parts in sorted(self.choices.items())
        ]
        return self._body(fmt, usage, choices)

    def completion_response(self, fmt: StreamFormatter, usage: Usage) -> dict[str, Any]:
        choices = [
            {"index": i, "text": "".join(parts.text), "logprobs": completion_logprobs(parts.logprobs) if parts.logprobs else None,
             "finish_reason": parts.finish_reason}
            for i, parts in sorted(self.choices.items())
        ]
        return self._body(fmt, usage, choices)
