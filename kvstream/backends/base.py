"""The backend interface every runtime adapter implements, and the types it speaks."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


class BackendError(Exception):
    """The runtime failed. ``status`` is what KVStream answers the client with."""

    def __init__(self, message: str, status: int = 502, *, code: str = "backend_error", retryable: bool = True):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.retryable = retryable


class BackendUnavailable(BackendError):
    """The runtime cannot be reached or is not ready (503; the client may retry)."""

    def __init__(self, message: str, status: int = 503, *, code: str = "backend_unavailable"):
        super().__init__(message, status, code=code, retryable=True)


class BackendInterrupted(BackendError):
    """KVStream stopped a running stream on purpose (preempted to make room); the backend
    saves its state and the request resumes later where it stopped."""

    def __init__(self, message: str = "preempted") -> None:
        super().__init__(message, 503, code="preempted", retryable=True)


class BackendRejected(BackendError):
    """The runtime refused the request itself (a 4xx from upstream, passed on as such)."""

    def __init__(self, message: str, status: int = 400, *, code: str = "invalid_request", param: str | None = None):
        super().__init__(message, status, code=code, retryable=False)
        self.param = param


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the engine and scheduler adapt to it."""

    # Token ids come back with each token (in-process); remote runtimes stream text.
    token_ids: bool = False
    # Prompt token counts are exact (the runtime tokenizes for us) rather than estimated.
    exact_prompt_tokens: bool = False
    # A running sequence can be paused and resumed (swap/recompute), so the scheduler may
    # admit optimistically and preempt under memory pressure.
    preemptible: bool = False
    # The runtime's KV really lives in KVStream's pool (in-process) rather than estimated.
    owns_kv: bool = False


@dataclass
class GenerateRequest:
    """One generation, runtime-neutral. ``messages`` for chat, ``prompt`` for completions."""

    model: str | None
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # OpenAI fields KVStream does not interpret (tools, response_format, penalties, ...):
    # passed through to runtimes that speak OpenAI, translated where a native API differs.
    extra: dict[str, Any] = field(default_factory=dict)
    request_id: str = ""
    # Filled by the engine for the backend: the slot or other routing hints.
    hints: dict[str, Any] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Token:
    """One step of a generation stream.

    ``delta`` is the OpenAI chat delta for this step ({"content": ...}, or tool_calls,
    reasoning_content...). The last Token of a stream carries ``finish_reason`` and, when the
    runtime reported it, ``usage``.
    """

    text: str = ""
    token_id: int | None = None
    delta: dict[str, Any] | None = None
    logprobs: Any = None
    finish_reason: str | None = None
    usage: Usage | None = None
    # True when the backend already holds the next token (they came in one network read or
    # one engine step): a writer may hold this one back and send both in one write.
    more: bool = False

    def chat_delta(self) -> dict[str, Any]:
        if self.delta is not None:
            return self.delta
        return {"content": self.text} if self.text else {}


def as_burst(tokens: list[Token]) -> list[Token]:
    """Mark tokens that arrived together: every one but the last has ``more`` set."""
    for token in tokens[:-1]:
        token.more = True
    return tokens


@dataclass
class ModelInfo:
    id: str
    owned_by: str = "kvstream"
    created: int = 0
    context_length: int | None = None


@dataclass
class RuntimeLimits:
    """What the runtime says about its own memory, to size KVStream's pool and batch."""

    n_ctx_total: int | None = None  # tokens of KV across all slots
    n_ctx_per_request: int | None = None  # the longest single sequence
    parallel: int | None = None  # requests the runtime runs at once


class BaseBackend(abc.ABC):
    """A runtime adapter. Subclasses implement ``generate``, ``health`` and ``models``.

    Lifecycle: ``await start()`` once (open connections, discover the runtime), then any
    number of concurrent calls, then ``await close()``.
    """

    name: str = "base"
    default_url: str | None = None
    capabilities = Capabilities()

    def __init__(self, base_url: str | None = None, model: str | None = None, **options: Any) -> None:
        self.base_url = (base_url or self.default_url or "").rstrip("/")
        self.model = model
        self.options = options

    async def start(self) -> None:
        """Open sessions and discover the runtime. Must not fail if the runtime is down."""

    async def close(self) -> None:
        """Release every connection."""

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[Token]:
        """Stream the generation. Raises BackendError subclasses for runtime failures; a
        cancelled iteration must cancel the upstream request."""

    @abc.abstractmethod
    async def health(self) -> bool:
        """True when the runtime answers and can serve."""

    @abc.abstractmethod
    async def models(self) -> list[ModelInfo]:
        """The models the runtime serves."""

    async def tokenize(self, request: GenerateRequest) -> list[int] | None:
        """Exact prompt token ids as the runtime will see them (chat template applied), or
        None when the runtime cannot tell; the engine then estimates."""
        return None

    def can_resume(self, request: GenerateRequest) -> bool:
        """Whether this request could be paused and resumed (only asked of backends whose
        capabilities say ``preemptible``)."""
        return True

    def forget(self, request: GenerateRequest) -> None:
        """Drop whatever was saved to resume ``request`` after a preemption (it ended while
        paused). Backends that can pause a stream override this."""

    async def limits(self) -> RuntimeLimits:
        """The runtime's memory and parallelism, as far as it reports them."""
        return RuntimeLimits()

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for /status (no secrets)."""
        return {"type": self.name, "url": self.base_url, "model": self.model}
