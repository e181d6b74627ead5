"""Every Prometheus series KVStream exports, in one place.

Names follow Prometheus conventions (``kvstream_`` prefix, base units, ``_total`` on
counters, ratios in 0..1) and map onto vLLM's concepts so dashboards translate. Histograms
are observed on the request path; gauges and counters that the engine already keeps are
read at scrape time by a collector, so they cost nothing per token.

For remote runtimes the KV series describe KVStream's *estimate* of the runtime's memory;
``kvstream_kv_estimated`` is 1 then.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.utils import floatToGoString
from prometheus_client.registry import Collector

from kvstream import __version__, metrics_llamacpp
from kvstream.backends import federation

if TYPE_CHECKING:
    from kvstream.engine import Generation, KVStreamEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets (seconds) spanning a fast cache hit to a long CPU prefill.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5)
_OVERHEAD = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)


class LocalHistogram:
    """A Prometheus histogram kept in plain lists.

    Observed only from the event loop, so it needs none of prometheus_client's per-call lock;
    an observation is one bisect and two additions (the proxy observes every token gap).
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # first bound >= value: "le"
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, math.inf], self.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        return HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)


class LocalCounter:
    """A labelled Prometheus counter in a dict, for the event loop (see LocalHistogram)."""

    def __init__(self, name: str, documentation: str, labels: list[str]) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, *label_values: str) -> None:
        self.values[label_values] = self.values.get(label_values, 0) + 1

    def value(self, *label_values: str) -> float:
        return self.values.get(label_values, 0)

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        for label_values, value in sorted(self.values.items()):
            family.add_metric(list(label_values), value)
        return family


class Metrics:
    """The registry of one KVStream process (tests build one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.http_requests = LocalCounter("kvstream_requests", "Generation requests answered, by route and HTTP status.", ["route", "code"])
        self.queue_time = LocalHistogram("kvstream_queue_time_seconds", "Time a request waited for a batch slot and KV blocks.", _LATENCY)
        self.ttft = LocalHistogram("kvstream_time_to_first_token_seconds", "From arrival at KVStream to the first token.", _LATENCY)
        self.tpot = LocalHistogram(
            "kvstream_time_per_output_token_seconds", "Mean time per output token after the first, per request.", _TOKEN
        )
        self.itl = LocalHistogram("kvstream_inter_token_latency_seconds", "Time between consecutive tokens of a stream.", _TOKEN)
        self.e2e = LocalHistogram("kvstream_e2e_request_latency_seconds", "From arrival to the last token.", _LATENCY)
        self.overhead = LocalHistogram(
            "kvstream_proxy_overhead_seconds",
            "KVStream's own time before the runtime is called (validation, tokenizing, scheduling), queue wait excluded.",
            _OVERHEAD,
        )
        self.backend_errors = LocalCounter("kvstream_backend_errors", "Runtime failures, by kind.", ["kind"])
        self.local = [self.http_requests, self.queue_time, self.ttft, self.tpot, self.itl, self.e2e, self.overhead, self.backend_errors]
        self._engine: KVStreamEngine | None = None
        self.registry.register(_LocalCollector(self.local))
        # (prompt tokens, prompt seconds, generation steps, generation seconds) at the previous
        # scrape: llama-server's throughput gauges are since then.
        self._llamacpp_previous = (0, 0.0, 0, 0.0)

    def bind(self, engine: KVStreamEngine) -> None:
        """Export the engine's gauges and counters (read at scrape time)."""
        self._engine = engine
        self.registry.register(_EngineCollector(self))

    # ---------------------------------------------------------- observations
    def observe_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_finished(self, gen: Generation) -> None:
        now = time.monotonic()
        if gen.admitted_at is not None:
            self.queue_time.observe(gen.queue_ms / 1000)  # stamped by the in-process engine for hf
        if gen.first_token_at is not None:
            self.ttft.observe(gen.first_token_at - gen.submitted_at)
            if gen.num_tokens > 1:
                self.tpot.observe((now - gen.first_token_at) / (gen.num_tokens - 1))
        self.e2e.observe(now - gen.submitted_at)

    def render(self) -> bytes:
        """KVStream's own families, then, for the in-process engine, llama-server's
        ``llamacpp:`` series (metrics_llamacpp.py)."""
        own = generate_latest(self.registry)
        figures = self._llamacpp_figures()
        return own if figures is None else own + metrics_llamacpp.render(figures).encode()

    def _llamacpp_figures(self) -> metrics_llamacpp.LlamaCppFigures | None:
        engine = self._engine
        passes = engine.backend.forward_passes() if engine is not None else None
        if engine is None or passes is None:
            return None
        stats, scheduler = engine.stats, engine.scheduler
        steps, held = passes
        # The in-process engine reports every request's cached tokens.
        computed = stats.runtime_reported_prompt_tokens - stats.runtime_cached_tokens
        now = (computed, stats.prompt_seconds, stats.generation_steps, stats.generation_seconds)
        tokens, seconds, decoded, decoding = (a - b for a, b in zip(now, self._llamacpp_previous, strict=True))
        self._llamacpp_previous = now
        return metrics_llamacpp.LlamaCppFigures(
            prompt_tokens=computed,
            cached_prompt_tokens=stats.runtime_cached_tokens,
            prompt_seconds=stats.prompt_seconds,
            generated_tokens=stats.generation_tokens,
            generation_seconds=stats.generation_seconds,
            prompt_rate=tokens / seconds if seconds > 0 else 0.0,
            generation_rate=decoded / decoding if decoding > 0 else 0.0,
            forward_passes=steps,
            requests_per_pass=held / steps if steps else 0.0,
            longest_sequence=stats.longest_sequence,
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
        )

    async def render_with_runtime(self) -> tuple[bytes, dict[str, str]]:
        """KVStream's families followed by the runtime's own, read now (federation.py), and
        the headers of the runtime's answer that come along: one runtime's (llama-server's
        Process-Start-Time-Unix), none for several, which cannot all be one answer's."""
        own = self.render()
        scrapes = await self._engine.backend.runtime_metrics() if self._engine is not None else []
        if not scrapes:
            return own, {}
        carried = scrapes[0].headers if len(scrapes) == 1 else {}
        return federation.merge(own.decode(), scrapes).encode(), carried


class _LocalCollector(Collector):
    def __init__(self, series: list[LocalHistogram | LocalCounter]) -> None:
        self.series = series

    def collect(self) -> Iterator:
        for series in self.series:
            yield series.family()


class _EngineCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator:
        engine = self.metrics._engine
        if engine is None:
            return
        sched, bm, stats = engine.scheduler, engine.scheduler.bm, engine.stats
        pool = bm.pool
        yield InfoMetricFamily("kvstream_build", "KVStream version and backend.", value={"version": __version__, "backend": engine.backend.name})
        yield GaugeMetricFamily("kvstream_backend_up", "1 when the runtime answered its last health probe.", value=1.0 if engine.ready else 0.0)
        yield GaugeMetricFamily("kvstream_requests_running", "Requests admitted and in flight to the runtime.", value=len(sched.running))
        yield GaugeMetricFamily("kvstream_requests_waiting", "Requests queued for admission.", value=len(sched.waiting))
        yield GaugeMetricFamily("kvstream_requests_swapped", "Preempted requests whose KV is in the host pool.", value=len(sched.swapped))
        yield GaugeMetricFamily("kvstream_max_batch_size", "Most requests in flight to the runtime at once.", value=sched.config.max_batch_size)
        yield GaugeMetricFamily("kvstream_kv_estimated", "1 when the KV series estimate a remote runtime's memory, 0 when KVStream owns the KV.", value=1.0 if engine.runner.kv_estimated else 0.0)
        yield GaugeMetricFamily("kvstream_kv_block_size_tokens", "Tokens per KV block.", value=bm.block_size)
        blocks = GaugeMetricFamily("kvstream_kv_blocks", "KV blocks by tier and state.", labels=["tier", "state"])
        blocks.add_metric(["gpu", "used"], pool.num_used)
        blocks.add_metric(["gpu", "free"], pool.num_free)
        blocks.add_metric(["gpu", "cached"], pool.num_cached)
        blocks.add_metric(["gpu", "retained"], pool.num_retained)
        blocks.add_metric(["cpu", "used"], bm.num_cpu_blocks - bm.num_free_cpu_blocks)
        blocks.add_metric(["cpu", "free"], bm.num_free_cpu_blocks)
        yield blocks
        yield GaugeMetricFamily("kvstream_kv_usage_ratio", "Fraction of device KV blocks held by live requests (0..1).", value=pool.usage())
        outcomes = CounterMetricFamily("kvstream_request_outcomes", "Requests that ended, by outcome.", labels=["outcome"])
        outcomes.add_metric(["finished"], stats.requests_finished)
        outcomes.add_metric(["failed"], stats.requests_failed)
        outcomes.add_metric(["refused"], stats.requests_refused)
        outcomes.add_metric(["cancelled"], stats.requests_cancelled)
        yield outcomes
        rejected = CounterMetricFamily("kvstream_admission_rejections", "Requests refused by admission, by reason.", labels=["reason"])
        for reason in ("queue_full", "queue_timeout", "context_length_exceeded"):
            rejected.add_metric([reason], stats.rejected.get(reason, 0))
        yield rejected
        yield CounterMetricFamily("kvstream_prompt_tokens", "Prompt tokens of finished requests (the runtime's count).", value=stats.prompt_tokens)
        yield CounterMetricFamily("kvstream_generation_tokens", "Generated tokens of finished requests.", value=stats.generation_tokens)
        yield CounterMetricFamily("kvstream_prefix_cache_query_tokens", "Prompt tokens looked up in KVStream's prefix index (an inference for remote runtimes; see kvstream_kv_estimated).", value=stats.prefix_query_tokens)
        yield CounterMetricFamily("kvstream_prefix_cache_hit_tokens", "Prompt tokens KVStream's prefix index found (an inference for remote runtimes; the verified figure is kvstream_runtime_cached_tokens_total).", value=stats.prefix_hit_tokens)
        counted = CounterMetricFamily("kvstream_prompts_counted", "Prompts KVStream sized, by how: exact (the model's own tokenizer) or estimated.", labels=["how"])
        counted.add_metric(["exact"], stats.prompts_exact)
        counted.add_metric(["estimated"], stats.prompts_estimated)
        yield counted
        yield CounterMetricFamily("kvstream_prompts_past_context", "Prompts counted exactly past the runtime's context and forwarded for it to judge (Ollama truncates them, llama-server refuses them).", value=stats.prompts_past_context)
        yield CounterMetricFamily("kvstream_runtime_reloads", "Times the runtime lost its prompt caches (model reload, restart), as KVStream learnt of it.", value=stats.runtime_reloads)
        yield CounterMetricFamily("kvstream_rewarmed_prefixes", "Hot prefixes re-prefilled after a runtime reload.", value=stats.rewarmed_prefixes)
        yield CounterMetricFamily("kvstream_runtime_cached_tokens", "Prompt tokens the runtime reported reusing from its cache (usage cached_tokens, llama.cpp timings.cache_n).", value=stats.runtime_cached_tokens)
        yield CounterMetricFamily("kvstream_runtime_reported_prompt_tokens", "Prompt tokens of the requests whose runtime reported cached tokens (the denominator of the verified hit ratio).", value=stats.runtime_reported_prompt_tokens)
        yield CounterMetricFamily("kvstream_prefix_cache_query_blocks", "KV blocks looked up in the prefix cache.", value=pool.stats.cache_queries)
        yield CounterMetricFamily("kvstream_prefix_cache_hit_blocks", "KV blocks found in the prefix cache.", value=pool.stats.cache_hits)
        yield CounterMetricFamily("kvstream_kv_evictions", "Cached blocks reclaimed for new requests (LRU).", value=pool.stats.evictions)
        yield CounterMetricFamily("kvstream_preemptions", "Running requests preempted for memory.", value=sched.stats.preemptions)
        swapped = CounterMetricFamily("kvstream_swapped_blocks", "KV blocks moved between device and host pools.", labels=["direction"])
        swapped.add_metric(["out"], sched.stats.swapped_out_blocks)
        swapped.add_metric(["in"], sched.stats.swapped_in_blocks)
        yield swapped
        yield from engine.backend.metric_families()
