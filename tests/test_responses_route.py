"""``POST /v1/responses`` in front of remote runtimes: translated for Ollama's native API
(as the chat route is) and served through the engine; passed through to a runtime that
speaks OpenAI itself, its own answer (or its own 404) coming back. The in-process engine's
side is tests/hf/test_responses.py."""

from __future__ import annotations

import openai
import pytest

from kvstream.backends import OllamaBackend, OpenAICompatibleBackend
from tests.conftest import wait_released
from tests.doubles import Script, ollama_double


async def test_in_front_of_ollama_it_is_translated_and_served_by_the_engine(start_upstream, start_proxy):
    """(``llama3.2`` is ``llama3.2:latest``, as Ollama itself takes it.)"""
    url, recorder = await start_upstream(Script(tokens=["Hel", "lo", "!"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        reply = await client.responses.create(model="llama3.2", instructions="Be brief.", input="Hi", max_output_tokens=8)
        assert reply.output_text == "Hello!" and reply.status == "completed" and reply.usage.output_tokens == 3
        body = recorder.bodies[-1]
        assert body["model"] == "llama3.2:latest"
        assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        assert body["options"]["num_predict"] == 8
        stream = await client.responses.create(model="llama3.2", input="Hi", stream=True)
        deltas = [event.delta async for event in stream if event.type == "response.output_text.delta"]
        assert "".join(deltas) == "Hello!"
    await wait_released(proxy)
    assert proxy.engine.stats.requests_finished == 2


async def test_in_front_of_an_openai_runtime_it_is_the_runtimes_own(start_upstream, start_proxy):
    """The double serves no /v1/responses: its own 404 reaches the client (not KVStream's)."""
    url, _ = await start_upstream(Script())
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="m", input="Hi")
