"""Reading a serving engine's load from its Prometheus ``/metrics`` text (vLLM, SGLang).

Each engine names the same few facts differently, and renamed some between versions; a
``MetricNames`` lists, per fact, the sample names to try in order (the first present wins).
Series of one sample are summed across their labels (data-parallel engines and ranks each
report their own: requests add up), except ratios, which are averaged.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvstream.types import UpstreamLoad


@dataclass(frozen=True)
class MetricNames:
    """Which samples of an engine's /metrics carry each fact (alternatives in order)."""

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]  # a 0..1 gauge
    hit_rate: tuple[str, ...] = ()  # a 0..1 gauge
    hits: tuple[str, ...] = ()  # counters: hits over queries (tokens), when no gauge
    queries: tuple[str, ...] = ()
    capacity_tokens: tuple[str, ...] = ()  # a gauge of KV tokens
    capacity_info: str | None = None  # an info gauge with num_gpu_blocks and block_size labels


@dataclass
class Reading:
    """One scrape: every sample's values (label sets summed, counted for averaging) and
    the KV capacity from an info gauge's labels."""

    sums: dict[str, float]
    counts: dict[str, int]
    info_tokens: int | None

    def first(self, names: tuple[str, ...], average: bool = False) -> float | None:
        for name in names:
            if name in self.sums:
                return self.sums[name] / self.counts[name] if average else self.sums[name]
        return None


def parse(text: str, names: MetricNames) -> Reading:
    """The samples of ``text`` (Prometheus text exposition). Raises ValueError when it is
    not that format."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    info_tokens = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] += sample.value
            counts[sample.name] += 1
            if names.capacity_info is not None and sample.name == names.capacity_info:
                blocks, size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
                if blocks and size and blocks.isdigit() and size.isdigit():
                    info_tokens = (info_tokens or 0) + int(blocks) * int(size)
    return Reading(dict(sums), dict(counts), info_tokens)


def load_from(reading: Reading, names: MetricNames, previous: Reading | None = None) -> UpstreamLoad:
    """The engine's load from one reading; the prefix hit rate over the interval since
    ``previous`` when the engine reports hit and query counters, else its own gauge."""
    rate = reading.first(names.hit_rate, average=True)
    hits, queries = reading.first(names.hits), reading.first(names.queries)
    if rate is None and hits is not None and queries:
        rate = hits / queries  # lifetime, unless the interval says more
        if previous is not None:
            before_h, before_q = previous.first(names.hits), previous.first(names.queries)
            if before_h is not None and before_q is not None and queries > before_q:
                rate = (hits - before_h) / (queries - before_q)
    capacity = reading.first(names.capacity_tokens)
    usage = reading.first(names.kv_usage, average=True)
    return UpstreamLoad(
        running=int(reading.first(names.running) or 0),
        waiting=int(reading.first(names.waiting) or 0),
        kv_usage=None if usage is None else min(1.0, max(0.0, usage)),
        prefix_hit_rate=None if rate is None else min(1.0, max(0.0, rate)),
        kv_capacity_tokens=int(capacity) if capacity else reading.info_tokens,
        read_at=time.monotonic(),
    )
