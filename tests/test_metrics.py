"""/metrics: every series moves as it should across real request cycles, names follow the
Prometheus conventions, and no label can take unbounded values."""

from __future__ import annotations

import re

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstream.backends import GenerateRequest, OpenAICompatibleBackend
from kvstream.scheduler import NeverFits
from tests.doubles import Script

pytestmark = pytest.mark.timeout(60)

LONG = "Tell me about the history of the printing press in Europe, in some detail please. " * 3


async def scrape(session: aiohttp.ClientSession, proxy) -> dict[tuple[str, tuple], float]:
    async with session.get(proxy.url + "/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
async def proxied(start_upstream, start_proxy):
    script = Script()
    url, recorder = await start_upstream(script)
    proxy = await start_proxy(OpenAICompatibleBackend(url), memory={"num_gpu_blocks": 64})
    return proxy, script


async def test_every_series_moves_across_a_request_cycle(proxied):
    proxy, script = proxied
    body = {"model": "test-model", "messages": [{"role": "user", "content": LONG}], "stream": True}
    async with aiohttp.ClientSession() as s:
        before = await scrape(s, proxy)
        for _ in range(2):  # the second request hits the first one's prompt blocks
            async with s.post(proxy.v1 + "/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        after = await scrape(s, proxy)

        def delta(name, **labels):
            return value(after, name, **labels) - value(before, name, **labels)

        assert delta("kvstream_requests_total", route="chat", code="200") == 2
        assert delta("kvstream_request_outcomes_total", outcome="finished") == 2
        for hist in ("queue_time", "time_to_first_token", "e2e_request_latency", "time_per_output_token", "proxy_overhead"):
            assert delta(f"kvstream_{hist}_seconds_count") == 2, hist
        assert delta("kvstream_inter_token_latency_seconds_count") == 2 * 3  # 4 tokens: 3 gaps
        assert delta("kvstream_prompt_tokens_total") == 2 * 7 and delta("kvstream_generation_tokens_total") == 2 * 4
        assert delta("kvstream_prefix_cache_query_tokens_total") > 0
        assert delta("kvstream_prefix_cache_hit_tokens_total") >= 48
        assert delta("kvstream_prefix_cache_hit_blocks_total") >= 3
        assert value(after, "kvstream_kv_blocks", tier="gpu", state="used") == 0  # all freed
        assert value(after, "kvstream_kv_blocks", tier="gpu", state="cached") >= 3  # and kept cached
        assert value(after, "kvstream_kv_estimated") == 1 and value(after, "kvstream_backend_up") == 1

        script.status = 500
        async with s.post(proxy.v1 + "/chat/completions", json=body) as resp:
            assert resp.status == 502
        script.status = 400  # the runtime's own refusal, passed on
        async with s.post(proxy.v1 + "/chat/completions", json=body) as resp:
            assert resp.status == 400
        # KVStream's own (an API that promises a 400 for a prompt past the context).
        past = GenerateRequest(model="test-model", messages=[{"role": "user", "content": "word " * 20_000}],
                               refuse_past_context=True)
        with pytest.raises(NeverFits):
            await proxy.engine.submit(past)
        last = await scrape(s, proxy)
    assert value(last, "kvstream_requests_total", route="chat", code="502") == 1
    assert value(last, "kvstream_backend_errors_total", kind="error") == 1
    # The runtime's 500 failed; its 400 refused the client's request (not counted a failure).
    assert value(last, "kvstream_request_outcomes_total", outcome="failed") == 1
    assert value(last, "kvstream_request_outcomes_total", outcome="refused") == 1
    assert value(last, "kvstream_admission_rejections_total", reason="context_length_exceeded") == 1
    assert value(last, "kvstream_requests_total", route="chat", code="400") == 1


async def test_names_follow_prometheus_conventions(proxied):
    proxy, _ = proxied
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.url + "/metrics") as resp:
            text = await resp.text()
    families = list(text_string_to_metric_families(text))
    ours = [f for f in families if f.name.startswith("kvstream_")]
    assert len(ours) >= 25
    for family in families:
        assert re.fullmatch(r"kvstream_[a-z0-9_]+", family.name), family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        if "ratio" in family.name:
            assert all(0 <= s.value <= 1 for s in family.samples)


async def test_labels_stay_bounded_whatever_clients_send(proxied):
    proxy, script = proxied
    async with aiohttp.ClientSession() as s:
        for i in range(5):
            await s.post(proxy.v1 + "/chat/completions", json={"model": f"model-{i}", "messages": [{"role": "user", "content": "x"}]})
            await s.post(proxy.v1 + "/chat/completions", data=f"garbage {i}")
        script.status, script.error_body = 400, {"error": {"code": f"weird-{i}", "message": "x"}}
        await s.post(proxy.v1 + "/chat/completions", json={"model": "test-model", "messages": [{"role": "user", "content": "x"}]})
        samples = await scrape(s, proxy)
    allowed = {
        "route": {"chat", "completions", "warm", "ollama_chat", "ollama_generate", "ollama_embed", "passthrough", "passthrough_generation"},
        "code": {str(c) for c in (200, 400, 401, 404, 408, 413, 415, 422, 429, 500, 502, 503, 504)},
        "how": {"exact", "estimated"},
        "kind": {"unavailable", "rejected", "timeout", "error"},
        "tier": {"gpu", "cpu"},
        "state": {"used", "free", "cached", "retained"},
        "outcome": {"finished", "failed", "refused", "cancelled"},
        "reason": {"queue_full", "queue_timeout", "context_length_exceeded"},
        "direction": {"in", "out"},
        "store": {"ram", "disk"},
        "le": None,
        "version": None,
        "backend": None,
    }
    for (name, labels), _ in samples.items():
        for key, val in labels:
            assert key in allowed, (name, key)
            if allowed[key] is not None:
                assert val in allowed[key], (name, key, val)
