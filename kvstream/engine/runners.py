"""What differs between backends, behind one interface: a Runner queues, admits, streams and
releases the requests of one KVStreamEngine, whose lifecycle (submit, admitted, stream,
close) is the same for all of them.

- ``RemoteRunner``: a runtime that runs its own iterations (Ollama, llama.cpp, LM Studio,
  Foundry, any OpenAI server). KVStream's own scheduler admits (a batch slot and an estimate
  of the runtime's KV), accounts the tokens as they stream, and pauses and resumes streams
  where the backend can save the runtime's state (llama.cpp slot swap).
- ``LocalRunner``: the in-process engine. Its model runner's scheduler admits, batches and
  preempts over real KV on its own thread; this side forwards and reports.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstream.backends.affinity import SlotModel
from kvstream.backends.base import BaseBackend, InProcessBackend, LocalStream
from kvstream.config import Settings
from kvstream.kv.block_manager import UNKNOWN_TOKEN, BlockManager
from kvstream.scheduler import Scheduler, SchedulerConfig, Sequence, SeqStatus
from kvstream.types import BackendError, ResumePoint, RuntimeLimits, Token

if TYPE_CHECKING:
    from kvstream.engine.core import Generation

# Pool size when num_gpu_blocks is auto and the runtime reports nothing (tokens).
FALLBACK_POOL_TOKENS = 32768


def build_scheduler(
    settings: Settings, limits: RuntimeLimits, backend: BaseBackend, affinity: Callable[[Sequence], int] | None = None
) -> Scheduler:
    """A scheduler and block manager sized by the settings and what the runtime reports.
    ``affinity``: what lpm orders by; without it the policy ``auto`` is fcfs."""
    memory, sched = settings.memory, settings.scheduler
    if memory.num_gpu_blocks == "auto":
        num_blocks = max(1, (limits.n_ctx_total or FALLBACK_POOL_TOKENS) // memory.block_size)
    else:
        num_blocks = memory.num_gpu_blocks
    max_batch = sched.remote_batch_size()
    if limits.parallel:
        # More in flight than the runtime has slots only queues inside the runtime, where
        # nobody can see or order it.
        max_batch = min(max_batch, limits.parallel)
    preemptible = backend.capabilities.preemptible
    bm = BlockManager(
        num_blocks,
        memory.block_size,
        memory.num_cpu_blocks if preemptible else 0,
        enable_prefix_cache=settings.prefix_cache.enabled,
        max_prefix_length=settings.prefix_cache.max_prefix_length,
        model_identity=f"{backend.name}:{backend.base_url}:{backend.model}",
    )
    config = SchedulerConfig(
        max_batch_size=max_batch,
        preemption_policy=sched.preemption_policy,
        policy=resolve_policy(sched.policy, affinity is not None),
        lpm_max_overtakes=sched.lpm_max_overtakes,
        lpm_window=sched.lpm_window,
        max_queue_size=sched.max_queue_size,
        max_model_len=limits.n_ctx_per_request,
        cache_ttl_s=settings.prefix_cache.ttl_seconds,
    )
    return Scheduler(bm, config, preemptible=preemptible, affinity=affinity)


def resolve_policy(policy: str, has_affinity: bool) -> str:
    """``auto``: lpm where the scheduler can tell what the runtime holds, else fcfs."""
    if policy == "auto":
        return "lpm" if has_affinity else "fcfs"
    return policy


class Runner(abc.ABC):
    """The backend-specific half of a request's lifecycle."""

    # True when the KV figures estimate a remote runtime's memory rather than measure ours.
    kv_estimated: bool = True

    @property
    @abc.abstractmethod
    def scheduler(self) -> Scheduler:
        """The scheduler whose queues and pool /status and /metrics report."""

    def resize(self, limits: RuntimeLimits) -> bool:
        """Adopt what the runtime reports about its memory, if that changes anything now.
        Returns True once sized (the engine stops asking)."""
        return True

    @abc.abstractmethod
    def enqueue(self, gen: Generation) -> None:
        """Queue ``gen``; ``gen.admit()`` is called once it has a batch slot (possibly at
        once). Raises SchedulerError when the request is refused."""

    @abc.abstractmethod
    def stream(self, gen: Generation) -> AsyncIterator[Token]:
        """The admitted request's tokens, the last one carrying ``finish_reason``."""

    @abc.abstractmethod
    def release(self, gen: Generation) -> None:
        """Free everything ``gen`` holds, whatever state it is in. Called exactly once."""


@dataclass(eq=False)
class _Leg:
    """A remote request's streaming state across preemptions."""

    gen: Generation
    resumable: bool
    paused: asyncio.Future[None] | None = None  # set while preempted
    text: list[str] = field(default_factory=list)  # streamed so far, for a resumed leg


class RemoteRunner(Runner):
    """Admission and accounting in front of a runtime that owns its KV. Admission is
    event-driven: every arrival and every exit runs one synchronous scheduling pass."""

    kv_estimated = True

    def __init__(self, backend: BaseBackend, settings: Settings) -> None:
        self.backend = backend
        self.settings = settings
        self._legs: dict[str, _Leg] = {}
        self._build(RuntimeLimits())
        backend.on_capacity = self._kick

    def _build(self, limits: RuntimeLimits) -> None:
        """The scheduler, and the model of the runtime's slots its lpm policy orders by."""
        batch = self.settings.scheduler.remote_batch_size()
        slots = min(batch, limits.parallel or batch)
        # No URL in the identity: chains are shared with replica routing, which must hash a
        # prompt alike in every KVStream in front of the same replicas.
        self.slots = SlotModel(slots, self.settings.memory.block_size, f"{self.backend.name}:{self.backend.model}")
        self._chains: dict[str, list[bytes]] = {}  # per sequence, computed once
        self._scheduler = build_scheduler(self.settings, limits, self.backend, self._held_tokens)

    def _chain(self, seq: Sequence) -> list[bytes]:
        chain = self._chains.get(seq.seq_id)
        if chain is None:
            chain = self._chains[seq.seq_id] = self.slots.chain(seq.prompt_token_ids, seq.cache_root)
        return chain

    def _held_tokens(self, seq: Sequence) -> int:
        """lpm's measure: prompt tokens of ``seq`` that an idle runtime slot holds (by the
        backend's own model where it keeps one: several replicas)."""
        chain = self._chain(seq)
        held = self.backend.held_blocks(chain)
        return (self.slots.held_blocks(chain) if held is None else held) * self.slots.block_size

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    def resize(self, limits: RuntimeLimits) -> bool:
        """Rebuild the pool from the runtime's figures, only while nothing holds a block."""
        if not self._scheduler.bm.is_idle() or self._scheduler.waiting:
            return False
        self._build(limits)
        return True

    def enqueue(self, gen: Generation) -> None:
        self._scheduler.add(gen.seq)
        self._legs[gen.seq.seq_id] = _Leg(gen, resumable=self.backend.capabilities.preemptible)
        self._kick()

    async def stream(self, gen: Generation) -> AsyncIterator[Token]:
        leg = self._legs[gen.seq.seq_id]
        request = gen.request
        while True:
            while leg.paused is not None:  # preempted: wait until the scheduler resumes us
                paused = leg.paused
                await paused
                if leg.paused is paused:  # not preempted again in the meantime
                    leg.paused = None
            try:
                # Closed explicitly, not left to garbage collection: closing is what releases
                # the runtime's connection (and lets a backend finish its bookkeeping) at once.
                async with contextlib.aclosing(self.backend.generate(request)) as upstream:
                    async for token in upstream:
                        if leg.paused is not None:
                            break  # preempted: this token is regenerated by the resumed leg
                        if token.finish_reason is None:
                            token_id = UNKNOWN_TOKEN if token.token_id is None else token.token_id
                            grown = self._scheduler.append(gen.seq, token_id)
                            if grown.preempted:  # short of blocks: someone (maybe us) pauses
                                self._pause(grown.preempted)
                            if leg.resumable:
                                leg.text.append(token.text)
                        yield token
                        if token.finish_reason is not None:
                            return
            except BackendError:
                if leg.paused is None:
                    raise
            if leg.paused is None:
                return  # the runtime ended the stream without finishing (the caller reports it)
            # Paused: the backend saved the runtime's state while closing; the next leg
            # continues from what the client already has.
            request.control.resume = ResumePoint("".join(leg.text), gen.num_tokens)

    def release(self, gen: Generation) -> None:
        self._scheduler.finish(gen.seq)
        self.slots.finish(gen.seq.seq_id)
        self._chains.pop(gen.seq.seq_id, None)
        leg = self._legs.pop(gen.seq.seq_id, None)
        if leg is not None and leg.paused is not None:  # gone while paused: drop its saved state
            self.backend.forget(gen.request)
        self._kick()

    # ------------------------------------------------------------- scheduling
    def _kick(self) -> None:
        """Run one scheduling pass; start whom it admitted, resume whom it brought back.
        Nothing is admitted while the runtime says it queues requests itself (and one of
        ours runs there, so an exit will kick again): they wait here, in order."""
        if self.backend.saturated() and self._scheduler.running:
            return
        out = self._scheduler.schedule()
        self._pause(out.preempted)
        for seq in out.admitted + out.resumed:
            leg = self._legs.get(seq.seq_id)
            if leg is None:
                continue
            chain = self._chain(seq)
            self.slots.start(seq.seq_id, chain)
            leg.gen.request.control.prefix_chain = chain
            if not leg.gen.ticket.done():
                leg.gen.admit()
            elif leg.paused is not None and not leg.paused.done():
                leg.gen.request.control.preempted = False
                leg.paused.set_result(None)  # swapped in, or re-admitted to recompute

    def _pause(self, preempted: list[Sequence]) -> None:
        """Stop the streams of preempted sequences (the backend saves their state) until
        the scheduler resumes them; a request not yet streaming just waits."""
        for seq in preempted:
            leg = self._legs.get(seq.seq_id)
            if leg is None or (leg.paused is not None and not leg.paused.done()):
                continue
            self.slots.finish(seq.seq_id)
            leg.paused = asyncio.get_running_loop().create_future()
            control = leg.gen.request.control
            control.preempted = True
            # Swapped: the backend saves the runtime's state; requeued (recompute): no need.
            control.save_state = seq.status is SeqStatus.SWAPPED
            control.interrupt()


class LocalRunner(Runner):
    """The in-process engine: its scheduler admits on the model runner's thread."""

    kv_estimated = False

    def __init__(self, backend: InProcessBackend, settings: Settings) -> None:
        self.backend = backend
        # Reported until the model is loaded and the real pool exists.
        self._placeholder = build_scheduler(settings, RuntimeLimits(), backend)
        self._streams: dict[str, LocalStream] = {}

    @property
    def scheduler(self) -> Scheduler:
        return self.backend.scheduler or self._placeholder

    def enqueue(self, gen: Generation) -> None:
        stream = self.backend.submit(gen.request, gen.seq)
        self._streams[gen.seq.seq_id] = stream
        stream.admitted.add_done_callback(lambda _: gen.admit())

    async def stream(self, gen: Generation) -> AsyncIterator[Token]:
        async for token in self._streams[gen.seq.seq_id]:
            yield token

    def release(self, gen: Generation) -> None:
        stream = self._streams.pop(gen.seq.seq_id, None)
        if stream is not None:
            stream.close()


def runner_for(backend: BaseBackend, settings: Settings) -> Runner:
    """The runner that fits ``backend``: local for one that runs the model in-process."""
    if isinstance(backend, InProcessBackend):
        return LocalRunner(backend, settings)
    return RemoteRunner(backend, settings)
