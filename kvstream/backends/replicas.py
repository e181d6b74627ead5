"""Several runtimes behind one KVStream: replicas of one type (``backend.replicas``,
``--backend-url`` repeated) or a mixed fleet (``backends:``, each entry with its own type,
model, capacity and weight).

``ReplicaSet`` is a backend made of backends: the engine, its scheduler and the routes see
one runtime with the replicas' slots summed; each request is sent to one replica that
serves its model (the ones that list it), chosen by ``routing.policy``:

- ``cache_aware`` (default): the replica that holds the longest part of the prompt, by a
  model of its cache built from what KVStream sent it: per slot for llama-server, Ollama
  and LM Studio (``SlotModel``; a busy slot counts, since the request can wait there for
  it rather than evict another prefix elsewhere), one shared prefix cache for vLLM and
  SGLang (``SharedCacheModel``). Next best, a replica that can restore the prefix from a
  saved llama.cpp slot file (route ``restore``: a partial hit, read rather than computed).
  Either is overruled when that replica has ``routing.balance_threshold`` more requests
  than the least loaded one. A prompt nobody holds goes to the replica its first block's
  hash picks among those with a free slot (weighted rendezvous hashing over the replica
  URLs), so KVStream instances in front of the same replicas agree without sharing state
  while the replicas have room. SGLang's router ``cache_aware``
  policy is the model: it keeps an approximate radix tree per worker of every request it
  routed and balances when workers' loads differ by more than an absolute and a relative
  threshold. Here slot-cached runtimes are modelled per slot (what each slot last held,
  which is what they keep); the balance rule is the absolute one; and a miss is routed by
  hash, not to the least loaded worker (several KVStreams agree, and a prefix's second
  request finds the first's cache).
- ``least_loaded``: lowest load, in requests per slot per unit of weight.
- ``round_robin``: smooth weighted round robin among replicas with room.

Load is KVStream's own count of requests in flight on a replica, or, for an engine that
reports its own (vLLM, SGLang: ``backends.metered``), its running + waiting count, which
includes other clients' requests. An ``X-KVStream-Session`` header pins a conversation to
the replica its id hashes to.

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
import math
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstream.backends.affinity import SharedCacheModel, SlotModel
from kvstream.backends.base import BaseBackend
from kvstream.backends.federation import RuntimeScrape
from kvstream.backends.http import UpstreamSession
from kvstream.config import RoutingSettings, Settings
from kvstream.kv.hashing import BlockHash, block_hashes, model_key, tenant_root
from kvstream.types import BackendError, BackendUnavailable, GenerateRequest, ModelInfo, RuntimeLimits, Token

logger = logging.getLogger(__name__)

class Replica:
    """One runtime of the set, with what KVStream knows of it: its capacity, what its cache
    holds (a model of its slots, or of its one shared prefix cache), its load (what is in
    flight through KVStream, or the engine's own report), the models it lists, its health."""

    def __init__(self, backend: BaseBackend, block_size: int, weight: float = 1.0) -> None:
        self.backend = backend
        self.url = backend.base_url
        self.weight = weight
        self.block_size = block_size
        self.capacity = 1  # requests it runs at once; sized when the runtime reports
        self.cache: SlotModel | SharedCacheModel = self._cache_for(1, None)
        self.in_flight = 0
        self.requests = 0
        self.failures = 0  # connection failures in a row
        self.ejected_until = 0.0
        self.model_ids: set[str] | None = None  # what it lists, once known
        self.credit = 0.0  # smooth weighted round robin

    def _cache_for(self, slots: int, kv_tokens: int | None) -> SlotModel | SharedCacheModel:
        identity = f"{self.backend.name}:{self.backend.model}"
        if self.backend.cache_model == "shared":
            return SharedCacheModel(slots, self.block_size, identity, max(1, (kv_tokens or 65536 * self.block_size) // self.block_size))
        return SlotModel(slots, self.block_size, identity)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.ejected_until

    def pressure(self) -> int:
        """Requests on it: KVStream's own in flight, or, when the runtime reports its load,
        its running + waiting count (other clients' requests included)."""
        report = self.backend.load_report()
        return self.in_flight if report is None else max(self.in_flight, report.running + report.waiting)

    @property
    def has_room(self) -> bool:
        return self.pressure() < self.capacity and not self.backend.saturated()

    def load(self) -> float:
        """Pressure per slot, per unit of weight: what least_loaded and balance compare."""
        return self.pressure() / self.capacity / self.weight

    def resize(self, limits: RuntimeLimits, default_slots: int) -> None:
        """Size it from the runtime's report (only while nothing runs there: the cache model
        starts empty)."""
        slots = limits.parallel or default_slots
        if slots != self.capacity and not self.in_flight:
            self.capacity = slots
            self.cache = self._cache_for(slots, limits.n_ctx_total)


def rendezvous(key: bytes, replicas: list[Replica]) -> Replica:
    """The replica ``key`` hashes to, highest random weight (weighted: a replica of weight
    2 wins twice as many keys): the same answer in every process for the same URLs and
    weights, and only the keys of a replica added or removed move."""

    def score(replica: Replica) -> float:
        digest = hashlib.blake2b(key + replica.url.encode(), digest_size=8).digest()
        uniform = (int.from_bytes(digest, "big") + 1) / (2**64 + 1)  # in (0, 1)
        return -replica.weight / math.log(uniform)

    return max(replicas, key=score)


class ReplicaSet(BaseBackend):
    """Backends, each request routed to one of them (see the module doc). They may be of
    different types (``backends:``), each serving its own models."""

    engine_probes_health = False  # each replica is probed by _check_health

    def __init__(self, replicas: list[BaseBackend], settings: Settings | None = None, weights: list[float] | None = None) -> None:
        if not replicas:
            raise ValueError("a replica set needs at least one replica")
        first = replicas[0]
        super().__init__(first.base_url, first.model, settings or first.settings)
        kinds = sorted({b.name for b in replicas})
        self.name = kinds[0] if len(kinds) == 1 else "mixed"
        self.kinds = kinds
        # A request is built for every replica the set may choose: the set forwards bodies
        # only if every replica speaks the client's protocol, and so on.
        self.forwards_body = all(b.forwards_body for b in replicas)
        self.serves_any_model_name = all(b.serves_any_model_name for b in replicas)
        self.serves_n = all(b.serves_n for b in replicas)
        self.serves_token_prompts = all(b.serves_token_prompts for b in replicas)
        self.serves_echo = all(b.serves_echo for b in replicas)
        self.may_keep_ollama_store = any(b.may_keep_ollama_store for b in replicas)
        weights = weights or [1.0] * len(replicas)
        self.replicas = [Replica(b, self.settings.memory.block_size, w) for b, w in zip(replicas, weights)]
        self._keys = itertools.count()  # one per routed attempt, for the cache models
        self._salt = model_key(f"{first.name}:{first.model}")
        self._checker: asyncio.Task[None] | None = None
        for replica in self.replicas:
            replica.backend.on_reload = self._forward_reload
            replica.backend.on_capacity = self._forward_capacity

    @property
    def routing(self) -> RoutingSettings:
        return self.settings.routing

    def _forward_reload(self, why: str, request: GenerateRequest | None) -> None:
        self.runtime_reloaded(why, request)

    def _forward_capacity(self) -> None:
        if self.on_capacity is not None:
            self.on_capacity()

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await asyncio.gather(*(r.backend.start() for r in self.replicas))
        await asyncio.gather(*(self._list_models(r) for r in self.replicas))
        self._checker = asyncio.get_running_loop().create_task(self._check_health())

    async def close(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checker
        await asyncio.gather(*(r.backend.close() for r in self.replicas), return_exceptions=True)

    async def _list_models(self, replica: Replica) -> list[ModelInfo]:
        """The replica's models, remembered for routing by model; [] if it cannot tell."""
        try:
            found = await replica.backend.models()
        except BackendError:
            return []
        replica.model_ids = {m.id for m in found}
        return found

    async def _check_health(self) -> None:
        while True:
            await asyncio.sleep(self.routing.health_interval_s)
            for replica in self.replicas:
                if not replica.healthy:
                    continue
                try:
                    ok = await replica.backend.health()
                    if ok and replica.model_ids is None:
                        await self._list_models(replica)
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

    @staticmethod
    def serving(model: str | None, replicas: list[Replica]) -> list[Replica]:
        """Those of ``replicas`` that serve ``model``: the ones that list it or whose list
        is not known yet (a replica down at start; the health check reads it once it is
        up); else those that serve any name; else all (a replica answers for the name)."""
        if model is None:
            return replicas
        listing = [r for r in replicas if r.model_ids is None or model in r.model_ids]
        return listing or [r for r in replicas if r.backend.serves_any_model_name] or replicas

    def _weighted_next(self, replicas: list[Replica]) -> Replica:
        """Smooth weighted round robin (nginx's): every replica gains its weight in credit,
        the richest is chosen and pays the total; weights 2:1 give A B A, A B A, ..."""
        for replica in replicas:
            replica.credit += replica.weight
        chosen = max(replicas, key=lambda r: r.credit)
        chosen.credit -= sum(r.weight for r in replicas)
        return chosen

    def choose(self, request: GenerateRequest, chain: list[BlockHash], exclude: set[str]) -> tuple[Replica | None, str]:
        """The replica for ``request`` and why; None when every replica is ejected or tried.
        Only a replica with room is chosen while one has some: sent to a full replica, a
        request waits inside it, and evicts what its slots hold when it runs."""
        live = self.serving(request.model, [r for r in self.replicas if r.healthy and r.url not in exclude])
        if not live:
            return None, "none"
        open_ = [r for r in live if r.has_room] or live
        least = min(open_, key=lambda r: (r.load(), r.pressure()))
        threshold = self.routing.balance_threshold
        if request.session:
            pinned = rendezvous(request.session.encode(), live)
            if pinned.has_room and pinned.pressure() - least.pressure() <= threshold:
                return pinned, "session"
            return least, "balance"
        policy = self.routing.policy
        if policy == "round_robin":
            return self._weighted_next(open_), "round_robin"
        if policy == "least_loaded" or not chain:
            return least, "least_loaded"
        # A prefix goes where a slot holds it even if that replica is full for now: it
        # waits there for the slot (the runtime gives a freed slot to the waiting request
        # that shares most with it) rather than evicting another prefix elsewhere; the
        # balance threshold bounds how far that goes. Next best: a replica that can
        # restore the prefix from a saved slot file (a partial hit: read, not computed).
        best = max(live, key=lambda r: (r.cache.held_blocks(chain, busy=True), -r.load()))
        if best.cache.held_blocks(chain, busy=True):
            route = "hit"
        elif restorers := [r for r in open_ if r.backend.restorable_tokens(request)]:
            best, route = min(restorers, key=lambda r: (r.load(), r.pressure())), "restore"
        else:
            # Among replicas with a free slot: every KVStream agrees while all have one; a
            # full replica would make the new prefix wait or evict one it holds.
            best, route = rendezvous(chain[0], open_), "miss"
        if best.pressure() - least.pressure() > threshold:
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
            replica.cache.start(key, chain)
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
                replica.cache.finish(key)

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy] or self.replicas

    async def tokenize(self, request: GenerateRequest) -> list[int] | None:
        """Exact ids from a replica that serves the request's model, when every such
        replica is of one type (one tokenizer and template); a mixed group estimates."""
        group = self.serving(request.model, self._live())
        if len({r.backend.name for r in group}) != 1:
            return None
        return await group[0].backend.tokenize(request)

    def held_blocks(self, chain: list[BlockHash]) -> int:
        """What lpm orders by, from the per-replica models routing uses (one pooled model
        of all the slots could say a prefix is held where routing knows it was evicted):
        the most any live replica with room holds of ``chain`` in an idle slot."""
        ready = [r for r in self.replicas if r.healthy and r.has_room]
        return max((r.cache.held_blocks(chain) for r in ready), default=0)

    def saturated(self) -> bool:
        """Every live replica says it queues requests itself."""
        live = [r for r in self.replicas if r.healthy]
        return bool(live) and all(r.backend.saturated() for r in live)

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
                found = await replica.backend.models()
            except BackendError as exc:
                errors.append(exc)
                continue
            replica.model_ids = {m.id for m in found}
            for info in found:
                seen.setdefault(info.id, info)
        if not seen and errors:
            raise errors[0]
        return list(seen.values())

    async def limits(self) -> RuntimeLimits:
        """The replicas' slots and memory summed; the shortest context of them."""
        found = await asyncio.gather(*(r.backend.limits() for r in self.replicas), return_exceptions=True)
        reports = [f for f in found if isinstance(f, RuntimeLimits)]
        for replica, report in zip(self.replicas, found):
            if isinstance(report, RuntimeLimits):
                replica.resize(report, self.settings.scheduler.remote_batch_size())
        if len(reports) < len(self.replicas):
            raise BackendError("not every replica reported its limits")
        contexts = [r.n_ctx_per_request for r in reports if r.n_ctx_per_request]
        totals = [r.n_ctx_total for r in reports]
        return RuntimeLimits(
            n_ctx_total=sum(totals) if all(totals) else None,  # type: ignore[arg-type]
            n_ctx_per_request=min(contexts) if contexts else None,
            parallel=sum(r.capacity for r in self.replicas),
        )

    def upstream(self) -> UpstreamSession | None:
        """Routes passed through unchanged (llama-server's /completion, /infill, /props...)
        go to the least loaded live replica: they carry no prefix KVStream tracks."""
        return min(self._live(), key=lambda r: (r.load(), r.pressure())).backend.upstream()

    def describe(self) -> dict[str, Any]:
        replicas = []
        for r in self.replicas:
            entry = {"url": r.url, "type": r.backend.name, "healthy": r.healthy, "in_flight": r.in_flight,
                     "slots": r.capacity, "weight": r.weight, "requests": r.requests, "failures": r.failures}
            if r.model_ids is not None and len(self.kinds) > 1:
                entry["models"] = sorted(r.model_ids)
            engine = r.backend.describe().get("engine")
            if engine is not None:  # what a vLLM / SGLang replica reports of its own load
                entry["engine"] = engine
            replicas.append(entry)
        return super().describe() | {"routing": self.routing.policy, "replicas": replicas}

    async def runtime_metrics(self) -> list[RuntimeScrape]:
        """Every replica's own metrics, read at once (federation.merge labels them apart)."""
        found = await asyncio.gather(*(r.backend.runtime_metrics() for r in self.replicas))
        return [scraped for each in found for scraped in each]

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
