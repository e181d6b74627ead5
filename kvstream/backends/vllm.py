"""vLLM's OpenAI-compatible server (``vllm serve``), read through its Prometheus metrics.

Names are vLLM V1's (``vllm:kv_cache_usage_perc``, the ``prefix_cache_*`` counters), with
the V0 names they replaced (``gpu_cache_usage_perc``, ``gpu_prefix_cache_hit_rate``) as
fallbacks. The KV capacity comes from the ``vllm:cache_config_info`` info gauge's
``num_gpu_blocks`` and ``block_size`` labels; each data-parallel engine reports its own
series (an ``engine`` label), summed here.
"""

from __future__ import annotations

from kvstream.backends.metered import MeteredBackend
from kvstream.backends.prometheus import MetricNames

VLLM_METRICS = MetricNames(
    running=("vllm:num_requests_running",),
    waiting=("vllm:num_requests_waiting",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    hit_rate=("vllm:gpu_prefix_cache_hit_rate",),
    hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    capacity_info="vllm:cache_config_info",
)


class VLLMBackend(MeteredBackend):
    """``vllm serve`` (default port 8000)."""

    name = "vllm"
    default_url = "http://127.0.0.1:8000"
    metric_names = VLLM_METRICS
