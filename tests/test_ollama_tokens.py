"""Exact prompt counts in front of Ollama (issue 16): the model's tokenizer and chat template
rebuilt from /api/show's verbose model_info, checked against a real llama-server's own
template and tokenizer on the same GGUF, and dropped for a model whose counts Ollama
contradicts."""

from __future__ import annotations

import aiohttp
import pytest

from kvstream.backends import OllamaBackend
from tests.conftest import require_import, smollm2_gguf
from tests.doubles import Script, ollama_double

MODEL = "llama3.2:latest"
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are Bob. Be brief."},
     {"role": "user", "content": "Spaces   and\nnewlines.\n\n Ünïcödé 日本語 🙂"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module")
def model_info() -> dict:
    """What Ollama's /api/show returns as model_info for this GGUF: its metadata, whole."""
    require_import("transformers")
    gguf = require_import("gguf")
    reader = gguf.GGUFReader(str(smollm2_gguf()))
    return {name: field.contents() for name, field in reader.fields.items() if name.startswith(("general.", "tokenizer."))}


async def llama_server_count(session: aiohttp.ClientSession, url: str, messages: list[dict]) -> int:
    async with session.post(url + "/apply-template", json={"messages": messages}) as resp:
        prompt = (await resp.json())["prompt"]
    async with session.post(url + "/tokenize", json={"content": prompt, "add_special": True, "parse_special": True}) as resp:
        return len((await resp.json())["tokens"])


async def test_counts_equal_llama_servers_on_the_same_gguf(model_info, llama_server, start_upstream, start_proxy, http):
    url, _ = await start_upstream(Script(prompt_tokens=1), factory=lambda s, r: ollama_double(s, r, model_info=model_info))
    proxy = await start_proxy(OllamaBackend(url))
    for messages in CHATS:
        before = proxy.engine.stats.prefix_query_tokens
        async with http.post(proxy.v1 + "/chat/completions", json={"model": MODEL, "messages": messages}) as resp:
            assert resp.status == 200, await resp.text()
        counted = proxy.engine.stats.prefix_query_tokens - before
        assert counted == await llama_server_count(http, llama_server.url, messages), messages
    async with http.get(proxy.url + "/status") as resp:
        assert (await resp.json())["requests"]["prompts_counted"] == {"exact": 3, "estimated": 0}


async def test_a_model_whose_counts_ollama_contradicts_goes_back_to_estimates(model_info, start_upstream, start_proxy, http):
    # Ollama says it evaluated more prompt tokens than KVStream counted: its template differs.
    url, _ = await start_upstream(Script(prompt_tokens=5000), factory=lambda s, r: ollama_double(s, r, model_info=model_info))
    proxy = await start_proxy(OllamaBackend(url))
    for _ in range(2):
        async with http.post(proxy.v1 + "/chat/completions", json={"model": MODEL, "messages": CHATS[0]}) as resp:
            assert resp.status == 200
    assert (proxy.engine.stats.prompts_exact, proxy.engine.stats.prompts_estimated) == (1, 1)


async def test_without_the_vocabulary_prompts_are_estimated(start_upstream, start_proxy, http):
    url, _ = await start_upstream(Script(), factory=ollama_double)  # model_info has no tokenizer
    proxy = await start_proxy(OllamaBackend(url))
    async with http.post(proxy.v1 + "/chat/completions", json={"model": MODEL, "messages": CHATS[0]}) as resp:
        assert resp.status == 200
    assert (proxy.engine.stats.prompts_exact, proxy.engine.stats.prompts_estimated) == (0, 1)
