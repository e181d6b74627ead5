"""SGLang's OpenAI-compatible server (``python -m sglang.launch_server``), read through its
Prometheus metrics (served only with ``--enable-metrics``; without it KVStream routes and
admits on its own counts and says so in /status).

SGLang reports KV usage as ``sglang:token_usage`` (tokens in use over
``sglang:max_total_num_tokens``) and its prefix-cache hit rate as a gauge; each tensor- or
data-parallel rank may report its own series, summed here.
"""

from __future__ import annotations

from kvstream.backends.metered import MeteredBackend
from kvstream.backends.prometheus import MetricNames

SGLANG_METRICS = MetricNames(
    running=("sglang:num_running_reqs",),
    waiting=("sglang:num_queue_reqs",),
    kv_usage=("sglang:token_usage",),
    hit_rate=("sglang:cache_hit_rate",),
    capacity_tokens=("sglang:max_total_num_tokens",),
)


class SGLangBackend(MeteredBackend):
    """``sglang.launch_server`` (default port 30000)."""

    name = "sglang"
    default_url = "http://127.0.0.1:30000"
    metric_names = SGLANG_METRICS
