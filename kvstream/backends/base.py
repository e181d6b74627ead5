"""The interface every runtime adapter implements: ``BaseBackend`` for a runtime that runs its
own iterations (Ollama, llama.cpp, LM Studio, Foundry, any OpenAI server), and
``InProcessBackend`` for one that KVStream steps itself over real KV (hf)."""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from kvstream.backends import federation
from kvstream.backends.http import UpstreamSession, api_root, split_credentials
from kvstream.config import ConfigError, Settings
from kvstream.scheduler import Scheduler, Sequence
from kvstream.types import Embeddings, GenerateRequest, InfillParts, ModelInfo, RuntimeLimits, Token, UpstreamLoad

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the engine and scheduler adapt to it."""

    # A running sequence can be paused and resumed (swap/recompute), so the scheduler may
    # admit optimistically and preempt under memory pressure.
    preemptible: bool = False

class BaseBackend(abc.ABC):
    """A runtime adapter. Subclasses implement ``generate``, ``health`` and ``models``.

    Lifecycle: ``await start()`` once (open connections, discover the runtime), then any
    number of concurrent calls, then ``await close()``.
    """

    name: str = "base"
    default_url: str | None = None
    capabilities = Capabilities()
    # True for a runtime that speaks the client's OpenAI protocol itself: the route forwards
    # the client's body (GenerateRequest.body) and the runtime's own answer comes back.
    # False for a backend that translates (validated by KVStream, answered in its framing).
    forwards_body: bool = False
    # Whether the runtime judges a request's length against its context itself, as it would
    # directly: a prompt or max_tokens past the context goes upstream as sent (llama-server
    # answers its own 400 for the prompt, Ollama truncates it, LM Studio applies its overflow
    # policy; past max_tokens they stop, or shift, at the context's end; vLLM answers its
    # 400), KVStream counting what one request can hold. Not for an API KVStream answers
    # itself (GenerateRequest.refuse_past_context). False for the in-process engine, which is
    # the runtime: prompt + max_tokens past the context is its 400, as vLLM's.
    runtime_judges_length: bool = True
    # Whether a model name the runtime does not list is served by its one model, as a
    # single-model runtime does (llama-server); Ollama answers 404 instead.
    serves_any_model_name: bool = True
    # Whether the backend generates n > 1 choices of one request itself (the translating
    # routes refuse n > 1 otherwise; a forwarding runtime judges n itself).
    serves_n: bool = False
    # Whether a translating backend takes a completions prompt as token ids, and returns the
    # prompt with the completion (``echo``, with the prompt's log-probabilities when asked):
    # the in-process engine, which holds the tokenizer and the logits. The routes refuse them
    # (400) for the others; a forwarding runtime judges them itself.
    serves_token_prompts: bool = False
    serves_echo: bool = False
    # Whether the backend computes embeddings itself (the in-process engine, ``embed``):
    # /v1/embeddings and Ollama's /api/embed ask it where there is no runtime to forward to.
    serves_embeddings: bool = False
    # Whether the runtime may keep an Ollama model store of its own (Ollama; whatever a generic
    # OpenAI-compatible backend fronts): its /api/pull, /api/delete... pass through to it.
    # For the others KVStream answers them (routes_ollama.py).
    may_keep_ollama_store: bool = False
    # How the runtime keeps prompt caches, for replica routing's model of it: "slots" (one
    # prompt per slot: llama-server, Ollama, LM Studio) or "shared" (one prefix cache over
    # the whole KV pool: vLLM, SGLang).
    cache_model: str = "slots"
    # The runtime's own Prometheus route, whose families KVStream's /metrics carries after
    # its own (federation.py); None for a runtime that has none.
    metrics_path: str | None = None
    # Whether the engine probes the runtime's health all along (``routing.health_interval_s``),
    # keeping /status ``ready`` and ``kvstream_backend_up`` current. False for a backend that
    # probes its runtimes itself (several replicas, each ejected and let back on its own).
    engine_probes_health: bool = True
    # Set by the engine: called when the runtime lost its caches (see runtime_reloaded).
    on_reload: Callable[[str, GenerateRequest | None], None] | None = None
    # Set by the engine: called when a runtime that was saturated may take requests again.
    on_capacity: Callable[[], None] | None = None

    def __init__(
        self, base_url: str | None = None, model: str | None = None, settings: Settings | None = None, **overrides: Any
    ) -> None:
        """``settings`` is KVStream's one config object (defaults when None); ``overrides``
        are single settings by key (``request_timeout_s=0.5``) applied to a copy of it."""
        self.model = model
        self.settings = (settings or Settings()).with_overrides(**overrides)
        # Credentials in the URL (a runtime behind basic auth) are kept apart, so that the
        # URL shown in /status, /ready, logs and error messages never carries them.
        given, self._url_auth = split_credentials((base_url or self.default_base_url() or "").rstrip("/"))
        self.base_url = api_root(given)
        if self.base_url != given:
            logger.info("backend URL %s: KVStream adds the /v1 API paths itself, so it uses %s", given, self.base_url)
        if self._url_auth is not None and self.settings.backend.api_key is not None:
            raise ConfigError(
                "the backend URL carries credentials and backend.api_key is set: only one "
                "Authorization header can go upstream, so keep one of them"
            )

    @classmethod
    def default_base_url(cls) -> str | None:
        """Where the runtime is when no URL is given: ``default_url``, unless the runtime's own
        environment says otherwise (Ollama's OLLAMA_HOST)."""
        return cls.default_url

    def runtime_reloaded(self, why: str, request: GenerateRequest | None = None) -> None:
        """Report that the runtime restarted or reloaded its model, so its prompt caches are
        empty (``request``: the one that found out, which computes its own prefix anyway);
        the engine re-prefills the hottest prefixes."""
        if self.on_reload is not None:
            self.on_reload(why, request)

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

    async def identify(self) -> bool:
        """Whether what answers at ``base_url`` is this runtime, by something only it
        answers (``--backend auto`` must not take another KVStream, or any OpenAI server,
        for llama-server). Called between ``start()`` and ``close()``; by default the health
        probe."""
        return await self.health()

    @abc.abstractmethod
    async def models(self) -> list[ModelInfo]:
        """The models the runtime serves."""

    async def tokenize(self, request: GenerateRequest) -> list[int] | None:
        """Exact prompt token ids as the runtime will see them (chat template applied), or
        None when the backend cannot tell (the default); the engine then estimates."""
        return None

    def infill_tokens(self, parts: InfillParts) -> list[int] | None:
        """The fill-in-the-middle prompt of ``parts`` in the model's own tokens, laid out as
        llama-server's ``/infill`` lays it out; None where the backend holds no tokenizer (the
        default). BackendRejected (501) where the model has no fill-in-the-middle tokens."""
        return None

    def chat_template(self) -> str | None:
        """The chat template the backend renders chats with (the model's, or the one
        configured instead), or None where it holds none (a runtime templates itself)."""
        return None

    def text_tokens(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int] | None:
        """``text``'s token ids by the model's own tokenizer (llama-server's ``/tokenize``):
        ``add_special`` adds what the tokenizer puts around a text (a BOS), ``parse_special``
        reads special tokens' spellings as those tokens. None where the backend holds no
        tokenizer (the default: a runtime's is the runtime's own route)."""
        return None

    async def plain_text_ids(self, text: str) -> list[int] | None:
        """``text``'s token ids as plain text (nothing added around it, special tokens'
        spellings read as text): a generated answer's, to hand back in Ollama's ``context``.
        By ``text_tokens`` here; a runtime's tokenizer where the backend reaches one."""
        return await asyncio.to_thread(self.text_tokens, text, False, False)

    def token_bytes(self, token_ids: list[int]) -> list[bytes] | None:
        """Each token's bytes (a token may hold part of a UTF-8 character), or None where the
        backend holds no tokenizer; ValueError for an id outside the vocabulary."""
        return None

    def detokenize(self, token_ids: list[int]) -> str | None:
        """The text ``token_ids`` spell (special tokens included), or None where the backend
        holds no tokenizer; ValueError for an id outside the vocabulary."""
        return None

    def retained_prefixes(self, request: GenerateRequest, prompt_ids: list[int]) -> list[tuple[int, float]]:
        """``(prompt tokens, seconds)`` to keep cached after ``request``, one per
        ``request.cache_breakpoints`` that this backend can keep. Only a backend whose KV
        KVStream holds can (the in-process engine); a runtime evicts its own cache as it will,
        and KVStream's model of it must not say otherwise: none by default."""
        return []

    def can_resume(self, request: GenerateRequest) -> bool:
        """Whether this request could be paused and resumed (only asked of backends whose
        capabilities say ``preemptible``)."""
        return True

    def forget(self, request: GenerateRequest) -> None:
        """Drop whatever was saved to resume ``request`` after a preemption (it ended while
        paused). Backends that can pause a stream override this."""

    def default_max_tokens(self) -> int | None:
        """The tokens the backend generates for a request that sets no bound, or None (up to
        the end of the context; the default: a runtime applies its own)."""
        return None

    def end_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-generation tokens, where KVStream knows them (the in-process
        engine); empty for a runtime."""
        return ()

    def forward_passes(self) -> tuple[int, int] | None:
        """The in-process engine's forward passes so far and the requests they held (summed);
        None for a runtime, whose passes KVStream does not see."""
        return None

    def default_seed(self) -> int | None:
        """The sampling seed of a request that sets none, or None (a random one; the default:
        a runtime applies its own)."""
        return None

    async def limits(self) -> RuntimeLimits:
        """The runtime's memory and parallelism, as far as it reports them; by default
        only ``backend.parallel``, the slot count the operator says the runtime has."""
        return RuntimeLimits(parallel=self.settings.backend.parallel)

    def held_blocks(self, chain: list[bytes]) -> int | None:
        """Leading blocks of the prompt ``chain`` (``kv.hashing`` chained hashes) that the
        runtime holds where it could run now, by the backend's own model of it; None when
        it keeps none (the engine's model of the runtime's slots answers instead)."""
        return None

    def restorable_tokens(self, request: GenerateRequest) -> int:
        """Leading prompt tokens this runtime could load from saved state instead of
        computing them (llama.cpp slot files, shared by replicas using one directory); 0
        by default. Replica routing counts them as a partial hit."""
        return 0

    def load_report(self) -> UpstreamLoad | None:
        """The runtime's own latest report of its load (vLLM, SGLang metrics), or None
        when it reports none or the report is stale."""
        return None

    def saturated(self) -> bool:
        """Whether the runtime says it has no room now (it queues requests itself): the
        engine then holds new requests in its own queue, where they are ordered and can
        time out, until ``on_capacity`` is called. False by default."""
        return False

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for /status (no secrets)."""
        return {"type": self.name, "url": self.base_url, "model": self.model}

    def open_session(self) -> UpstreamSession:
        """An HTTP session to the runtime with the configured timeouts and credentials
        (``backend.api_key`` as a Bearer token, or the URL's own as basic auth)."""
        config = self.settings.backend
        headers = {}
        if config.api_key is not None:
            headers["Authorization"] = f"Bearer {config.api_key.get_secret_value()}"
        elif self._url_auth is not None:
            headers["Authorization"] = self._url_auth
        return UpstreamSession(
            self.base_url,
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            deadline=config.request_timeout_s,
            headers=headers,
        )

    def upstream(self) -> UpstreamSession | None:
        """The HTTP session to the runtime, for routes KVStream passes through unchanged;
        None for a backend with no runtime behind it (in-process)."""
        return None

    def embedding_width(self) -> int | None:
        """The length of the vectors ``embed`` returns, where the backend computes them and
        its model is loaded (None otherwise)."""
        return None

    async def embed(self, inputs: list[str | list[int]], truncate: bool = False) -> Embeddings:
        """One embedding per input (text, or token ids), for a backend that ``serves_embeddings``.
        An input longer than the model's context is cut to it with ``truncate``, else refused
        (BackendRejected, a 400)."""
        raise NotImplementedError(f"the {self.name} backend does not compute embeddings")

    def metric_families(self) -> Iterator[Any]:
        """Prometheus metric families of the backend's own (read at scrape time); none by default."""
        return iter(())

    async def runtime_metrics(self) -> list[federation.RuntimeScrape]:
        """The runtime's own Prometheus text, read now, for KVStream's /metrics: one entry per
        runtime that answered (none without a ``metrics_path``)."""
        scraped = await federation.scrape(self.upstream(), self.metrics_path, self.base_url)
        return [scraped] if scraped is not None else []


class LocalStream(Protocol):
    """One request inside an in-process backend: admitted once the backend's scheduler gives
    it a batch slot; iterating yields its tokens; close() aborts it if it has not finished."""

    admitted: asyncio.Future[None]

    def __aiter__(self) -> AsyncIterator[Token]: ...

    def close(self) -> None: ...


class InProcessBackend(BaseBackend):
    """A backend that runs the model in this process and owns its KV: admission, batching
    and preemption happen in its own step loop over its scheduler (the real pool)."""

    @property
    @abc.abstractmethod
    def scheduler(self) -> Scheduler | None:
        """The scheduler over the real KV pool, once started (None before)."""

    @abc.abstractmethod
    def submit(self, request: GenerateRequest, seq: Sequence) -> LocalStream:
        """Queue ``seq`` (already counted and checked by the engine) for generation.

        Raises SchedulerError when the queue refuses it."""
