"""Several runtimes of one type behind one KVStream (``backend.replicas``).

``ReplicaSet`` is a backend made of backends: the engine, its scheduler and the routes see
one runtime with the replicas' slots summed; each request is sent to one replica, chosen by
``routing.policy``:

- ``cache_aware`` (default): the replica whose slots hold the longest part of the prompt (a
  ``SlotModel`` per replica, from what KVStream sent it; a busy slot counts, since the
  request can wait there for it rather than evict another prefix elsewhere), unless it has
  ``routing.balance_threshold`` more requests in flight than the least loaded one. A prompt
  no slot holds goes to the replica its first block's hash picks (rendezvous hashing
  over the replica URLs), so KVStream instances in front of the same replicas agree
  without sharing state. SGLang's router ``cache_aware`` policy is the model: it keeps an
  approximate radix tree per worker of every request it routed (its workers keep large
  shared caches) and balances when workers' loads differ by more than an absolute and a
  relative threshold. Here the runtimes this is for (llama-server, Ollama, LM Studio) cache
  per slot, so the per-replica record is what each slot last held; the balance rule is the
  absolute one; and a miss is routed by hash, not to the least loaded worker.
- ``least_loaded``: fewest requests in flight per slot.
- ``round_robin`` (among replicas with a free slot, as least_loaded).

An ``X-KVStream-Session`` header pins a conversation to the replica its id hashes to.

Health: a replica that fails to connect ``routing.eject_after`` times in a row (requests or
the periodic probe) is ejected for ``routing.cooldown_s``, then probed again. A request is
retried on another replica only if nothing was sent to its client yet: a stream cut after
its first token ends with an error event, never with a second answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstream.backends.affinity import SlotModel
from kvstream.backends.base import BaseBackend
from kvstream.backends.http import UpstreamSession
from kvstream.config import RoutingSettings, Settings
from kvstream.kv.hashing import BlockHash, block_hashes, model_key, tenant_root
from kvstream.types import BackendError, BackendUnavailable, GenerateRequest, ModelInfo, RuntimeLimits, Token

logger = logging.getLogger(__name__)

class Replica:
    """One runtime of the set, with what KVStream knows of it: its slots (what each idle
    one holds: ``SlotModel``), what is in flight there, and its health."""

    def __init__(self, backend: BaseBackend, block_size: int) -> None:
        self.backend = backend
        self.url = backend.base_url
        self.block_size = block_size
        self.slots = SlotModel(1, block_size, backend.name)  # sized when the runtime reports
        self.in_flight = 0
        self.requests = 0
        self.failures = 0  # connection failures in a row
        self.ejected_until = 0.0

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.ejected_until

    @property
    def has_room(self) -> bool:
        return self.in_flight < self.slots.slots

    def load(self) -> float:
        return self.in_flight / self.slots.slots

    def resize(self, slots: int) -> None:
        """Model ``slots`` slots (only while nothing runs there: the model starts empty)."""
        if slots != self.slots.slots and not self.in_flight:
            self.slots = SlotModel(slots, self.block_size, self.backend.name)


def rendezvous(key: bytes, replicas: list[Replica]) -> Replica:
    """The replica ``key`` hashes to, highest random weight: the same answer in every
    process for the same URLs, and only 1/n of keys move when a replica is added."""
    return max(replicas, key=lambda r: hashlib.blake2b(key + r.url.encode(), digest_size=8).digest())


class ReplicaSet(BaseBackend):
    """Backends of one type, each request routed to one of them (see the module doc)."""

    def __init__(self, replicas: list[BaseBackend], settings: Settings | None = None) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        first = replicas[0]
        super().__init__(first.base_url, first.model, settings or first.settings)
        self.name = first.name
        self.forwards_body = first.forwards_body
        self.serves_any_model_name = first.serves_any_model_name
        self.serves_n = first.serves_n
        self.replicas = [Replica(b, self.settings.memory.block_size) for b in replicas]
        self._keys = itertools.count()  # one per routed attempt, for the slot models
        self._salt = model_key(f"{first.name}:{first.model}")
        self._next = 0  # round robin
        self._checker: asyncio.Task[None] | None = None
        for replica in self.replicas:
            replica.backend.on_reload = self._forward_reload

    @property
    def routing(self) -> RoutingSettings:
        return self.settings.routing

    def _forward_reload(self, why: str, request: GenerateRequest | None) -> None:
        self.runtime_reloaded(why, request)

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await asyncio.gather(*(r.backend.start() for r in self.replicas))
        self._checker = asyncio.get_running_loop().create_task(self._check_health())

    async def close(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
        await asyncio.gather(*(r.backend.close() for r in self.replicas), return_exceptions=True)

    async def _check_health(self) -> None:
        while True:
            await asyncio.sleep(self.routing.health_interval_s)
            for replica in self.replicas:
                if not replica.healthy:
                    continue
                try:
                    ok = await replica.backend.health()
                except Exception:  # a probe must never take the set down
                    ok = False
                self._record(replica, ok)
            for replica in self.replicas:  # cooled down: probe before traffic goes back
                if replica.ejected_until and replica.healthy:
                    self._record(replica, await replica.backend.health())

    def _record(self, replica: Replica, ok: bool) -> None:
        if ok:
            if replica.ejected_until:
                logger.info("replica %s is back", replica.url)
            replica.failures, replica.ejected_until = 0, 0.0
            return
        replica.failures += 1
        if replica.failures >= self.routing.eject_after and replica.healthy:
            replica.ejected_until = time.monotonic() + self.routing.cooldown_s
            logger.warning("replica %s ejected for %gs after %d failures", replica.url, self.routing.cooldown_s, replica.failures)

    # -------------------------------------------------------------- routing
    def chain(self, request: GenerateRequest) -> list[BlockHash]:
        """The prompt's chained block hashes: the runner's (computed once at admission, on
        exact or estimated ids), else from the exact ids when a caller has them."""
        if request.control.prefix_chain is not None:
            return request.control.prefix_chain
        ids = request.control.prompt_token_ids or []
        return block_hashes(ids, self.settings.memory.block_size, self._salt, tenant_root(request.cache_salt))

    def choose(self, request: GenerateRequest, chain: list[BlockHash], exclude: set[str]) -> tuple[Replica | None, str]:
        """The replica for ``request`` and why; None when every replica is ejected or tried.
        Only a replica with a free slot is chosen while one has one: sent to a full replica,
        a request would wait inside it, and evict what its slots hold when it runs."""
        live = [r for r in self.replicas if r.healthy and r.url not in exclude]
        if not live:
            return None, "none"
        open_ = [r for r in live if r.has_room] or live
        least = min(open_, key=lambda r: (r.load(), r.in_flight))
        policy = self.routing.policy
        if request.session:
            pinned = rendezvous(request.session.encode(), live)
            if pinned.has_room and pinned.in_flight - least.in_flight <= self.routing.balance_threshold:
                return pinned, "session"
            return least, "balance"
        if policy == "round_robin":
            self._next += 1
            return open_[self._next % len(open_)], "round_robin"
        if policy == "least_loaded" or not chain:
            return least, "least_loaded"
        # A prefix goes where a slot holds it even if that replica is full for now: it
        # waits there for the slot (the runtime gives a freed slot to the waiting request
        # that shares most with it) rather than evicting another prefix elsewhere; the
        # balance threshold bounds how far that goes.
        best = max(live, key=lambda r: (r.slots.held_blocks(chain, busy=True), -r.load()))
        if best.slots.held_blocks(chain, busy=True):
            route = "hit"
        else:
            best, route = rendezvous(chain[0], live), "miss"
        if best.in_flight - least.in_flight > self.routing.balance_threshold:
            return least, "balance"
        return best, route

    # ------------------------------------------------------------ requests
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Token]:
        chain = self.chain(request)
        tried: set[str] = set()
        while True:
            replica, route = self.choose(request, chain, tried)
            if replica is None:
                raise BackendUnavailable(f"no replica could take the request (tried {len(tried)} of {len(self.replicas)})")
            request.control.replica, request.control.route = replica.url, route
            key = str(next(self._keys))
            replica.in_flight += 1
            replica.requests += 1
            replica.slots.start(key, chain)
            started = False
            try:
                async with contextlib.aclosing(replica.backend.generate(request)) as tokens:
                    async for token in tokens:
                        started = True
                        if token.finish_reason is not None:
                            # Before the yield: the consumer closes this generator once it
                            # has the final token, so nothing after it would run.
                            self._record(replica, True)
                        yield token
                return
            except BackendUnavailable as exc:
                self._record(replica, False)
                if started:
                    raise
                logger.warning("replica %s failed before answering (%s); trying another", replica.url, exc.message)
                tried.add(replica.url)
            finally:
                replica.in_flight -= 1
                replica.slots.finish(key)

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy] or self.replicas

    async def tokenize(self, request: GenerateRequest) -> list[int] | None:
        return await self._live()[0].backend.tokenize(request)

    async def health(self) -> bool:
        results = await asyncio.gather(*(r.backend.health() for r in self.replicas), return_exceptions=True)
        for replica, ok in zip(self.replicas, results):
            self._record(replica, ok is True)
        return any(ok is True for ok in results)

    async def models(self) -> list[ModelInfo]:
        seen: dict[str, ModelInfo] = {}
        errors = []
        for replica in self._live():
            try:
                for info in await replica.backend.models():
                    seen.setdefault(info.id, info)
            except BackendError as exc:
                errors.append(exc)
        if not seen and errors:
            raise errors[0]
        return list(seen.values())

    async def limits(self) -> RuntimeLimits:
        """The replicas' slots and memory summed; the shortest context of them."""
        found = await asyncio.gather(*(r.backend.limits() for r in self.replicas), return_exceptions=True)
        reports = [f for f in found if isinstance(f, RuntimeLimits)]
        for replica, report in zip(self.replicas, found):
            if isinstance(report, RuntimeLimits) and report.parallel:
                replica.resize(report.parallel)
        if len(reports) < len(self.replicas):
            raise BackendError("not every replica reported its limits")
        contexts = [r.n_ctx_per_request for r in reports if r.n_ctx_per_request]
        totals = [r.n_ctx_total for r in reports]
        return RuntimeLimits(
            n_ctx_total=sum(totals) if all(totals) else None,  # type: ignore[arg-type]
            n_ctx_per_request=min(contexts) if contexts else None,
            parallel=sum(r.slots.slots for r in self.replicas),
        )

    def upstream(self) -> UpstreamSession | None:
        """Routes passed through unchanged go to the first live replica."""
        return self._live()[0].backend.upstream()

    def describe(self) -> dict[str, Any]:
        return super().describe() | {
            "routing": self.routing.policy,
            "replicas": [
                {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "slots": r.slots.slots,
                 "requests": r.requests, "failures": r.failures}
                for r in self.replicas
            ],
        }

    def metric_families(self) -> Iterator[Any]:
        up = GaugeMetricFamily("kvstream_replica_up", "1 while a replica takes traffic, 0 while ejected.", labels=["backend"])
        busy = GaugeMetricFamily("kvstream_replica_in_flight", "Requests in flight on each replica.", labels=["backend"])
        sent = CounterMetricFamily("kvstream_replica_requests", "Requests sent to each replica (retries included).", labels=["backend"])
        for replica in self.replicas:
            up.add_metric([replica.url], 1.0 if replica.healthy else 0.0)
            busy.add_metric([replica.url], replica.in_flight)
            sent.add_metric([replica.url], replica.requests)
        yield from (up, busy, sent)
        for replica in self.replicas:
            yield from replica.backend.metric_families()
