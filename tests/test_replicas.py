"""Several replicas behind one KVStream (issue 17): routing policies, the per-replica view,
failover before the first byte and never after, and two KVStream instances that agree."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvstream.backends import OpenAICompatibleBackend
from kvstream.backends.replicas import ReplicaSet
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
    # (Where new prefixes go is the rendezvous hash: its spread is tested on 3000 keys below.)
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


async def test_a_dead_replica_is_ejected_and_no_request_fails(start_upstream, start_proxy, http, refused_port):
    url, _ = await start_upstream()
    dead = f"http://127.0.0.1:{refused_port()}"
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
    from tests.conftest import launch_llama_server

    servers = [launch_llama_server(slots=2, ctx=4096, extra=["--cache-ram", "0"], slot_saving=False) for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


async def stream_chat(http: aiohttp.ClientSession, proxy, body: dict) -> tuple[int, str, dict]:
    async with http.post(proxy.v1 + "/chat/completions", json=body | {"stream": True, "max_tokens": 4, "temperature": 0}) as resp:
        return resp.status, await resp.text(), dict(resp.headers)


@pytest.mark.llamacpp
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


async def test_with_every_replica_gone_the_answer_is_a_clear_503(start_proxy, http, refused_port):
    dead = [f"http://127.0.0.1:{refused_port()}" for _ in range(2)]
    proxy = await start_proxy(ReplicaSet([OpenAICompatibleBackend(u) for u in dead]))
    async with http.post(proxy.v1 + "/chat/completions", json=chat(TENANTS[0])) as resp:
        body = await resp.json()
    assert resp.status == 503 and "Retry-After" in resp.headers
    assert "replica" in body["error"]["message"] or "cannot connect" in body["error"]["message"]


# ------------------------------------------------------------------ a mixed fleet (backends:)
async def test_a_mixed_fleet_from_yaml_routes_each_model_to_the_upstreams_that_serve_it(start_upstream, start_proxy, http, tmp_path):
    """``backends:`` with an OpenAI-compatible server and an Ollama: /v1/models lists both
    models, and each request goes to the upstream that lists its model."""
    from kvstream.cli.serve import build_backend
    from kvstream.config import load_settings
    from tests.doubles import ollama_double

    openai_url, openai_seen = await start_upstream(model_id="alpha")
    ollama_url, ollama_seen = await start_upstream(factory=ollama_double)
    (tmp_path / "kvstream.yaml").write_text(
        "backend:\n  exact_tokens: false\n"
        f"backends:\n  - type: openai\n    url: {openai_url}\n    parallel: 2\n"
        f"  - type: ollama\n    url: {ollama_url}\n    weight: 2\n"
    )
    loaded = load_settings(environ={}, cwd=tmp_path)
    backend = await build_backend(loaded.settings)
    assert isinstance(backend, ReplicaSet) and backend.name == "mixed" and not backend.forwards_body
    proxy = await start_proxy(backend)
    models = await (await http.get(proxy.v1 + "/models")).json()
    assert {"alpha", "llama3.2:latest"} <= {m["id"] for m in models["data"]}
    for model, url in (("alpha", openai_url), ("llama3.2:latest", ollama_url), ("alpha", openai_url)):
        async with http.post(proxy.v1 + "/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["X-KVStream-Backend"] == url
    assert len(openai_seen.bodies) == 2 and len(ollama_seen.bodies) == 1
    status = await (await http.get(proxy.url + "/status")).json()
    assert [(r["type"], r["weight"], r["slots"]) for r in status["backend"]["replicas"]] == [("openai", 1.0, 2), ("ollama", 2.0, 1)]


async def test_weights_share_round_robin_and_new_prefixes(start_upstream, start_proxy, http):
    urls, _ = await two_replicas(start_upstream)
    backend = ReplicaSet([OpenAICompatibleBackend(u, parallel=8) for u in urls], weights=[2.0, 1.0])
    proxy = await start_proxy(backend, routing={"policy": "round_robin"})
    seen = [(await post(http, proxy, chat(TENANTS[0], f"q{i}")))[1]["X-KVStream-Backend"] for i in range(9)]
    assert seen.count(urls[0]) == 6 and seen.count(urls[1]) == 3
    # Weighted rendezvous: of many new prefixes, the heavier replica takes about two thirds.
    from kvstream.backends.replicas import rendezvous

    wins = sum(rendezvous(i.to_bytes(4, "big"), backend.replicas) is backend.replicas[0] for i in range(3000))
    assert 1800 < wins < 2200


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("backends:\n  - type: nosuch\n", "backends[0]: unknown backend 'nosuch'"),
        ("backends:\n  - url: http://x\n", "backends[0].type"),
        ("backends:\n  - type: openai\n    weight: 0\n", "backends[0].weight"),
        ("backends:\n  type: openai\n", "'backends' must be a list"),
        ("backends:\n  - type: hf\n  - type: openai\n", "backends[0]: the in-process engine"),
    ],
)
async def test_a_bad_backends_list_is_one_clear_error(tmp_path, yaml_text, message, caplog):
    import typer

    from kvstream.cli.serve import build_backend
    from kvstream.config import ConfigError, load_settings

    (tmp_path / "kvstream.yaml").write_text(yaml_text)
    try:
        settings = load_settings(environ={}, cwd=tmp_path).settings
    except ConfigError as exc:
        assert message in str(exc) and "\n" not in str(exc)
        return
    with pytest.raises(typer.Exit) as exit_, caplog.at_level("ERROR"):
        await build_backend(settings)
    assert exit_.value.exit_code == 2 and message in caplog.text


def test_the_backends_list_comes_from_the_environment_as_json_and_shows_without_secrets(tmp_path):
    from kvstream.config import describe, load_settings

    env = {"KVSTREAM_BACKENDS": '[{"type": "vllm", "url": "http://u:p@gpu1:8000", "api_key": "sk-secret"}, {"type": "sglang"}]'}
    loaded = load_settings(environ=env, cwd=tmp_path)
    assert [e.type for e in loaded.settings.backends] == ["vllm", "sglang"]
    rows = {key: (value, source) for key, value, source in describe(loaded)}
    shown, source = rows["backends[0]"]
    assert source == "KVSTREAM_BACKENDS" and "sk-secret" not in shown and "u:p" not in shown and "***@gpu1" in shown


@pytest.mark.llamacpp
async def test_a_second_kvstream_restores_a_prefix_from_the_shared_slot_directory(start_proxy, http, tmp_path):
    """Two real llama-servers sharing a slot directory. The first KVStream computes a long
    prefix on one and saves it; a second KVStream, which never saw it, finds no slot that
    holds it but a file any replica can restore: route ``restore``, and the replica it
    chose reports reusing the prefix (restored, not computed)."""
    from kvstream.backends import LlamaCppBackend
    from tests.conftest import launch_llama_server

    shared = tmp_path / "slots"
    shared.mkdir()
    servers = [launch_llama_server(slots=2, ctx=4096, slot_dir=shared, extra=["--cache-ram", "0"]) for _ in range(2)]
    try:
        urls = [s.url for s in servers]
        system = "You answer questions about the tenant's invoices, carefully and briefly. " * 24
        body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}], "max_tokens": 2}
        first = await start_proxy(ReplicaSet([LlamaCppBackend(u, slot_save_path=shared) for u in urls]))
        async with http.post(first.v1 + "/chat/completions", json=body) as resp:
            assert resp.status == 200
        await wait_saved(shared)
        second = await start_proxy(ReplicaSet([LlamaCppBackend(u, slot_save_path=shared) for u in urls]))
        body["messages"][1]["content"] = "and again"
        async with http.post(second.v1 + "/chat/completions", json=body) as resp:
            answer = await resp.json()
            assert resp.status == 200 and resp.headers["X-KVStream-Route"] == "restore"
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 200
    finally:
        for server in servers:
            server.stop()


async def wait_saved(directory) -> None:
    for _ in range(100):
        if list(directory.glob("kvs-*.bin")):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no slot file was saved")
