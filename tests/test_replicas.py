"""Several replicas behind one KVStream (issue 17): routing policies, the per-replica view,
failover before the first byte and never after, and two KVStream instances that agree."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvstream.backends import OpenAICompatibleBackend
from kvstream.backends.replicas import ReplicaSet
from tests.conftest import free_port
from tests.doubles import Script


def chat(system: str, user: str = "q") -> dict:
    return {"model": "test-model", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


TENANTS = [f"You are the assistant of tenant {t}. " * 12 for t in "ABCD"]


async def post(http: aiohttp.ClientSession, proxy, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with http.post(proxy.v1 + "/chat/completions", json=body, headers=headers or {}) as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


async def two_replicas(start_upstream, scripts=(None, None)):
    urls = []
    recorders = []
    for script in scripts:
        url, recorder = await start_upstream(script or Script())
        urls.append(url)
        recorders.append(recorder)
    return urls, recorders


async def test_cache_aware_sends_a_prefix_back_where_it_was_computed(start_upstream, start_proxy, http):
    urls, recorders = await two_replicas(start_upstream)
    # Four slots each: whichever way the four prefixes hash, every one keeps a slot.
    proxy = await start_proxy(ReplicaSet([OpenAICompatibleBackend(u, parallel=4) for u in urls]))
    first = {}
    for round_ in range(3):
        for system in TENANTS:
            status, headers = await post(http, proxy, chat(system, f"q{round_}"))
            assert status == 200
            assert headers["X-KVStream-Route"] == ("miss" if round_ == 0 else "hit")
            first.setdefault(system, headers["X-KVStream-Backend"])
            assert headers["X-KVStream-Backend"] == first[system]  # always the same replica
    assert set(first.values()) == set(urls)  # four prefixes spread over both (by hash)
    assert sum(len(r.bodies) for r in recorders) == 12


async def test_round_robin_alternates_and_least_loaded_fills_the_idle_replica(start_upstream, start_proxy, http):
    urls, _ = await two_replicas(start_upstream, (Script(first_delay_s=0.3), Script(first_delay_s=0.3)))
    proxy = await start_proxy(ReplicaSet([OpenAICompatibleBackend(u) for u in urls]), routing={"policy": "round_robin"})
    seen = [(await post(http, proxy, chat(TENANTS[0])))[1] for _ in range(4)]
    assert [h["X-KVStream-Backend"] for h in seen].count(urls[0]) == 2
    assert {h["X-KVStream-Route"] for h in seen} == {"round_robin"}
    proxy = await start_proxy(ReplicaSet([OpenAICompatibleBackend(u) for u in urls]), routing={"policy": "least_loaded"})
    # Two at once, same prefix: the second goes to the replica that has nothing in flight.
    results = await asyncio.gather(*(post(http, proxy, chat(TENANTS[0], f"q{i}")) for i in range(2)))
    assert {h["X-KVStream-Backend"] for _, h in results} == set(urls)
    assert {h["X-KVStream-Route"] for _, h in results} == {"least_loaded"}


async def test_a_loaded_replica_is_balanced_away_from(start_upstream, start_proxy, http):
    """cache_aware sends the prefix to its replica until that one has balance_threshold
    more requests in flight than the other; then to the least loaded."""
    urls, _ = await two_replicas(start_upstream, (Script(first_delay_s=0.5), Script(first_delay_s=0.5)))
    proxy = await start_proxy(
        ReplicaSet([OpenAICompatibleBackend(u, parallel=4) for u in urls]), routing={"balance_threshold": 1}
    )
    results = await asyncio.gather(*(post(http, proxy, chat(TENANTS[0], f"q{i}")) for i in range(6)))
    routes = [h["X-KVStream-Route"] for _, h in results]
    backends = {h["X-KVStream-Backend"] for _, h in results}
    assert "balance" in routes and backends == set(urls)


async def test_a_dead_replica_is_ejected_and_no_request_fails(start_upstream, start_proxy, http):
    url, _ = await start_upstream()
    dead = f"http://127.0.0.1:{free_port()}"
    replicas = ReplicaSet([OpenAICompatibleBackend(dead), OpenAICompatibleBackend(url)])
    proxy = await start_proxy(replicas, routing={"eject_after": 2, "policy": "round_robin"})
    for i in range(6):
        status, headers = await post(http, proxy, chat(TENANTS[i % 4], f"q{i}"))
        assert status == 200 and headers["X-KVStream-Backend"] == url
    async with http.get(proxy.url + "/status") as resp:
        described = {r["url"]: r for r in (await resp.json())["backend"]["replicas"]}
    assert described[dead]["healthy"] is False and described[url]["healthy"] is True
    async with http.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    assert f'kvstream_replica_up{{backend="{dead}"}} 0.0' in text


async def test_a_stream_cut_after_its_first_token_ends_with_an_error_never_a_second_answer(start_upstream, start_proxy, http):
    urls, recorders = await two_replicas(start_upstream, (Script(die_after=2), Script(die_after=2)))
    proxy = await start_proxy(ReplicaSet([OpenAICompatibleBackend(u) for u in urls]))
    async with http.post(proxy.v1 + "/chat/completions", json=chat(TENANTS[0]) | {"stream": True}) as resp:
        text = await resp.text()
    assert '"error"' in text and "[DONE]" not in text
    assert sum(len(r.bodies) for r in recorders) == 1  # not retried elsewhere


async def test_a_session_header_pins_a_conversation(start_upstream, start_proxy, http):
    urls, _ = await two_replicas(start_upstream)
    proxy = await start_proxy(ReplicaSet([OpenAICompatibleBackend(u) for u in urls]))
    seen = set()
    for system in TENANTS:  # different prefixes, one session
        status, headers = await post(http, proxy, chat(system), {"X-KVStream-Session": "conversation-7"})
        seen.add(headers["X-KVStream-Backend"])
        assert headers["X-KVStream-Route"] == "session"
    assert len(seen) == 1


async def test_two_kvstreams_route_a_new_prefix_to_the_same_replica(start_upstream, start_proxy, http):
    urls, _ = await two_replicas(start_upstream)
    one = await start_proxy(ReplicaSet([OpenAICompatibleBackend(u) for u in urls]))
    other = await start_proxy(ReplicaSet([OpenAICompatibleBackend(u) for u in reversed(urls)]))
    for system in TENANTS:
        _, a = await post(http, one, chat(system))
        _, b = await post(http, other, chat(system))
        assert a["X-KVStream-Route"] == b["X-KVStream-Route"] == "miss"
        assert a["X-KVStream-Backend"] == b["X-KVStream-Backend"]


# ------------------------------------------------------------ real llama-servers
@pytest.fixture
def two_llama_servers():
    from tests.conftest import launch_llama_server, stop_process

    servers = [launch_llama_server(slots=2, ctx=4096, extra=["--cache-ram", "0"], slot_saving=False) for _ in range(2)]
    yield servers
    for server in servers:
        stop_process(server.process)


async def stream_chat(http: aiohttp.ClientSession, proxy, body: dict) -> tuple[int, str, dict]:
    async with http.post(proxy.v1 + "/chat/completions", json=body | {"stream": True, "max_tokens": 4, "temperature": 0}) as resp:
        return resp.status, await resp.text(), dict(resp.headers)


async def test_real_replicas_reuse_a_prefix_where_it_was_computed_and_survive_a_kill(two_llama_servers, start_proxy, http):
    """Two real llama-servers (per-slot caches only): a repeated prefix lands on the
    replica that computed it, which reports the reuse itself (cached tokens); one is then
    killed mid-run and traffic continues on the other with no failed request."""
    from kvstream.backends import LlamaCppBackend

    urls = [s.url for s in two_llama_servers]
    proxy = await start_proxy(ReplicaSet([LlamaCppBackend(u) for u in urls]), routing={"eject_after": 1})
    body = {"model": "m", "messages": [{"role": "system", "content": TENANTS[0]}, {"role": "user", "content": "hi"}]}
    async with http.post(proxy.v1 + "/chat/completions", json=body | {"max_tokens": 4}) as resp:
        first = resp.headers["X-KVStream-Backend"]
        assert resp.status == 200
    async with http.post(proxy.v1 + "/chat/completions", json=body | {"max_tokens": 4}) as resp:
        again = await resp.json()
        assert resp.headers["X-KVStream-Backend"] == first and resp.headers["X-KVStream-Route"] == "hit"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 100  # the replica reused it

    victim = next(s for s in two_llama_servers if s.url == first)
    victim.process.kill()
    victim.process.wait()
    outcomes = [await stream_chat(http, proxy, chat(TENANTS[i % 4], f"q{i}")) for i in range(6)]
    assert all(status == 200 and "[DONE]" in text for status, text, _ in outcomes)
    assert {headers["X-KVStream-Backend"] for _, _, headers in outcomes} == {u for u in urls if u != first}


async def test_repeating_backend_url_builds_a_replica_set(start_upstream):
    from kvstream.cli.serve import build_backend
    from kvstream.config import load_settings

    urls, _ = await two_replicas(start_upstream)
    loaded = load_settings({"backend": {"type": "openai", "base_url": urls[0], "replicas": urls}, "routing": {"policy": "round_robin"}}, environ={})
    backend = await build_backend(loaded.settings)
    assert isinstance(backend, ReplicaSet) and [r.url for r in backend.replicas] == urls
    assert backend.describe()["routing"] == "round_robin"
    env = load_settings(environ={"KVSTREAM_BACKEND__REPLICAS": ",".join(urls)})  # the environment's list form
    assert env.settings.backend.replicas == urls


async def test_with_every_replica_gone_the_answer_is_a_clear_503(start_proxy, http):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    proxy = await start_proxy(ReplicaSet([OpenAICompatibleBackend(u) for u in dead]))
    async with http.post(proxy.v1 + "/chat/completions", json=chat(TENANTS[0])) as resp:
        body = await resp.json()
    assert resp.status == 503 and "Retry-After" in resp.headers
    assert "replica" in body["error"]["message"] or "cannot connect" in body["error"]["message"]
