"""KVStreamEngine: one backend, one runner (and through it one scheduler and one block
manager), and the async glue between them. ``engine.generate(request)`` is the whole product
in one call: count the prompt, queue it, wait for admission, stream the tokens, and free
everything on every way out (finished, failed, cancelled).

Every request takes the same path, whatever the backend::

    submit() -> runner.enqueue()          counted, checked, queued (or refused at once)
    admitted()                            a batch slot, or QueueTimeout
    async for token in gen                runner.stream(): tokens, timing, usage
    close(outcome)                        runner.release(): blocks and slot freed, stats

What differs per backend (who schedules, whether a stream can be paused) is the runner's
business (runners.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstream import __version__
from kvstream.backends.base import BaseBackend
from kvstream.config import Settings
from kvstream.engine.estimate import CHARS_PER_TOKEN, estimate_tokens, flatten_messages
from kvstream.engine.hot import HotPrefixes
from kvstream.engine.runners import Runner, runner_for
from kvstream.kv.hashing import tenant_root
from kvstream.scheduler import NeverFits, Priority, Scheduler, SchedulerError, Sequence
from kvstream.types import BackendError, BackendRejected, GenerateRequest, ModelInfo, RuntimeLimits, Token, Usage

if TYPE_CHECKING:
    from kvstream.metrics import Metrics

logger = logging.getLogger(__name__)

# Worst-case output assumed for admission when a request sets no max_tokens and the model's
# context is unknown.
FALLBACK_MAX_TOKENS = 2048
# Hot prefixes re-prefilled after the runtime lost its caches.
REWARM_PREFIXES = 4
# How long the runtime's model list is reused before asking again.
MODELS_TTL_S = 5.0
# How often a runtime not yet sized (down, or still loading its model, when KVStream
# started) is probed until it is; after that, every ``routing.health_interval_s``.
PROBE_UNTIL_SIZED_S = 2.0
# Failed reads of a runtime's limits at first contact before it is served with the defaults
# meanwhile (about 10 s at PROBE_UNTIL_SIZED_S); it is still read again at every probe.
DEFAULTS_AFTER_UNREAD = 5


class QueueTimeout(SchedulerError):
    status = 503
    code = "queue_timeout"


# Prompts estimated on the event loop up to this size (a few ms); longer ones on a worker
# thread, so that one client's MB of text does not pause every other client's stream.
ESTIMATE_ON_LOOP_CHARS = 64 * 1024


@dataclass(frozen=True)
class _CountedPrompt:
    """A request counted and ready to queue: its prompt's ids, whether they are exact, and the
    cache breakpoints' prefixes the backend keeps (Backend.retained_prefixes)."""

    request: GenerateRequest
    prompt_ids: list[int]
    exact: bool
    retention: tuple[tuple[int, float], ...]


@dataclass
class EngineStats:
    """Counters behind /status and /metrics."""

    started_at: float = field(default_factory=time.time)
    requests_total: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    # The runtime refused them as invalid (a 4xx: the client's request, not a failure).
    requests_refused: int = 0
    requests_cancelled: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    # What runtimes reported they reused (usage cached_tokens, llama.cpp timings.cache_n),
    # and the prompt tokens of those same requests: the verified hit ratio.
    runtime_cached_tokens: int = 0
    runtime_reported_prompt_tokens: int = 0
    # Runtime restarts/reloads KVStream learnt of, and hot prefixes it re-prefilled after.
    runtime_reloads: int = 0
    rewarmed_prefixes: int = 0
    # Prompts counted with the model's own tokenizer vs estimated (4 characters a token).
    prompts_exact: int = 0
    prompts_estimated: int = 0
    # Prompts counted exactly past the runtime's context and forwarded for it to judge (Ollama
    # truncates them silently; llama-server refuses them).
    prompts_past_context: int = 0
    # Summed over finished requests: admission to the first token (the prompt's time), the
    # first token to the last (the answer's), and the longest prompt + answer, in tokens.
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    generation_steps: int = 0  # tokens after each first one (over that time: the generation rate)
    longest_sequence: int = 0
    # Sum of |estimated - reported| prompt tokens for runtimes that cannot tokenize.
    estimate_error: int = 0
    estimated_prompts: int = 0
    # (finished_at, ttft_s, e2e_s, decode tokens/s) of recent requests, for /status; ttft and
    # rate None for an answer that came back whole.
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1024))

    def reject(self, code: str) -> None:
        self.rejected[code] = self.rejected.get(code, 0) + 1


class Generation:
    """One request in flight: queued, then admitted, then streaming; always closed.

    Use as::

        gen = await engine.submit(request)      # may raise SchedulerError at once
        try:
            await gen.admitted()                 # may raise QueueTimeout
            async for token in gen: ...
        finally:
            gen.close()
    """

    def __init__(
        self, engine: KVStreamEngine, request: GenerateRequest, seq: Sequence, exact: bool, arrived_at: float | None = None
    ) -> None:
        self.engine = engine
        self.request = request
        self.seq = seq
        self.exact_prompt = exact
        self.ticket: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.submitted_at = time.monotonic()
        # When the request reached KVStream (before validation and tokenizing).
        self.arrived_at = arrived_at if arrived_at is not None else self.submitted_at
        self.admitted_at: float | None = None
        self.upstream_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.num_tokens = 0
        self._closed = False

    @property
    def queue_ms(self) -> float:
        """Time queued before admission; the scheduler stamps the admission (on the model
        runner's thread for the in-process engine)."""
        end = self.seq.admitted_at if self.seq.admitted_at is not None else time.monotonic()
        return max(0.0, end - self.submitted_at) * 1000

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt tokens found cached: KVStream's own figure (its prefix index)."""
        return self.seq.num_cached_tokens

    def verified_hit(self) -> tuple[int, str]:
        """The best prefix-hit figure known now, and where it comes from: ``runtime`` once
        the runtime reported what it reused, else ``kvstream`` (an inference for a remote
        runtime; exact for the in-process engine, which is its own runtime). A tenant's
        request (API keys with isolation) gets KVStream's figure only: the runtime's cache
        is shared by every tenant, so its count could confirm another's prompt."""
        if self.usage is not None and self.usage.cached_tokens is not None and self.request.cache_salt is None:
            return self.usage.cached_tokens, "runtime"
        return self.prefix_hit_tokens, "kvstream"

    def admit(self) -> None:
        """The runner gave this request a batch slot: wake ``admitted()``."""
        if self._closed or self.ticket.done():
            return
        self.ticket.set_result(None)
        stats = self.engine.stats
        stats.prefix_hit_tokens += self.seq.num_cached_tokens
        stats.prefix_query_tokens += len(self.seq.prompt_token_ids)

    async def admitted(self) -> None:
        """Wait for a batch slot and KV blocks: as long as the client does, unless
        ``scheduler.queue_timeout_s`` or the request's own deadline says less (then
        QueueTimeout)."""
        limits = [t for t in (self.engine.settings.scheduler.queue_timeout_s, self.request.queue_deadline_s) if t is not None]
        timeout = max(0.0, min(limits) - (time.monotonic() - self.arrived_at)) if limits else None
        if not self.ticket.done():  # admitted at submit(): the common case when not loaded
            await asyncio.wait({self.ticket}, timeout=timeout)
        if not self.ticket.done():
            # No await between the check and close(): the scheduler cannot admit us meanwhile.
            self.engine.stats.reject(QueueTimeout.code)
            self.close("rejected")
            waited = time.monotonic() - self.arrived_at
            raise QueueTimeout(f"The request waited {waited:.1f}s in the queue without a free slot (its deadline).")
        self.admitted_at = time.monotonic()

    def __aiter__(self) -> AsyncIterator[Token]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[Token]:
        engine = self.engine
        metrics = engine.metrics
        self.upstream_at = time.monotonic()
        if metrics is not None and self.admitted_at is not None:
            metrics.overhead.observe(max(0.0, self.upstream_at - self.arrived_at - (self.admitted_at - self.submitted_at)))
        async with contextlib.aclosing(engine.runner.stream(self)) as tokens:
            async for token in tokens:
                if not token.generated:  # a choice ended, the prompt echoed, its progress
                    yield token
                    continue
                if token.finish_reason is None:
                    now = time.monotonic()
                    if self.first_token_at is None:
                        self.first_token_at = now
                    elif metrics is not None:
                        metrics.observe_token_gap(now - self.last_token_at)  # type: ignore[operator]
                    self.last_token_at = now
                    self.num_tokens += 1
                    yield token
                    continue
                self.finish_reason = token.finish_reason
                self.usage = token.usage or Usage(len(self.seq.prompt_token_ids), self.num_tokens)
                if token.usage is not None and token.usage.cached_tokens is not None:
                    engine.stats.runtime_cached_tokens += token.usage.cached_tokens
                    engine.stats.runtime_reported_prompt_tokens += token.usage.prompt_tokens
                if token.usage is not None and not self.exact_prompt:
                    engine.stats.estimated_prompts += 1
                    engine.stats.estimate_error += abs(token.usage.prompt_tokens - len(self.seq.prompt_token_ids))
                yield token
                return

    def close(self, outcome: str | None = None) -> None:
        """Release the slot and every block. Idempotent; safe on every exit path."""
        if self._closed:
            return
        self._closed = True
        engine = self.engine
        engine.runner.release(self)
        engine._generations.pop(self.seq.seq_id, None)
        if not self.ticket.done():
            self.ticket.cancel()
        stats = engine.stats
        if outcome is None:
            outcome = "finished" if self.finish_reason else "cancelled"
        if outcome == "finished":
            stats.requests_finished += 1
            now = time.monotonic()
            # A non-streamed answer from a runtime comes back whole: no first token to time,
            # but its end-to-end time still counts (the Retry-After estimate reads it).
            ttft = rate = None
            if self.first_token_at is not None:
                ttft, decode = self.first_token_at - self.arrived_at, now - self.first_token_at
                rate = (self.num_tokens - 1) / decode if self.num_tokens > 1 and decode > 0 else None
                started = self.seq.admitted_at if self.seq.admitted_at is not None else self.upstream_at
                stats.prompt_seconds += max(0.0, self.first_token_at - (started or self.first_token_at))
                stats.generation_seconds += (self.last_token_at or self.first_token_at) - self.first_token_at
                stats.generation_steps += self.num_tokens - 1
            stats.recent.append((now, ttft, now - self.arrived_at, rate))
            if engine.metrics is not None:
                engine.metrics.observe_finished(self)
            if self.usage is not None:
                stats.prompt_tokens += self.usage.prompt_tokens
                stats.generation_tokens += self.usage.completion_tokens
                stats.longest_sequence = max(stats.longest_sequence, self.usage.prompt_tokens + self.usage.completion_tokens)
        elif outcome == "failed":
            stats.requests_failed += 1
        elif outcome == "refused":
            stats.requests_refused += 1
        elif outcome == "cancelled":
            stats.requests_cancelled += 1


class KVStreamEngine:
    """Owns the backend and the runner in front of it; one lifecycle for every request."""

    def __init__(self, backend: BaseBackend, settings: Settings | None = None, metrics: Metrics | None = None) -> None:
        """``settings`` defaults to the backend's own (``kvstream serve`` builds both from
        one object)."""
        self.backend = backend
        self.settings = settings or backend.settings
        self.metrics: Metrics | None = None
        if metrics is not None:
            self.attach_metrics(metrics)
        self.stats = EngineStats()
        self.limits = RuntimeLimits()
        self.runner: Runner = runner_for(backend, self.settings)
        self._generations: dict[str, Generation] = {}
        self._sized = False
        self._ready = False
        self._probed = False
        self._started = False
        self._models: list[ModelInfo] = []
        self._models_at = 0.0
        self._models_refresh: asyncio.Future[list[ModelInfo]] | None = None
        self.hot = HotPrefixes()
        self._rewarm: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        # The runtime restarted (seen by the backend between two probes): read its limits again.
        self._limits_stale = False
        self._limits_unread = 0  # probes in a row that failed to read the runtime's limits
        self._reread: asyncio.Task[None] | None = None
        backend.on_reload = self.runtime_reloaded

    # ----------------------------------------------------------------- setup
    def attach_metrics(self, metrics: Metrics) -> None:
        """Export this engine's state through ``metrics`` and observe its requests."""
        self.metrics = metrics
        metrics.bind(self)

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler over the pool this engine reports (the runner's)."""
        return self.runner.scheduler

    async def start(self) -> None:
        """Start the backend and size the pool from the runtime, if it answers; else keep
        probing it until it does."""
        if self._started:
            return
        self._started = True
        await self.backend.start()
        await self.refresh()
        if not self._ready:
            logger.warning(
                "backend %s at %s is not reachable; requests get 503 until it answers",
                self.backend.name,
                self.backend.base_url or "(undiscovered)",
            )
        self._probe = asyncio.get_running_loop().create_task(self._watch_health())

    async def _watch_health(self) -> None:
        """Probe the runtime in the background. One started alongside KVStream, or loading its
        model (llama-server answers 503 meanwhile), is sized as soon as it answers; before, it
        was sized at the first /ready only: until then the pool and the batch size stayed
        defaults (8 in flight against a runtime with fewer slots, its own queue taking the
        rest), hard inject stayed off. After that the probe keeps ``ready`` current (it
        changed only at /ready: a runtime that died went on reading as up), and sizes again a
        runtime that comes back with other limits (see ``refresh``)."""
        while self.backend.engine_probes_health or not self._sized:
            await asyncio.sleep(self.settings.routing.health_interval_s if self._sized else PROBE_UNTIL_SIZED_S)
            await self._probe_once()

    async def _probe_once(self) -> None:
        """``refresh`` for a background loop: one failed probe must not end the probing."""
        try:
            await self.refresh()
        except Exception:
            logger.exception("probing backend %s failed", self.backend.name)

    async def refresh(self) -> bool:
        """Probe the runtime (the background probe, and /ready); on first contact size the
        pool from what it reports, and again when it answers after it did not and reports
        other limits (a restart with other slots, another context or model)."""
        try:
            healthy = await self.backend.health()
        except Exception:  # a probe must never take the proxy down
            logger.exception("health probe of backend %s failed", self.backend.name)
            healthy = False
        came_back = healthy and not self._ready and self._probed
        if came_back or (self._probed and not healthy and self._ready):
            where = f"{self.backend.name} at {self.backend.base_url or '(undiscovered)'}"
            if healthy:
                logger.info("backend %s answers now", where)
            else:
                logger.warning("backend %s stopped answering its health probe", where)
        self._probed = True
        if healthy and (not self._sized or came_back or self._limits_stale):
            read = await self._read_limits()
            self._limits_unread = 0 if read is not None else self._limits_unread + 1
            limits = read
            if read is None and not self._sized and self._limits_unread >= DEFAULTS_AFTER_UNREAD:
                limits = RuntimeLimits()  # served with the defaults meanwhile, read again at each probe
            if limits is not None and (not self._sized or limits != self.limits):
                self._size(limits)  # if nothing runs now; else at a later probe
            self._limits_stale = not self._sized or read is None
        self._ready = healthy
        return healthy

    async def _read_limits(self) -> RuntimeLimits | None:
        """What the runtime reports of its limits: the defaults where its answer is malformed
        or needs a key KVStream lacks (said in the log), so that it is still served; None
        where reading failed (a timeout, a 5xx while it loads): read again at the next probe,
        not sized with the defaults until the runtime next goes down (``refresh``)."""
        try:
            return await self.backend.limits()
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # a malformed answer (a slot count "abc")
            logger.warning("could not read the runtime's limits: its answer is malformed (%s: %s)", type(exc).__name__, exc)
            return RuntimeLimits()
        except BackendError as exc:
            if exc.code == "backend_auth":
                # Its generations work (each client's own key goes with it), so only this
                # says why KVStream admits too many at once and estimates every prompt.
                logger.warning(
                    "the runtime at %s asks for an API key KVStream was not given (%s): set backend.api_key "
                    "(KVSTREAM_BACKEND__API_KEY) to its key; until then KVStream cannot read its slots or "
                    "context (defaults: %d in flight) nor count prompts exactly",
                    self.backend.base_url, exc.message, self.scheduler.config.max_batch_size,
                )
                return RuntimeLimits()
            # Said once per streak of failures: a runtime that never reports them is asked at
            # every probe.
            log = logger.warning if self._limits_unread == 0 else logger.debug
            log("could not read the runtime's limits (read again at the next probe): %s", exc.message)
            return None

    def _size(self, limits: RuntimeLimits) -> None:
        """Rebuild the pool and batch from ``limits`` if nothing holds a block now (else
        unsized: the background probe tries again)."""
        self._sized = self.runner.resize(limits)
        if not self._sized:
            return
        self.limits = limits
        bm = self.scheduler.bm
        logger.info(
            "KV pool: %d blocks x %d tokens%s; max in flight %d; model context %s",
            bm.pool.num_blocks,
            bm.block_size,
            " (sized from the runtime)" if limits.n_ctx_total and self.settings.memory.num_gpu_blocks == "auto" else "",
            self.scheduler.config.max_batch_size,
            limits.n_ctx_per_request or "unknown",
        )

    async def close(self) -> None:
        for task in (self._rewarm, self._probe, self._reread):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for gen in list(self._generations.values()):
            gen.close("cancelled")
        if self._models_refresh is not None and not self._models_refresh.done():
            self._models_refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError, BackendError):
                await self._models_refresh
        if self._started:
            self._started = False
            await self.backend.close()

    @property
    def ready(self) -> bool:
        return self._ready

    # ------------------------------------------------------------- requests
    async def models(self) -> list[ModelInfo]:
        """The runtime's models, asked at most every MODELS_TTL_S (every request resolves its
        model name against them). One refresh at a time, shared by every caller; while it
        runs, a list already known is answered at once (a runtime whose model list hangs
        must not delay requests), and kept while the runtime is down."""
        if self._models and time.monotonic() - self._models_at < MODELS_TTL_S:
            return self._models
        if self._models_refresh is None or self._models_refresh.done():
            self._models_refresh = asyncio.ensure_future(self._refresh_models())
        if self._models:
            return self._models
        # Shielded: a caller that leaves does not cancel the refresh the others wait for.
        return await asyncio.shield(self._models_refresh)

    async def _refresh_models(self) -> list[ModelInfo]:
        try:
            self._models = await self.backend.models()
        except BackendError as exc:
            if not self._models:
                raise
            logger.debug("the runtime's model list could not be refreshed (%s); keeping the last one", exc.message)
        finally:
            self._models_at = time.monotonic()  # a failed refresh too waits a TTL before the next
        return self._models

    async def prompt_tokens(self, request: GenerateRequest) -> tuple[list[int], bool]:
        """Prompt token ids and whether they are exact (the runtime's tokenizer, or the
        model's own) or estimated. A backend that cannot tell answers None at once."""
        try:
            tokens = await self.backend.tokenize(request)
        except BackendRejected:
            raise
        except BackendError as exc:
            logger.debug("tokenize failed (%s); estimating", exc.message)
            tokens = None
        if tokens:
            return tokens, True
        text = flatten_messages(request.messages) if request.is_chat else (request.prompt or "")
        if len(text) < ESTIMATE_ON_LOOP_CHARS:
            return estimate_tokens(text), False
        return await asyncio.to_thread(estimate_tokens, text), False  # a quarter second per 4 MB

    async def submit(
        self, request: GenerateRequest, priority: Priority = Priority.NORMAL, arrived_at: float | None = None
    ) -> Generation:
        """Count the prompt and queue the request. Raises NeverFits or QueueFull at once."""
        return self._queued(await self._counted(request), priority, arrived_at)

    async def submit_all(
        self, requests: list[GenerateRequest], priority: Priority = Priority.NORMAL, arrived_at: float | None = None
    ) -> list[Generation]:
        """The prompts of one request (a batch of completions): every prompt counted first,
        then all queued, so that one refused (a 400) leaves none queued or computing. A
        refusal while queueing (NeverFits, QueueFull) closes those queued before it."""
        counted = [await self._counted(request) for request in requests]
        gens: list[Generation] = []
        try:
            for prompt in counted:
                gens.append(self._queued(prompt, priority, arrived_at))
        except BaseException:
            for gen in gens:
                gen.close("rejected")
            raise
        return gens

    async def _counted(self, request: GenerateRequest) -> _CountedPrompt:
        self.stats.requests_total += 1
        self.hot.observe(request)
        prompt_ids, exact = await self.prompt_tokens(request)
        if exact:
            request.control.prompt_token_ids = prompt_ids  # for slot routing and KV inject
            self.stats.prompts_exact += 1
        else:
            self.stats.prompts_estimated += 1
        retention: tuple[tuple[int, float], ...] = ()
        limit = self.scheduler.config.max_model_len
        if request.cache_breakpoints and exact and (limit is None or len(prompt_ids) <= limit):
            # Off the event loop: each breakpoint's messages go through the chat template again.
            retention = tuple(await asyncio.to_thread(self.backend.retained_prefixes, request, prompt_ids))
        return _CountedPrompt(request, prompt_ids, exact, retention)

    def _queued(self, prompt: _CountedPrompt, priority: Priority, arrived_at: float | None) -> Generation:
        return self._enqueue(prompt.request, prompt.prompt_ids, prompt.exact, priority, arrived_at,
                             retention=prompt.retention)

    def reserve(self, body_size: int, max_tokens: int | None, priority: Priority = Priority.NORMAL) -> Generation:
        """A batch slot for a generation KVStream forwards without reading it (a runtime's
        native route: llama.cpp's /completion, /infill, Anthropic's /v1/messages...): queued
        and admitted like any request, its prompt estimated from the body's size. Wait with
        ``admitted()`` and ``close()`` it when the runtime's answer has been forwarded."""
        self.stats.requests_total += 1
        request = GenerateRequest(model=self.backend.model, max_tokens=max_tokens)
        # Stand-in ids, one per CHARS_PER_TOKEN bytes: a size, not content to match.
        prompt_ids = [0] * max(1, body_size // CHARS_PER_TOKEN)
        # Never preempted: KVStream cannot pause a stream it does not read.
        return self._enqueue(request, prompt_ids, False, priority, None, preemptible=False)

    def _sequence(self, request: GenerateRequest, prompt_ids: list[int], priority: Priority,
                  runtime_judges: bool = False) -> Sequence:
        # Without max_tokens a request gets the backend's default, else may run to the end of
        # the context; with no known context, assume FALLBACK_MAX_TOKENS, within what the pool
        # can ever hold.
        scheduler = self.scheduler
        pool_tokens = scheduler.bm.pool.num_blocks * scheduler.bm.block_size
        room = min(scheduler.config.max_model_len or pool_tokens, pool_tokens)
        if runtime_judges:
            # A prompt past what one request can hold goes upstream as sent, as it would
            # directly: llama-server answers its own 400, Ollama truncates it, LM Studio
            # applies its context-overflow policy. KVStream counts the most one request can
            # hold there.
            prompt_ids = prompt_ids[: room - 1]
        limit = scheduler.config.max_model_len
        if limit is None:
            limit = len(prompt_ids) + min(FALLBACK_MAX_TOKENS, pool_tokens - len(prompt_ids))
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = max(1, limit - len(prompt_ids))
            default = self.backend.default_max_tokens()
            max_tokens = max_tokens if default is None else min(default, max_tokens)
        elif runtime_judges:
            # So does a max_tokens past it: llama-server, Ollama and LM Studio stop, or shift,
            # at the end of the context (vLLM answers its 400); KVStream counts what fits.
            max_tokens = min(max_tokens, max(1, room - len(prompt_ids)))
        seq = Sequence(prompt_ids, max_tokens, priority)
        seq.cache_root = tenant_root(request.cache_salt)
        return seq

    async def fits(self, request: GenerateRequest) -> bool:
        """Whether ``request``'s prompt and ``max_tokens`` fit the model's context and the pool
        (NeverFits past it when ``submit`` refuses what is past the context), without
        queueing it."""
        prompt_ids, _ = await self.prompt_tokens(request)
        try:
            self.scheduler.check_fits(self._sequence(request, prompt_ids, Priority.NORMAL))
        except NeverFits:
            return False
        return True

    def _enqueue(
        self,
        request: GenerateRequest,
        prompt_ids: list[int],
        exact: bool,
        priority: Priority,
        arrived_at: float | None,
        preemptible: bool = True,
        retention: tuple[tuple[int, float], ...] = (),
    ) -> Generation:
        runtime_judges = self.backend.runtime_judges_length and not request.refuse_past_context
        context = self.scheduler.config.max_model_len
        if runtime_judges and exact and context is not None and len(prompt_ids) >= context:
            self.stats.prompts_past_context += 1
            logger.warning("[%s] the prompt has %d tokens, past the runtime's context of %d: forwarded as sent, the "
                           "runtime judges it (Ollama truncates it, llama-server refuses it)",
                           request.request_id, len(prompt_ids), context)
        seq = self._sequence(request, prompt_ids, priority, runtime_judges)
        seq.cache_retention = retention
        if self.backend.capabilities.preemptible:
            seq.preemptible = preemptible and self.backend.can_resume(request)
        gen = Generation(self, request, seq, exact, arrived_at)
        self._generations[seq.seq_id] = gen
        try:
            self.runner.enqueue(gen)
        except BaseException as exc:
            self._generations.pop(seq.seq_id, None)
            if isinstance(exc, SchedulerError):
                self.stats.reject(exc.code)
            raise
        return gen

    async def generate(
        self, request: GenerateRequest | str, priority: Priority = Priority.NORMAL, **sampling: Any
    ) -> AsyncIterator[Token]:
        """Queue, wait for admission and stream; the Python API's one call.

        ``request`` is a GenerateRequest, or a plain prompt string with sampling keywords
        (``max_tokens``, ``temperature``, ...)::

            async for token in engine.generate("Once upon a time", max_tokens=32):
                print(token.text, end="")
        """
        if not self._started:
            await self.start()
        if isinstance(request, str):
            request = GenerateRequest(model=self.backend.model, prompt=request, **sampling)
        gen = await self.submit(request, priority)
        async with contextlib.aclosing(self._admit_and_stream(gen)) as tokens:
            async for token in tokens:
                yield token

    async def _admit_and_stream(self, gen: Generation) -> AsyncIterator[Token]:
        """Wait for admission, then stream; ``gen`` is closed with its outcome on every exit."""
        outcome = "cancelled"
        try:
            await gen.admitted()
            async for token in gen:
                yield token
            outcome = "finished"
        except BackendError:
            outcome = "failed"
            raise
        finally:
            gen.close(outcome)

    async def warm(self, request: GenerateRequest | str, priority: Priority = Priority.LOW) -> dict[str, Any]:
        """Prefill ``request`` (a chat request, or a system prompt as a string) so that later
        requests sharing its prefix find it cached: in the in-process engine's pool, in a
        llama.cpp slot file, or in the runtime's own prompt cache. One token is generated and
        discarded. Returns what it cost and what was already cached."""
        if isinstance(request, str):
            request = GenerateRequest(model=self.backend.model, messages=[{"role": "system", "content": request}])
        request.max_tokens, request.temperature = 1, 0.0
        request.prefix_only = True
        if not self._started:
            await self.start()
        started = time.monotonic()
        gen = await self.submit(request, priority)
        async with contextlib.aclosing(self._admit_and_stream(gen)) as tokens:
            async for _token in tokens:  # the one token is discarded; the KV is what counts
                continue
        usage = gen.usage or Usage(len(gen.seq.prompt_token_ids), 0)
        return {
            "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": gen.prefix_hit_tokens,
            "elapsed_ms": round((time.monotonic() - started) * 1000, 1),
        }

    def runtime_reloaded(self, why: str, request: GenerateRequest | None = None) -> None:
        """The runtime lost its prompt caches (restart, model reload): re-prefill the hottest
        prefixes in the background, at low priority, before they are asked for. The prefix
        of ``request`` (the one that found out) is being computed by it already."""
        self.stats.runtime_reloads += 1
        # A restart the health probe did not see (back within one interval) may have brought
        # other slots or another context: read the limits again now, not at the next outage.
        self._limits_stale = True
        if self._reread is None or self._reread.done():
            self._reread = asyncio.get_running_loop().create_task(self._reread_limits())
        if self._rewarm is not None and not self._rewarm.done():
            return
        skip = HotPrefixes.prefix_of(request) if request is not None else None
        todo = [r for r in self.hot.top(REWARM_PREFIXES) if r.messages != skip]
        logger.info("%s: its caches are empty; re-prefilling the %d hottest prefixes", why, len(todo))
        if todo:
            self._rewarm = asyncio.get_running_loop().create_task(self._rewarm_prefixes(todo))

    async def _reread_limits(self) -> None:
        """Probe until the restarted runtime's limits are read and, if they changed, the pool
        is sized again (it cannot be while requests hold blocks: tried every 2 s)."""
        while self._limits_stale:
            await self._probe_once()
            if self._limits_stale:
                await asyncio.sleep(PROBE_UNTIL_SIZED_S)

    async def _rewarm_prefixes(self, requests: list[GenerateRequest]) -> None:
        for request in requests:
            try:
                await self.warm(request)
            except (SchedulerError, BackendError) as exc:
                logger.warning("re-prefilling a hot prefix failed: %s", exc)
                return  # the runtime is not ready: the requests themselves will compute them
            self.stats.rewarmed_prefixes += 1

    # ------------------------------------------------------------- snapshot
    def snapshot(self) -> dict[str, Any]:
        """The JSON body of /status."""
        sched, bm = self.scheduler, self.scheduler.bm
        pool = bm.pool
        hit_ratio = self.stats.prefix_hit_tokens / self.stats.prefix_query_tokens if self.stats.prefix_query_tokens else 0.0
        now = time.monotonic()
        waits = [now - g.submitted_at for g in self._generations.values() if not g.ticket.done()]
        return {
            "version": __version__,
            "backend": self.backend.describe() | {"ready": self._ready},
            "uptime_s": round(time.time() - self.stats.started_at, 1),
            "queue": {
                "waiting": len(sched.waiting),
                "running": len(sched.running),
                "swapped": len(sched.swapped),
                "max_batch_size": sched.config.max_batch_size,
                "max_queue_size": sched.config.max_queue_size,
                "oldest_wait_s": round(max(waits), 3) if waits else 0.0,
            },
            "kv": {
                "estimated": self.runner.kv_estimated,
                "block_size": bm.block_size,
                "blocks_total": pool.num_blocks,
                "blocks_used": pool.num_used,
                "blocks_free": pool.num_free,
                "blocks_cached": pool.num_cached,
                # Of the free cached ones, those a client asked to keep (cache_control)
                "blocks_retained": pool.num_retained,
                "usage_ratio": round(pool.usage(), 4),
                "cpu_blocks_total": bm.num_cpu_blocks,
                "cpu_blocks_free": bm.num_free_cpu_blocks,
                # Tokens runtimes generated past what KVStream reserved for them (a request
                # with no max_tokens and no known context): counted, not given blocks.
                "unreserved_tokens": sched.stats.append_overflows,
            },
            "prefix_cache": {
                "enabled": bm.enable_prefix_cache,
                # KVStream's own index: for a remote runtime an inference from what it sent
                # (on estimated token counts unless the runtime tokenizes for it).
                "estimated": self.runner.kv_estimated,
                "hit_tokens": self.stats.prefix_hit_tokens,
                "query_tokens": self.stats.prefix_query_tokens,
                "hit_ratio": round(hit_ratio, 4),
                # What the runtime itself reported it reused (verified).
                "runtime_cached_tokens": self.stats.runtime_cached_tokens,
                "runtime_prompt_tokens": self.stats.runtime_reported_prompt_tokens,
                "hot_prefixes": len(self.hot),
                "runtime_reloads": self.stats.runtime_reloads,
                "rewarmed_prefixes": self.stats.rewarmed_prefixes,
            },
            "requests": {
                "total": self.stats.requests_total,
                "finished": self.stats.requests_finished,
                "failed": self.stats.requests_failed,
                "refused": self.stats.requests_refused,
                "cancelled": self.stats.requests_cancelled,
                "rejected": dict(self.stats.rejected),
                "prompt_tokens": self.stats.prompt_tokens,
                "generation_tokens": self.stats.generation_tokens,
                # How KVStream sized each prompt: the model's own tokenizer, or an estimate.
                "prompts_counted": {"exact": self.stats.prompts_exact, "estimated": self.stats.prompts_estimated},
                # Counted past the runtime's context and forwarded for it to judge.
                "prompts_past_context": self.stats.prompts_past_context,
            },
            "preemption": {
                "preemptions": sched.stats.preemptions,
                "swap_outs": sched.stats.swap_outs,
                "swap_ins": sched.stats.swap_ins,
            },
            "model_context": self.limits.n_ctx_per_request,
            "recent": self._recent_window(now),
        }

    def recent_e2e_median_s(self, window_s: float = 60.0) -> float | None:
        """Median end-to-end time of requests finished in the last ``window_s`` seconds."""
        return self._recent_window(time.monotonic(), window_s)["e2e_p50_s"]

    def _recent_window(self, now: float, window_s: float = 60.0) -> dict[str, Any]:
        """Percentiles over requests finished in the last ``window_s`` seconds."""
        rows = [r for r in self.stats.recent if now - r[0] <= window_s]

        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            values = sorted(values)
            return round(values[min(len(values) - 1, int(q * len(values)))], 4)

        ttft = [r[1] for r in rows if r[1] is not None]
        e2e = [r[2] for r in rows]
        rates = [r[3] for r in rows if r[3] is not None]
        return {
            "window_s": window_s,
            "requests": len(rows),
            "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p90_s": pct(ttft, 0.9),
            "e2e_p50_s": pct(e2e, 0.5),
            "decode_tokens_per_s_p50": pct(rates, 0.5),
        }
