"""``--backend auto`` identifies each runtime by what only it answers (issue 16): a KVStream
or a plain OpenAI server on llama-server's old port is not taken for llama-server, and an
answer relayed by a KVStream (its ``Via`` header) never counts."""

from __future__ import annotations

import aiohttp
import pytest

from kvstream.backends import LlamaCppBackend, LMStudioBackend, OllamaBackend, OpenAICompatibleBackend
from kvstream.backends import auto
from tests.conftest import make_settings
from tests.doubles import lmstudio_double, ollama_double, openai_upstream

KINDS = {"ollama": OllamaBackend, "llamacpp": LlamaCppBackend, "lmstudio": LMStudioBackend}


async def identified(url: str) -> set[str]:
    """The runtimes whose probe says that ``url`` is them."""
    found = set()
    for name, cls in KINDS.items():
        backend = cls(url)
        await backend.start()
        try:
            if await backend.identify():
                found.add(name)
        finally:
            await backend.close()
    return found


@pytest.mark.parametrize(
    "factory, expected",
    [(ollama_double, {"ollama"}), (lmstudio_double, {"lmstudio"}), (openai_upstream, set())],
    ids=["ollama", "lmstudio", "plain-openai-server"],
)
async def test_each_double_is_identified_as_itself_only(start_upstream, factory, expected):
    url, _ = await start_upstream(factory=factory)
    assert await identified(url) == expected


async def test_real_llama_server_is_identified_and_a_kvstream_in_front_of_it_is_not(llama_server, start_proxy, http):
    assert await identified(llama_server.url) == {"llamacpp"}
    proxy = await start_proxy(OpenAICompatibleBackend(llama_server.url))
    async with http.get(proxy.url + "/props") as resp:  # the runtime's /props, passed through
        assert resp.status == 200 and "total_slots" in await resp.json()
        assert "kvstream" in resp.headers["Via"]
    assert await identified(proxy.url) == set()


async def test_a_kvstream_in_another_process_is_told_apart_by_its_via_answer(llama_server, tmp_path):
    """In-process proxies share this process's Via id, so the probes above are refused as a
    loop (508); a KVStream of its own process answers /props with the runtime's body, and
    only its Via header tells it apart."""
    from tests.test_hostile import start_kvstream, stop

    server = start_kvstream(llama_server.url, tmp_path, {})
    try:
        async with aiohttp.ClientSession() as http, http.get(server.url + "/props") as resp:
            assert resp.status == 200 and "total_slots" in await resp.json()
            assert "kvstream" in resp.headers["Via"]
        assert await identified(server.url) == set()
    finally:
        stop(server.proc)


async def test_auto_skips_a_kvstream_on_llama_servers_old_port(start_upstream, start_proxy, monkeypatch):
    url, _ = await start_upstream(factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))  # a KVStream in front of Ollama
    monkeypatch.setattr(auto, "CANDIDATES", [(LlamaCppBackend, proxy.url), (OllamaBackend, proxy.url), (OllamaBackend, url)])
    tried: list[str] = []
    found = await auto.probe_runtimes(make_settings(), tried)
    assert isinstance(found, OllamaBackend) and found.base_url == url
    # What the log line names: each runtime asked and where.
    assert tried == [f"llamacpp ({proxy.url})", f"ollama ({proxy.url})", f"ollama ({url})"]


@pytest.mark.parametrize("value, url", [
    ("0.0.0.0", "http://127.0.0.1:11434"),  # set so that the server listens everywhere; reached here on loopback
    ("0.0.0.0:11500", "http://127.0.0.1:11500"),
    (":11500", "http://127.0.0.1:11500"),
    ("gpu-box", "http://gpu-box:11434"),
    ("http://gpu-box", "http://gpu-box:80"),  # a scheme named: its port, as Ollama reads it
    ("https://ollama.example.com", "https://ollama.example.com:443"),
    ("[::1]:11434", "http://[::1]:11434"),
    ("", None),
    ("box:notaport", None),
])
def test_ollama_host_is_read_as_ollama_reads_it(value, url):
    from kvstream.backends.ollama import ollama_host_url

    assert ollama_host_url(value) == url


async def test_ollama_is_found_where_ollama_host_says(start_upstream, monkeypatch):
    """A user who runs Ollama elsewhere sets OLLAMA_HOST for its CLI and clients; ``--backend
    ollama`` and ``auto`` (KVStream's own probe) look there too, not only at :11434."""
    url, _ = await start_upstream(factory=ollama_double)
    monkeypatch.setenv("OLLAMA_HOST", url.removeprefix("http://"))
    assert OllamaBackend(None).base_url == url
    monkeypatch.setattr(auto, "CANDIDATES", [(OllamaBackend, None)])
    tried: list[str] = []
    found = await auto.probe_runtimes(make_settings(), tried)
    assert isinstance(found, OllamaBackend) and found.base_url == url and tried == [f"ollama ({url})"]
