"""OpenAI-compatible serving engines that report their own load (vLLM, SGLang).

Such an engine batches hundreds of requests over one paged KV pool, usually across several
GPUs: the serving itself is its job, and KVStream stays the front. What KVStream adds needs
to know how loaded the engine is, and the engine says so in its Prometheus ``/metrics``:
requests running and waiting, KV cache usage, prefix-cache hit rate, KV capacity. A
``MeteredBackend`` reads them every ``backend.metrics_interval_s`` and uses them to:

- admit: while the engine queues requests itself (``waiting > 0``: its batch or KV is
  full), new requests wait in KVStream's queue instead, where the scheduler orders them
  (lpm, priorities) and queue deadlines apply; each request that ends through KVStream
  counts as one the engine took off its queue, so the gate reopens without waiting for
  the next scrape;
- size: the engine's KV capacity (vLLM ``num_gpu_blocks`` x ``block_size``, SGLang
  ``max_total_num_tokens``) sizes KVStream's estimate of the pool;
- route: with several engines as replicas, load is the engine's own running + waiting
  count (other clients' requests included), and the cache model is one shared prefix
  cache per engine rather than per slot (``cache_model = "shared"``).

A scrape that fails or is not Prometheus text leaves the engine unmetered (never
saturated, load from KVStream's own count) until one succeeds; it is logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from kvstream.backends.openai_compat import OpenAICompatibleBackend
from kvstream.backends.prometheus import MetricNames, Reading, load_from, parse
from kvstream.types import BackendError, GenerateRequest, RuntimeLimits, Token, UpstreamLoad

logger = logging.getLogger(__name__)

# A report older than this many scrape intervals is not trusted (the engine stopped
# answering /metrics): routing and admission fall back to KVStream's own counts.
STALE_AFTER_INTERVALS = 3


class MeteredBackend(OpenAICompatibleBackend):
    """An OpenAI-compatible engine whose load KVStream reads from its ``/metrics``."""

    metric_names: MetricNames
    metrics_path = "/metrics"
    cache_model = "shared"
    may_keep_ollama_store = False  # vLLM, SGLang

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._report: UpstreamLoad | None = None
        self._reading: Reading | None = None
        self._poller: asyncio.Task[None] | None = None
        self.metrics_error: str | None = None

    @property
    def interval(self) -> float:
        return self.settings.backend.metrics_interval_s

    async def start(self) -> None:
        await super().start()
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await super().close()

    async def _poll_forever(self) -> None:
        while True:
            await self.scrape()
            await asyncio.sleep(self.interval)

    async def scrape(self) -> UpstreamLoad | None:
        """Read the engine's metrics now; the new report, or None when it could not be read."""
        try:
            text = await self.http.get_text(self.metrics_path, timeout=max(1.0, 2 * self.interval))
            reading = parse(text, self.metric_names)
        except (BackendError, ValueError) as exc:
            message = exc.message if isinstance(exc, BackendError) else f"not Prometheus text ({exc})"
            if message != self.metrics_error:
                logger.warning("%s at %s: cannot read %s: %s", self.name, self.base_url, self.metrics_path, message)
            self.metrics_error = message
            return None
        if self.metrics_error is not None:
            logger.info("%s at %s: %s readable again", self.name, self.base_url, self.metrics_path)
        self.metrics_error = None
        was_saturated = self.saturated()
        self._report = load_from(reading, self.metric_names, self._reading)
        self._reading = reading
        if was_saturated and not self.saturated() and self.on_capacity is not None:
            self.on_capacity()
        return self._report

    def load_report(self) -> UpstreamLoad | None:
        report = self._report
        if report is None or time.monotonic() - report.read_at > STALE_AFTER_INTERVALS * self.interval + 1.0:
            return None
        return report

    def saturated(self) -> bool:
        report = self.load_report()
        return report is not None and report.waiting > 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Token]:  # type: ignore[override]
        try:
            async for token in super().generate(request):
                yield token
        finally:
            # One request left the engine: it takes one from its own queue into that room.
            if self._report is not None and self._report.waiting > 0:
                self._report = replace(self._report, waiting=self._report.waiting - 1)

    async def limits(self) -> RuntimeLimits:
        """What the OpenAI base reports, with the engine's KV capacity (one scrape first)."""
        limits = await super().limits()
        report = self.load_report() or await self.scrape()
        if report is not None and report.kv_capacity_tokens:
            limits.n_ctx_total = report.kv_capacity_tokens
        return limits

    def describe(self) -> dict[str, Any]:
        report = self.load_report()
        engine: dict[str, Any] = {"metrics": "unreadable: " + self.metrics_error if self.metrics_error else "ok" if report else "not read yet"}
        if report is not None:
            engine |= {
                "running": report.running,
                "waiting": report.waiting,
                "kv_usage": report.kv_usage,
                "prefix_hit_rate": report.prefix_hit_rate,
                "kv_capacity_tokens": report.kv_capacity_tokens,
            }
        return super().describe() | {"engine": engine}

    def metric_families(self) -> Iterator[Any]:
        report = self.load_report()
        if report is None:
            return
        families = {
            "running": ("kvstream_upstream_running", "Requests the engine reports running (every client's)."),
            "waiting": ("kvstream_upstream_waiting", "Requests the engine reports queued in its own scheduler."),
            "kv_usage": ("kvstream_upstream_kv_usage_ratio", "The engine's KV cache usage, 0..1."),
            "prefix_hit_rate": ("kvstream_upstream_prefix_cache_hit_ratio", "The engine's prefix cache hit rate over the last scrape interval, 0..1."),
        }
        for field, (name, doc) in families.items():
            value = getattr(report, field)
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=["backend"])
                family.add_metric([self.base_url], float(value))
                yield family
