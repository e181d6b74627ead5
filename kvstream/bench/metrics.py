"""Benchmark arithmetic, as vLLM's ``bench serve`` computes it (``calculate_metrics``):
TTFT, TPOT (excluding the first token), ITL and end-to-end latency with mean, median,
p90 and p99, throughput from wall-clock duration, tokens from the server's usage."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """What one request did. Times in seconds from its start."""

    success: bool
    status: int | None = None
    error: str = ""
    ttft: float | None = None
    latency: float = 0.0  # end to end
    itl: list[float] = field(default_factory=list)  # gaps between tokens after the first
    prompt_tokens: int = 0
    output_tokens: int = 0
    queue_ms: float | None = None  # X-KVStream-Queue-Ms
    prefix_hit_tokens: int | None = None  # X-KVStream-Prefix-Hit-Tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    turn: int = 0
    started: float = 0.0


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in 0..100."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _summary(name: str, values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(ms) if len(ms) > 1 else 0.0,
        f"p90_{name}_ms": percentile(ms, 90),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first: (E2EL - TTFT) / (n - 1)."""
    if result.ttft is None or result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def calculate(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """The summary, with vLLM's keys plus KVStream's (queue time, prefix hits, errors)."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    errors = Counter(str(r.status) if r.status else (r.error.split(":")[0] or "error") for r in results if not r.success)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": input_tokens / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration else 0.0,
    }
    out |= _summary("ttft", [r.ttft for r in ok if r.ttft is not None])
    out |= _summary("tpot", [t for r in ok if (t := tpot(r)) is not None])
    out |= _summary("itl", [gap for r in ok for gap in r.itl])
    out |= _summary("e2el", [r.latency for r in ok])
    queue = [r.queue_ms for r in ok if r.queue_ms is not None]
    hits = [r.prefix_hit_tokens for r in ok if r.prefix_hit_tokens is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    out["mean_queue_ms"] = statistics.fmean(queue) if queue else None
    out["p99_queue_ms"] = percentile(queue, 99) if queue else None
    out["prefix_hit_tokens"] = sum(hits) if hits else None
    out["prefix_hit_ratio"] = (sum(hits) / input_tokens) if hits and input_tokens else None
    out["cached_tokens"] = sum(cached) if cached else None
    out["errors"] = dict(errors)
    return out


def ttft_by_turn(results: list[RequestResult]) -> dict[int, float]:
    """Median TTFT (ms) per turn of a multi-turn replay."""
    turns: dict[int, list[float]] = {}
    for r in results:
        if r.success and r.ttft is not None:
            turns.setdefault(r.turn, []).append(r.ttft * 1000)
    return {t: statistics.median(v) for t, v in sorted(turns.items())}
