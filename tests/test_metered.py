"""vLLM and SGLang upstream (issue 17): their Prometheus metrics, read from doubles that serve
the engines' real scrape format, drive KVStream's admission and routing."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from kvstream.backends import get_backend_class
from kvstream.backends.prometheus import load_from, parse
from kvstream.backends.replicas import ReplicaSet
from kvstream.backends.sglang import SGLANG_METRICS, SGLangBackend
from kvstream.backends.vllm import VLLM_METRICS, VLLMBackend
from tests.doubles import METRICS, EngineLoad, Script, metered_upstream, set_sample

FAST = {"metrics_interval_s": 0.05}


def chat(system: str, user: str = "q") -> dict:
    return {"model": "test-model", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


PREFIXES = [f"You are the assistant of tenant {t}. " * 12 for t in "ABCDEFGH"]


async def start_engine(start_upstream, load: EngineLoad, script: Script | None = None):
    return await start_upstream(script or Script(), factory=metered_upstream, load=load)


async def settle(backend, scrapes: int = 2) -> None:
    """Wait (bounded) for the backend's poller to read the double a few more times."""
    for _ in range(200):
        await asyncio.sleep(0.02)
        doubles = backend.replicas if isinstance(backend, ReplicaSet) else [backend]
        if all(getattr(r, "backend", r).load_report() is not None for r in doubles):
            scrapes -= 1
            if scrapes <= 0:
                return
    raise AssertionError("the engine's metrics were never read")


# ------------------------------------------------------------------ reading the scrapes
def test_a_vllm_scrape_gives_its_load_capacity_and_interval_hit_rate():
    text = (METRICS / "vllm.prom").read_text()
    first = parse(text, VLLM_METRICS)
    load = load_from(first, VLLM_METRICS)
    assert (load.running, load.waiting, load.kv_usage) == (3, 0, 0.0412)
    assert load.kv_capacity_tokens == 27690 * 16  # num_gpu_blocks x block_size, from the info gauge
    assert load.prefix_hit_rate == pytest.approx(30720 / 48213)  # lifetime, on a first reading
    later = set_sample(set_sample(text, "vllm:prefix_cache_queries_total", 48213 + 1000), "vllm:prefix_cache_hits_total", 30720 + 900)
    assert load_from(parse(later, VLLM_METRICS), VLLM_METRICS, first).prefix_hit_rate == pytest.approx(0.9)  # this interval's


def test_data_parallel_engines_add_up_and_v0_names_are_understood():
    text = (METRICS / "vllm.prom").read_text()
    second = "\n".join(
        line.replace('engine="0"', 'engine="1"') for line in text.splitlines() if line.startswith("vllm:") and 'engine="0"' in line
    )
    doubled = text + second + "\n"
    load = load_from(parse(doubled, VLLM_METRICS), VLLM_METRICS)
    assert load.running == 6 and load.kv_capacity_tokens == 2 * 27690 * 16
    assert load.kv_usage == pytest.approx(0.0412)  # a ratio is averaged, not summed
    v0 = "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.5\n# TYPE vllm:gpu_prefix_cache_hit_rate gauge\nvllm:gpu_prefix_cache_hit_rate 0.25\n"
    old = load_from(parse(v0, VLLM_METRICS), VLLM_METRICS)
    assert (old.kv_usage, old.prefix_hit_rate, old.running) == (0.5, 0.25, 0)


def test_an_sglang_scrape_gives_its_load_and_capacity():
    load = load_from(parse((METRICS / "sglang.prom").read_text(), SGLANG_METRICS), SGLANG_METRICS)
    assert (load.running, load.waiting, load.kv_usage) == (2, 0, 0.28)
    assert load.kv_capacity_tokens == 442368
    assert load.prefix_hit_rate == pytest.approx(0.007507552643049313)


def test_the_presets_are_registered_backends():
    assert get_backend_class("vllm") is VLLMBackend and get_backend_class("sglang") is SGLangBackend
    assert VLLMBackend().base_url.endswith(":8000") and SGLangBackend().base_url.endswith(":30000")


# ------------------------------------------------------------------ one engine behind KVStream
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_the_engines_own_load_shows_in_status_and_metrics(engine, start_upstream, start_proxy, http):
    load = EngineLoad(engine=engine, others_running=5, kv_usage=0.4)
    url, _ = await start_engine(start_upstream, load)
    backend = get_backend_class(engine)(url, **FAST)
    proxy = await start_proxy(backend)
    async with http.post(proxy.v1 + "/chat/completions", json=chat(PREFIXES[0])) as resp:
        assert resp.status == 200
    await settle(backend)
    status = await (await http.get(proxy.url + "/status")).json()
    reported = status["backend"]["engine"]
    assert reported["metrics"] == "ok" and reported["running"] == 5 and reported["kv_usage"] == 0.4
    capacity = 27690 * 16 if engine == "vllm" else 442368
    assert reported["kv_capacity_tokens"] == capacity
    assert status["kv"]["blocks_total"] == capacity // 16  # KVStream's pool sized from the engine's
    text = await (await http.get(proxy.url + "/metrics")).text()
    assert f'kvstream_upstream_running{{backend="{url}"}} 5.0' in text
    assert f'kvstream_upstream_kv_usage_ratio{{backend="{url}"}} 0.4' in text


async def test_while_the_engine_queues_requests_new_ones_wait_in_kvstream(start_upstream, start_proxy, http):
    """vLLM reports requests waiting in its own queue (other clients filled it): KVStream
    holds its next request in its own queue, where it is ordered and visible, and sends it
    once the engine's queue drains."""
    load = EngineLoad(others_running=16, waiting=4)
    url, recorder = await start_engine(start_upstream, load, Script(first_delay_s=0.3))
    backend = VLLMBackend(url, **FAST)
    proxy = await start_proxy(backend)
    await settle(backend)
    first = asyncio.ensure_future(http.post(proxy.v1 + "/chat/completions", json=chat(PREFIXES[0])))
    for _ in range(100):  # the first goes: nothing of KVStream's runs there yet
        await asyncio.sleep(0.01)
        if recorder.in_flight:
            break
    second = asyncio.ensure_future(http.post(proxy.v1 + "/chat/completions", json=chat(PREFIXES[1])))
    await asyncio.sleep(0.15)
    status = await (await http.get(proxy.url + "/status")).json()
    assert status["queue"]["waiting"] == 1 and recorder.in_flight == 1  # held here, not sent
    load.waiting = 0  # the engine drained its queue
    responses = await asyncio.gather(first, second)
    assert [r.status for r in responses] == [200, 200]
    assert len(recorder.bodies) == 2


async def test_an_engine_exit_reopens_the_gate_before_the_next_scrape(start_upstream, start_proxy, http):
    """Each request that ends through KVStream is one the engine takes off its queue: the
    next waits for no scrape (here, scrapes stop: the gate would otherwise stay shut)."""
    load = EngineLoad(waiting=1)
    url, recorder = await start_engine(start_upstream, load, Script(first_delay_s=0.2))
    backend = VLLMBackend(url, metrics_interval_s=30.0)  # one scrape at start, none after
    proxy = await start_proxy(backend)
    responses = await asyncio.gather(*(http.post(proxy.v1 + "/chat/completions", json=chat(p)) for p in PREFIXES[:2]))
    assert [r.status for r in responses] == [200, 200] and recorder.max_in_flight == 1


async def test_unreadable_metrics_leave_the_engine_unmetered_and_say_so(start_upstream, start_proxy, http, caplog):
    load = EngineLoad(garbage=True)
    url, _ = await start_engine(start_upstream, load)
    backend = VLLMBackend(url, **FAST)
    with caplog.at_level(logging.WARNING, logger="kvstream.backends.metered"):
        proxy = await start_proxy(backend)
        async with http.post(proxy.v1 + "/chat/completions", json=chat(PREFIXES[0])) as resp:
            assert resp.status == 200
        while load.scrapes < 4:
            await asyncio.sleep(0.02)
    engine = (await (await http.get(proxy.url + "/status")).json())["backend"]["engine"]
    assert engine["metrics"].startswith("unreadable") and "running" not in engine
    assert len([r for r in caplog.records if "cannot read /metrics" in r.getMessage()]) == 1  # once, not per scrape
    load.garbage = False
    await settle(backend)
    engine = (await (await http.get(proxy.url + "/status")).json())["backend"]["engine"]
    assert engine["metrics"] == "ok"


# ------------------------------------------------------------------ a fleet of engines
async def two_engines(start_upstream, loads, script: Script | None = None):
    started = [await start_engine(start_upstream, load, script) for load in loads]
    return [u for u, _ in started], [r for _, r in started]


async def post(http: aiohttp.ClientSession, proxy, body: dict) -> dict:
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()
        return dict(resp.headers)


async def test_least_loaded_counts_the_engines_own_load(start_upstream, start_proxy, http):
    """One vLLM replica is busy with other clients' requests KVStream never sent: least
    loaded sees it in its metrics and sends everything to the other."""
    busy, idle = EngineLoad(others_running=40), EngineLoad()
    urls, _ = await two_engines(start_upstream, [busy, idle])
    backend = ReplicaSet([VLLMBackend(u, parallel=64, **FAST) for u in urls])
    proxy = await start_proxy(backend, routing={"policy": "least_loaded"})
    await settle(backend)
    seen = {(await post(http, proxy, chat(p)))["X-KVStream-Backend"] for p in PREFIXES[:4]}
    assert seen == {urls[1]}
    status = await (await http.get(proxy.url + "/status")).json()
    assert [r["engine"]["running"] for r in status["backend"]["replicas"]] == [40, 0]


async def test_a_shared_cache_engine_keeps_every_prefix_it_was_sent(start_upstream, start_proxy, http):
    """vLLM keeps one prefix cache over its pool, not one prompt per slot: eight prefixes
    over two one-slot replicas all come back to where they were computed (a per-slot model
    would have forgotten all but the last of each)."""
    urls, _ = await two_engines(start_upstream, [EngineLoad(), EngineLoad()])
    backend = ReplicaSet([VLLMBackend(u, parallel=1, **FAST) for u in urls])
    proxy = await start_proxy(backend)
    first = {p: (await post(http, proxy, chat(p, "q0")))["X-KVStream-Backend"] for p in PREFIXES}
    # Where each prefix goes is the rendezvous hash of the replicas' URLs, whose ports are
    # random: any split is fine (all eight on one replica is a 1-in-128 draw), as long as
    # some replica was sent more prefixes than its one slot, which eight over two always is.
    assert set(first.values()) <= set(urls)
    assert max(list(first.values()).count(u) for u in urls) > 1
    again = [await post(http, proxy, chat(p, "q1")) for p in PREFIXES]
    assert [h["X-KVStream-Route"] for h in again] == ["hit"] * len(PREFIXES)
    assert [h["X-KVStream-Backend"] for h in again] == [first[p] for p in PREFIXES]


async def test_a_hit_on_an_engine_with_a_long_queue_is_balanced_away(start_upstream, start_proxy, http):
    loads = [EngineLoad(), EngineLoad()]
    urls, _ = await two_engines(start_upstream, loads)
    backend = ReplicaSet([VLLMBackend(u, parallel=64, **FAST) for u in urls])
    proxy = await start_proxy(backend)
    home = (await post(http, proxy, chat(PREFIXES[0])))["X-KVStream-Backend"]
    loads[urls.index(home)].others_running = 30  # other clients pile onto it
    await settle(backend, 3)
    headers = await post(http, proxy, chat(PREFIXES[0], "again"))
    assert headers["X-KVStream-Route"] == "balance" and headers["X-KVStream-Backend"] != home
