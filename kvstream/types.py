"""The shared vocabulary of every layer: requests, tokens, usage, runtime facts and errors.

It sits at the bottom: it imports nothing from KVStream, and the mechanism, the backends, the
in-process engine, the engine and the API all speak it."""

from __future__ import annotations

from collections.abc import Callable
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
    """The runtime refused the request itself (a 4xx from upstream, passed on as such).

    ``body`` is the runtime's own JSON error body, when it sent one: the client gets it
    unchanged, as it would have from the runtime."""

    def __init__(
        self, message: str, status: int = 400, *, code: str = "invalid_request", param: str | None = None, body: Any = None
    ):
        super().__init__(message, status, code=code, retryable=False)
        self.param = param
        self.body = body


@dataclass
class Embeddings:
    """What a backend that computes embeddings itself returns: one unit-length vector per
    input, in order, and the tokens read."""

    vectors: list[list[float]]
    prompt_tokens: int


@dataclass
class ResumePoint:
    """Where a preempted generation continues: what the client already has."""

    text: str  # the text streamed before the pause
    tokens: int  # how many tokens that was


class RequestControl:
    """The typed channel between the engine and the backend running one request.

    Engine to backend: ``prompt_token_ids`` (exact ids when the runtime tokenized the prompt),
    ``preempted`` and ``save_state`` (the stream is being paused, and whether the runtime's
    state is worth saving: a swap keeps it, a recompute does not), ``resume`` (where the next
    leg continues after a pause).

    Backend to engine: ``on_interrupt`` (how to stop the running stream from outside),
    ``cached_tokens`` (prompt tokens the runtime reported reusing), ``saved_state`` (an opaque
    handle to the state a paused request left behind, given back to the backend on resume or
    to ``forget``).

    Backend to API: ``runtime_grant`` (the CORS headers of the runtime's answer, {} for none;
    None until one came), which the client's answer carries as the runtime gave them.
    """

    __slots__ = (
        "prompt_token_ids", "prefix_chain", "preempted", "save_state", "resume", "cached_tokens", "saved_state",
        "replica", "route", "runtime_grant",
        "_interrupt",
    )

    def __init__(self) -> None:
        self.prompt_token_ids: list[int] | None = None
        # The prompt's chained block hashes (exact or estimated ids), as the runner's model
        # of the runtime's slots computed them: what replica routing matches prefixes on.
        self.prefix_chain: list[bytes] | None = None
        self.preempted = False
        self.save_state = True
        self.resume: ResumePoint | None = None
        self.cached_tokens: int | None = None
        self.saved_state: str | None = None
        # Several replicas: the one that served the request, and why it was chosen (hit,
        # miss, balance, session, round_robin, least_loaded); None with one runtime.
        self.replica: str | None = None
        self.route: str | None = None
        self.runtime_grant: dict[str, str] | None = None
        self._interrupt: Callable[[], None] | None = None

    def on_interrupt(self, callback: Callable[[], None] | None) -> None:
        """Register how to stop the stream now running (replaces an earlier leg's)."""
        self._interrupt = callback

    def interrupt(self) -> None:
        """Stop the running stream, once: its pending read fails and the backend cleans up."""
        callback, self._interrupt = self._interrupt, None
        if callback is not None:
            callback()


@dataclass(frozen=True, slots=True)
class CacheBreakpoint:
    """A client asked for a prefix of its prompt to stay cached for ``seconds`` after the
    request (Anthropic's ``cache_control``, OpenAI's ``prompt_cache_retention``).
    ``messages``: the prefix that renders the first that many chat messages (with the tools;
    0: the tools alone); None: the whole prompt."""

    seconds: float
    messages: int | None = None


@dataclass
class GenerateRequest:
    """One generation, runtime-neutral. ``messages`` for chat, ``prompt`` for completions."""

    model: str | None
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    # A completions prompt given as token ids (``prompt`` is then None): backends that
    # serve them (``serves_token_prompts``, the in-process engine) take them as they are.
    prompt_token_ids: list[int] | None = None
    # Completions' ``echo``: the prompt comes back before the completion (with its tokens'
    # log-probabilities when ``logprobs`` is set; the first token's is None).
    echo: bool = False
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
    # The API this request came by answers 400 for a prompt (and max_tokens) past the model's
    # context (OpenAI's Responses and Anthropic's Messages, which KVStream answers itself):
    # KVStream refuses it. False: a remote runtime judges it as it would directly (see
    # BaseBackend.runtime_judges_length).
    refuse_past_context: bool = False
    # Prefill the prompt as a prefix of later ones (a warm-up): a backend that templates the
    # prompt itself leaves the assistant header off, which later requests would not share.
    prefix_only: bool = False
    # The tenant (API key) this request's cached prefixes belong to; None: shared.
    cache_salt: str | None = None
    # X-KVStream-Session: requests of one conversation go to one replica.
    session: str | None = None
    # Longest this request may wait for a slot (the client's X-KVStream-Deadline-Ms);
    # None: scheduler.queue_timeout_s alone.
    queue_deadline_s: float | None = None
    # In-process engine: "exact" or "blend" reuse and the blend's repair ratio; None = the
    # configured default.
    reuse: str | None = None
    blend_ratio: float | None = None
    # Choices to generate; the prompt is computed once (backends with ``serves_n``).
    n: int = 1
    # Completions' ``best_of``: candidates to generate, of which the ``n`` with the highest
    # log-probability per token are returned (not streamed); None: the ``n`` choices alone.
    best_of: int | None = None
    # Each token's log-probability, with this many of the most likely alternatives (0: its
    # own only); None: none. Read by translating backends (the client's body carries it to
    # a runtime that speaks OpenAI).
    logprobs: int | None = None
    # Whether the client streams. Backends that forward the runtime's own answer ask the
    # runtime the same way (and still count tokens); translating backends always stream.
    stream: bool = True
    # The client's JSON body as sent (KVStream's own fields removed, ``model`` resolved):
    # forwarded as it is by backends that speak the client's protocol natively, so that
    # nothing the runtime understands is lost. None: built from the fields above.
    body: dict[str, Any] | None = None
    # The client's own request headers that go upstream with ``body`` (end to end ones only:
    # not hop-by-hop, not those describing the body KVStream re-serializes, not KVStream's own
    # credentials or controls): a runtime feature keyed by a header (llama-server's
    # X-Conversation-Id stream sessions) works through KVStream as it does directly.
    headers: dict[str, str] | None = None
    control: RequestControl = field(default_factory=RequestControl, repr=False, compare=False)
    # Prefixes to keep cached after the request; only a backend that holds the KV itself
    # (the in-process engine) can keep them (Backend.retained_prefixes).
    cache_breakpoints: tuple[CacheBreakpoint, ...] = ()
    # A chat whose last message is the assistant's, to be continued (Anthropic's and Ollama's
    # prefill, vLLM's continue_final_message): rendered without its end of turn and with no
    # new assistant header; the answer is what follows it.
    continue_final_message: bool = False
    # The prompt is a fill-in-the-middle one (its ids built by Backend.infill_tokens): the
    # tokens a code model may end the middle with end the generation too.
    fill_in_middle: bool = False
    # Streamed: report the prompt's computation as it goes (llama-server's ``return_progress``),
    # as Tokens carrying ``progress``; set by the routes that render them, read by backends
    # that compute the prompt themselves (the in-process engine).
    return_progress: bool = False

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class InfillParts:
    """What llama-server's ``/infill`` fills in: the code before the cursor (``prefix``), the
    start of the line being written (``prompt``), the code after it (``suffix``), other files
    of the project as ``(file name, text)``, and the tokens to write (-1: unbounded), which
    the prompt leaves room for."""

    prefix: str
    suffix: str
    prompt: str = ""
    other_files: tuple[tuple[str, str], ...] = ()
    n_predict: int = -1


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None
    # Of completion_tokens, those the model spent thinking, where the backend knows (the
    # in-process engine reading a thinking block); None otherwise.
    reasoning_tokens: int | None = None
    # Of prompt_tokens, those computed and written to the cache under a client's retention
    # (cache_control, prompt_cache_retention: past cached_tokens, up to its furthest mark);
    # None where nothing was asked or the backend cannot keep it.
    cache_write_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def summed(cls, usages: list[Usage]) -> Usage:
        """The usage of several generations answered as one (a completions batch): each count
        summed, an optional one None where none of them has it."""

        def optional(name: str) -> int | None:
            values = [getattr(u, name) for u in usages if getattr(u, name) is not None]
            return sum(values) if values else None

        return cls(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                   optional("cached_tokens"), optional("reasoning_tokens"), optional("cache_write_tokens"))


@dataclass(frozen=True, slots=True)
class PromptProgress:
    """How far the prompt of a request is computed, as llama-server's ``return_progress``
    reports it: ``total`` prompt tokens, ``cache`` of them found cached, ``processed`` (the
    cached ones included) so far, ``time_ms`` since its computation began."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def as_json(self) -> dict[str, int]:
        """llama-server's ``prompt_progress`` object."""
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": round(self.time_ms)}


@dataclass
class TokenLogprob:
    """One generated token's log-probability, runtime-neutral: each API renders its own
    shape (openai_format for chat and completions, routes_ollama for Ollama's)."""

    token: str  # its text (a partial UTF-8 character shows as U+FFFD; ``bytes`` are exact)
    logprob: float | None  # None only for an echoed prompt's first token: nothing predicts it
    bytes: list[int]
    top: list[TokenLogprob] = field(default_factory=list)  # the most likely tokens at its place
    token_id: int | None = None  # where the backend knows it (the in-process engine): llama.cpp's API shows it


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
    # The runtime's own stream chunks that carried this step (OpenAI-compatible runtimes):
    # forwarded to the client with only the fields KVStream owns rewritten, so logprobs,
    # timings and any other field arrive as the runtime sent them. None: build the chunk.
    events: list[dict[str, Any]] | None = None
    # On the last Token of a non-streamed forward: the runtime's whole response body.
    payload: dict[str, Any] | None = None
    # The log-probabilities of the tokens this step's text came from, from a backend that
    # computes or translates them (the in-process engine; a runtime answering a body KVStream
    # built); ``logprobs`` above is a runtime's own, forwarded as it came.
    token_logprobs: list[TokenLogprob] | None = None
    # With n > 1: the choice this step belongs to, and, on a choice's last token while others
    # go on, why that choice ended (the stream's last Token carries ``finish_reason``).
    index: int = 0
    choice_finish_reason: str | None = None
    # On the last Token: the stop string that ended the generation, where the backend knows
    # it (the in-process engine); None when it ended otherwise or the runtime does not say.
    stop_sequence: str | None = None
    # The echoed prompt (completions' ``echo``), sent before the first generated token: not
    # a generated token (no time-to-first-token, not counted).
    echo: bool = False
    # A report of the prompt's computation (``GenerateRequest.return_progress``), sent before
    # the first generated token: not a token either.
    progress: PromptProgress | None = None
    # Generated earlier and given out only once the generation ended (best_of's chosen
    # candidates): the answer comes back whole, so its tokens are not timed as they arrive.
    replayed: bool = False

    @property
    def generated(self) -> bool:
        """Whether this step is generated text (or the stream's end), as opposed to the end of
        one choice among several, the echoed prompt, a progress report or a replayed token:
        what the engine counts and times as tokens."""
        return self.choice_finish_reason is None and not self.echo and self.progress is None and not self.replayed

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
    # What the model can be asked for, in Ollama's words ("completion", "tools", "thinking",
    # "embedding"), where the backend knows; empty: only completion is claimed.
    capabilities: tuple[str, ...] = ()
    # Ollama's ``details`` (family, parameter_size, quantization_level, format) where known.
    details: dict[str, str] = field(default_factory=dict)
    # Bytes of the weights in memory (Ollama's ``size``), and of them on the GPU (``size_vram``);
    # 0 where the backend cannot tell.
    size: int = 0
    size_vram: int = 0
    # The model's own metadata in GGUF's names (``general.architecture``, ``general.basename``...)
    # where the backend reads it: Ollama's ``model_info``.
    metadata: dict[str, str] = field(default_factory=dict)


def parameter_size(count: int) -> str:
    """A parameter count as Ollama writes it in ``details``: 135M, 1.5B."""
    if count >= 10**9:
        return f"{count / 10**9:.1f}B".replace(".0B", "B")
    return f"{round(count / 10**6)}M"


@dataclass
class RuntimeLimits:
    """What the runtime says about its own memory, to size KVStream's pool and batch."""

    n_ctx_total: int | None = None  # tokens of KV across all slots
    n_ctx_per_request: int | None = None  # the longest single sequence
    parallel: int | None = None  # requests the runtime runs at once


@dataclass
class UpstreamLoad:
    """What a serving engine (vLLM, SGLang) reports of its own load in its Prometheus
    metrics: requests it runs and queues, how full its KV cache is, how often its prefix
    cache hits, and how many tokens of KV it has. None where the engine did not say."""

    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None  # 0..1
    prefix_hit_rate: float | None = None  # 0..1, over the last reading interval when known
    kv_capacity_tokens: int | None = None
    read_at: float = 0.0  # time.monotonic() of the reading
