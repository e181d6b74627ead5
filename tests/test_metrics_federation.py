"""/metrics carries the runtime's own Prometheus families after KVStream's: a real
llama-server's through as they came (the scrape target a user had keeps working), several
vLLM replicas' merged and labelled; a runtime without metrics, a slow one, one that
answers HTML, and one that is gone add nothing and delay nothing."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvstream.backends import LlamaCppBackend, federation
from kvstream.backends.federation import RuntimeScrape, families, labelled, merge
from kvstream.backends.replicas import ReplicaSet
from kvstream.backends.vllm import VLLMBackend
from tests.doubles import EngineLoad, Script, metered_upstream, openai_upstream

OWN = (
    "# HELP kvstream_queue_depth Requests waiting.\n# TYPE kvstream_queue_depth gauge\nkvstream_queue_depth 0.0\n"
    "# HELP process_open_fds Open files.\n# TYPE process_open_fds gauge\nprocess_open_fds 9.0\n"
)
RUNTIME = (
    "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
    "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 12\n"
    "# HELP llamacpp:n_tokens_max Largest observed n_tokens.\n# TYPE llamacpp:n_tokens_max counter\nllamacpp:n_tokens_max 7\n"
    "# a plain comment\n"
    "# HELP process_open_fds The runtime's open files.\n# TYPE process_open_fds gauge\nprocess_open_fds 40\n"
    "# TYPE ttft histogram\nttft_bucket{le=\"0.1\"} 1\nttft_bucket{} 2\nttft_sum 0.3\nttft_count 2\n"
)


def sample_values(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition, parsed by prometheus_client (which rejects a malformed one)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


# ---------------------------------------------------------------- the text, alone
def test_one_runtimes_families_follow_kvstreams_as_they_came():
    text = merge(OWN, [RuntimeScrape("http://a", RUNTIME)])
    assert text.startswith(OWN)
    runtime = text[len(OWN) :]
    # Names, types and samples untouched: a counter without _total keeps its name (re-rendering
    # through prometheus_client would have renamed it).
    assert "# TYPE llamacpp:n_tokens_max counter\nllamacpp:n_tokens_max 7\n" in runtime
    assert 'ttft_bucket{le="0.1"} 1\n' in runtime and "ttft_bucket{} 2\n" in runtime
    # A name KVStream's own output has stays KVStream's: one meaning per name in one scrape.
    assert "process_open_fds" not in runtime and "plain comment" not in runtime
    assert sample_values(text)[("process_open_fds", ())] == 9.0


def test_several_runtimes_are_merged_per_family_and_labelled_by_url():
    text = merge(OWN, [RuntimeScrape("http://a:1", RUNTIME), RuntimeScrape('http://b"2', RUNTIME.replace(" 12\n", " 30\n"))])
    assert text.count("# TYPE llamacpp:prompt_tokens_total counter") == 1
    values = sample_values(text)  # one family per name, or the parser would split them
    assert values[("llamacpp:prompt_tokens_total", (("kvstream_backend", "http://a:1"),))] == 12
    assert values[("llamacpp:prompt_tokens_total", (("kvstream_backend", 'http://b"2'),))] == 30
    assert values[("ttft_bucket", (("kvstream_backend", "http://a:1"), ("le", "0.1")))] == 1
    assert values[("ttft_bucket", (("kvstream_backend", "http://a:1"),))] == 2
    lines = text.splitlines()
    first, last = lines.index("# TYPE ttft histogram"), max(i for i, line in enumerate(lines) if line.startswith("ttft_count"))
    assert all(line.startswith("ttft_") for line in lines[first + 1 : last + 1])  # a family's samples stay together


def test_labelling_a_sample_keeps_its_labels_value_and_timestamp():
    assert labelled('m{a="1"} 2 1700', "k", "u") == 'm{k="u",a="1"} 2 1700'
    assert labelled("m 2", "k", 'x\\"\n') == 'm{k="x\\\\\\"\\n"} 2'
    assert labelled("m{} 2", "k", "u") == 'm{k="u"} 2'
    assert [name for name, _, _ in families("orphan 1\n# TYPE g gauge\ng 2\nstray 3\n# TYPE h histogram\nh_bucket 1\nh_sum 2\n")] == [
        "orphan", "g", "stray", "h"
    ]


# ---------------------------------------------------------------- through the proxy
@pytest.mark.llamacpp
async def test_a_real_llama_servers_metrics_are_on_kvstreams_metrics(llama_server, start_proxy, http):
    """llama.cpp's own server suite asks exactly this of /metrics (test_metrics_prometheus_format)."""
    proxy = await start_proxy(LlamaCppBackend(llama_server.url))
    async with http.post(proxy.url + "/completion", json={"prompt": "I believe", "n_predict": 4}) as resp:
        assert resp.status == 200
    async with http.get(proxy.url + "/metrics") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        assert int(resp.headers["Process-Start-Time-Unix"]) > 0  # the runtime's header came along
        assert "Access-Control-Allow-Origin" not in resp.headers  # llama-server's CORS header did not
        text = await resp.text()
    async with http.get(llama_server.url + "/metrics") as resp:
        direct = await resp.text()
    values = sample_values(text)
    assert values[("llamacpp:prompt_tokens_total", ())] == sample_values(direct)[("llamacpp:prompt_tokens_total", ())] > 0
    assert any(name.startswith("kvstream_") for name, _ in values)
    for line in direct.splitlines():
        if line.startswith("# TYPE"):
            assert line in text  # every family of the runtime's, typed as the runtime typed it

    proxy = await start_proxy(LlamaCppBackend(llama_server.url), server={"runtime_metrics": False})
    async with http.get(proxy.url + "/metrics") as resp:
        assert "llamacpp:" not in await resp.text() and "Process-Start-Time-Unix" not in resp.headers


async def test_several_vllm_replicas_metrics_are_labelled_apart(start_upstream, start_proxy, http):
    urls = [(await start_upstream(Script(), factory=metered_upstream, load=EngineLoad(others_running=n)))[0] for n in (3, 8)]
    proxy = await start_proxy(ReplicaSet([VLLMBackend(u) for u in urls]))
    text = await (await http.get(proxy.url + "/metrics")).text()
    values = sample_values(text)
    running = {dict(labels).get("kvstream_backend"): v for (name, labels), v in values.items() if name == "vllm:num_requests_running"}
    assert running == {urls[0]: 3.0, urls[1]: 8.0}
    assert values[("kvstream_replica_up", (("backend", urls[0]),))] == 1.0  # KVStream's own series still there


def quiet_runtime(answer) -> web.Application:
    """An OpenAI double whose /metrics answers with ``answer(request)``."""
    from tests.doubles import Recorder

    app = openai_upstream(Script(), Recorder())
    app.router.add_get("/metrics", answer)
    return app


async def test_a_runtime_without_usable_metrics_adds_nothing_and_delays_little(aiohttp_server, start_proxy, http, monkeypatch):
    asked: list[str] = []

    async def disabled(request):  # llama-server without --metrics
        asked.append("disabled")
        return web.json_response({"error": {"code": 501, "message": "This server does not support metrics endpoint."}}, status=501)

    async def html(request):
        asked.append("html")
        return web.Response(text="<html>runtime_metric 1</html>", content_type="text/html")

    async def stuck(request):
        asked.append("stuck")
        await asyncio.sleep(30)
        return web.Response(text="runtime_metric 1\n", content_type="text/plain")

    monkeypatch.setattr(federation, "SCRAPE_TIMEOUT_S", 0.3)
    for answer in (disabled, html, stuck):
        server = await aiohttp_server(quiet_runtime(answer))
        proxy = await start_proxy(LlamaCppBackend(str(server.make_url("")).rstrip("/")))
        async with http.get(proxy.url + "/metrics", timeout=10) as resp:
            text = await resp.text()
        assert resp.status == 200 and "kvstream_requests_total" in text and "runtime_metric" not in text, answer.__name__
        sample_values(text)
    assert asked == ["disabled", "html", "stuck"]
    # A runtime that is gone (nothing listens at its port): KVStream's own metrics all the same.
    gone = await aiohttp_server(quiet_runtime(disabled))
    url = str(gone.make_url("")).rstrip("/")
    await gone.close()
    proxy = await start_proxy(LlamaCppBackend(url))
    async with http.get(proxy.url + "/metrics", timeout=10) as resp:
        assert resp.status == 200 and "kvstream_requests_total" in await resp.text()
