"""Ollama's API as a second front, driven by the official ``ollama`` client: in front of an
OpenAI-compatible runtime (a double here, the real llama-server in the llamacpp-marked test)
and in front of a real Ollama (its own routes pass through)."""

from __future__ import annotations

import asyncio
import gzip
import json
import re

import ollama
import openai
import pytest

import kvstream

from kvstream.backends import LlamaCppBackend, OllamaBackend, OpenAICompatibleBackend
from tests.conftest import wait_released
from tests.doubles import Script, ollama_double


@pytest.fixture
async def front(start_upstream, start_proxy):
    script = Script(tokens=["Hel", "lo", "!"], prompt_tokens=9)
    url, recorder = await start_upstream(script)
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    return proxy, script, recorder, ollama.AsyncClient(host=proxy.url)


async def test_chat_streams_ndjson_the_way_ollama_does(front):
    proxy, _, recorder, client = front
    parts = [part async for part in await client.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}], stream=True)]
    assert "".join(p.message.content for p in parts) == "Hello!"
    assert [p.done for p in parts] == [False, False, False, True]
    last = parts[-1]
    assert last.done_reason == "stop" and last.prompt_eval_count == 9 and last.eval_count == 3
    assert last.total_duration > 0 and last.eval_duration >= 0 and last.model == "llama3.2"
    sent = recorder.bodies[-1]
    assert sent["messages"] == [{"role": "user", "content": "hi"}] and sent["model"] == "test-model"
    await wait_released(proxy)
    assert proxy.engine.stats.requests_finished == 1


async def test_chat_without_streaming_maps_options_format_and_tools(front):
    _, _, recorder, client = front
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
    reply = await client.chat(
        model="llama3.2", messages=[{"role": "user", "content": "hi"}], stream=False, format="json", tools=tools,
        options={"temperature": 0, "num_predict": 5, "stop": ["\n"], "repeat_penalty": 1.1, "num_ctx": 4096},
    )
    assert reply.message.content == "Hello!" and reply.done and reply.done_reason == "stop"
    sent = recorder.bodies[-1]
    assert (sent["temperature"], sent["max_tokens"], sent["stop"], sent["repeat_penalty"]) == (0, 5, ["\n"], 1.1)
    assert sent["response_format"] == {"type": "json_object"} and sent["tools"] == tools
    assert "num_ctx" not in sent  # a load-time option, the runtime's own


async def test_a_tool_loop_reaches_the_runtime_with_each_result_paired_with_its_call(front, http):
    """An app's tool loop as Ollama's clients send it (arguments as objects, results named by
    ``tool_name``) reaches an OpenAI runtime as OpenAI's: arguments as JSON text (one sent
    as text, OpenAI's habit, kept, not encoded twice), each result's ``tool_call_id`` its
    call's (templates pair them), an earlier answer's thinking left out."""
    proxy, _, recorder, client = front
    await client.chat(model="llama3.2", stream=False, messages=[
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "", "thinking": "Two tools.", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "get_time", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "14:00", "tool_name": "get_time"},
        {"role": "tool", "content": "22C"},
    ])
    assistant, time_result, weather_result = recorder.bodies[-1]["messages"][1:]
    calls = {call["function"]["name"]: call for call in assistant["tool_calls"]}
    assert json.loads(calls["get_weather"]["function"]["arguments"]) == {"city": "Paris"} and "thinking" not in assistant
    assert time_result["tool_call_id"] == calls["get_time"]["id"] and weather_result["tool_call_id"] == calls["get_weather"]["id"]
    assert len({call["id"] for call in assistant["tool_calls"]}) == 2
    async with http.post(proxy.url + "/api/chat", json={"model": "llama3.2", "stream": False, "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}]}) as resp:
        assert resp.status == 200  # (the ollama client itself only sends objects)
    assert recorder.bodies[-1]["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'


@pytest.mark.parametrize("calls", [[{"x": 1}], "get_weather", [{"function": {"arguments": {}}}],
                                   [{"function": {"name": "f", "arguments": [1]}}]])
async def test_malformed_tool_calls_in_the_history_are_a_400_not_a_500(front, http, calls):
    proxy, _, recorder, _ = front
    async with http.post(proxy.url + "/api/chat", json={"model": "llama3.2", "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls}]}) as resp:
        assert resp.status == 400 and "tool call" in (await resp.json())["error"]
    assert not recorder.bodies


@pytest.mark.parametrize("options, error", [
    ({"num_predict": "x"}, 'option "num_predict" must be of type integer'),
    ({"num_predict": True}, 'option "num_predict" must be of type integer'),
    ({"seed": "a"}, 'option "seed" must be of type integer'),
    ({"temperature": "hot"}, 'option "temperature" must be of type float'),
    ({"top_p": [1]}, 'option "top_p" must be of type float'),
    ({"stop": 5}, 'option "stop" must be of type array of strings'),
    ({"stop": ["a", 1]}, 'option "stop" must be of type array of strings'),
    ({"num_ctx": "big"}, 'option "num_ctx" must be of type integer'),
    ({"use_mmap": 1}, 'option "use_mmap" must be of type boolean'),
])
async def test_an_option_of_the_wrong_type_is_a_400_naming_it_as_ollama_does(front, options, error):
    _, _, recorder, client = front
    with pytest.raises(ollama.ResponseError) as caught:
        await client.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}], stream=False, options=options)
    assert caught.value.status_code == 400 and caught.value.error == error
    assert not recorder.bodies  # nothing reached the runtime


@pytest.mark.parametrize("fmt", ["xml", 123, ["json"], True])
async def test_a_format_neither_json_nor_a_schema_is_a_400_in_ollamas_words(front, http, fmt):
    """Ollama refuses a ``format`` that is neither "json" nor a JSON schema object (null and ""
    are "not set"): the answer is not silently left unconstrained."""
    proxy, _, recorder, _ = front
    for path, field in (("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}), ("/api/generate", {"prompt": "hi"})):
        async with http.post(proxy.url + path, json={"model": "llama3.2", "stream": False, "format": fmt} | field) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"].endswith('expected "json" or a valid JSON Schema object')
    assert not recorder.bodies  # nothing reached the runtime
    async with http.post(proxy.url + "/api/chat", json={"model": "llama3.2", "stream": False, "format": "",
                                                        "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("field, error", [
    ({"tools": "get_weather"}, "tools must be a list of tools (objects)"),
    ({"tools": ["get_weather"]}, "tools must be a list of tools (objects)"),
    ({"stream": "yes"}, "stream must be a boolean"),
    ({"keep_alive": "a while"}, 'time: invalid duration "a while"'),
    ({"keep_alive": True}, "time: invalid duration true"),
])
async def test_a_malformed_field_is_a_400_naming_it(front, http, field, error):
    """Fields of the wrong shape are refused before anything runs, saying which (a tools
    string reached the chat template and came back as a Python attribute error)."""
    proxy, _, recorder, _ = front
    async with http.post(proxy.url + "/api/chat", json={"model": "llama3.2", "messages": [{"role": "user", "content": "hi"}]}
                         | field) as resp:
        assert resp.status == 400 and (await resp.json())["error"] == error
    assert not recorder.bodies


async def test_keep_alive_is_taken_in_every_form_apps_send(front):
    """Seconds, Go durations, and seconds in a string ("-1": apps send Ollama's "forever" so)."""
    _, _, _, client = front
    for keep_alive in (300, -1, "5m", "1h30m", "-1", "-1s", "", None):
        reply = await client.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}], keep_alive=keep_alive)
        assert reply.done


async def test_options_are_read_as_ollama_reads_them(front):
    """Integer options take any number, truncated; null is unset; a num_predict of 0 or less
    is no limit, and one stop string is a list of one."""
    _, _, recorder, client = front
    for options, expected in [
        ({"top_k": 2.7, "seed": 4.0, "num_predict": 0, "stop": "."}, {"top_k": 2, "seed": 4, "stop": ["."]}),
        ({"num_predict": -1, "temperature": None, "top_p": 1}, {"top_p": 1.0}),
        ({"num_predict": -2}, {}),
    ]:
        await client.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}], stream=False, options=options)
        sent = recorder.bodies[-1]
        assert {k: sent[k] for k in expected} == expected and "max_tokens" not in sent and "temperature" not in sent
        assert all(type(sent[k]) is type(v) for k, v in expected.items())


async def test_think_reaches_an_openai_compatible_runtime_as_its_switch_and_thinking_comes_back(front):
    """Ollama's ``think`` said the way llama-server and vLLM read it (a runtime ignores
    ``think``: the model would think anyway), and the runtime's ``reasoning_content``
    comes back as Ollama's ``thinking``, streamed and whole."""
    _, script, recorder, client = front
    script.reasoning = ["The user ", "greets."]
    ask = [{"role": "user", "content": "hi"}]
    parts = [part async for part in await client.chat(model="llama3.2", messages=ask, stream=True, think=True)]
    assert "".join(p.message.thinking or "" for p in parts) == "The user greets."
    assert "".join(p.message.content for p in parts) == "Hello!"
    sent = recorder.bodies[-1]
    assert sent["chat_template_kwargs"] == {"enable_thinking": True} and "think" not in sent
    reply = await client.chat(model="llama3.2", messages=ask, stream=False, think=False)
    assert (reply.message.thinking, reply.message.content) == ("The user greets.", "Hello!")  # the double thinks anyway
    assert recorder.bodies[-1]["chat_template_kwargs"] == {"enable_thinking": False}
    reply = await client.generate(model="llama3.2", prompt="hi", stream=False, think="high")
    sent = recorder.bodies[-1]
    assert sent["reasoning_effort"] == "high" and "think" not in sent and "chat_template_kwargs" not in sent
    assert reply.thinking == "The user greets." and reply.response == "Hello!"
    await client.chat(model="llama3.2", messages=ask, stream=False)
    assert not {"think", "chat_template_kwargs", "reasoning_effort"} & set(recorder.bodies[-1])


async def test_generate_templates_the_prompt_as_a_user_turn_unless_raw(front):
    _, script, recorder, client = front
    script.finish_reason = "length"
    reply = await client.generate(model="llama3.2", prompt="Why is the sky blue?", system="Be brief.", stream=False)
    assert reply.response == "Hello!" and reply.done_reason == "length"
    assert recorder.bodies[-1]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    parts = [p async for p in await client.generate(model="llama3.2", prompt="1, 2,", raw=True, stream=True)]
    assert "".join(p.response for p in parts) == "Hello!"
    assert recorder.bodies[-1]["prompt"] == "1, 2,"


async def test_generate_carries_its_images_and_a_suffix_for_fill_in_the_middle(front, http):
    """Images go with the templated user turn; a suffix makes the request a completion
    between the prompt and the suffix (code completion), OpenAI's ``suffix`` upstream; what
    cannot be said so is a 400 in Ollama's shape."""
    proxy, _, recorder, client = front
    await client.generate(model="llama3.2", prompt="What is in this picture?", images=["aGVsbG8="], stream=False)
    assert recorder.bodies[-1]["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]
    reply = await client.generate(model="llama3.2", prompt="def area(r):\n    return ", suffix="\n\nprint(area(2))", stream=False)
    assert reply.response == "Hello!"
    sent = recorder.bodies[-1]
    assert (sent["prompt"], sent["suffix"], "messages" in sent) == ("def area(r):\n    return ", "\n\nprint(area(2))", False)
    for body, error in (({"raw": True, "system": "x"}, "raw mode does not support"), ({"suffix": 5}, "suffix must be a string"),
                        ({"suffix": "x", "images": ["aGVsbG8="]}, "images in a templated prompt only"),
                        ({"images": "aGVsbG8="}, "images must be a list")):
        async with http.post(proxy.url + "/api/generate", json={"model": "llama3.2", "prompt": "p"} | body) as resp:
            assert resp.status == 400 and error in (await resp.json())["error"], body


async def test_in_front_of_ollama_a_completions_suffix_reaches_its_generate(start_upstream, start_proxy):
    """An OpenAI client's fill-in-the-middle (``suffix``, as code-completion plugins send it)
    becomes Ollama's own ``suffix``, as Ollama's /v1/completions passes it."""
    import openai

    url, recorder = await start_upstream(Script(tokens=["x"]), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
        await client.completions.create(model="llama3.2", prompt="def area(r):\n    return ", suffix="\n", max_tokens=8)
    sent = recorder.bodies[-1]
    assert (sent["prompt"], sent["suffix"]) == ("def area(r):\n    return ", "\n")
    await wait_released(proxy)


async def test_model_routes_describe_the_backend(front, http):
    proxy, _, _, client = front
    assert [m.model for m in (await client.list()).models] == ["test-model"]
    assert [m.model for m in (await client.ps()).models] == ["test-model"]
    shown = await client.show("test-model")
    assert shown.details is not None and shown.capabilities == ["completion"]
    # The double reports no architecture: named "unknown" so that apps reading
    # model_info[<architecture>.context_length] find it; its name is the model's id.
    assert shown.modelinfo["general.architecture"] == "unknown" and shown.modelinfo["general.basename"] == "test-model"
    assert set(shown.modelinfo) <= {"general.architecture", "general.basename", "unknown.context_length"}


async def test_version_is_the_ollama_api_it_speaks_which_apps_check_before_connecting(front, http):
    """/api/version is the Ollama release whose API the front follows (apps gate on it: VS
    Code's Copilot refuses a server below 0.6.4, and KVStream's own 0.1.0 read as one);
    KVStream's own version is in /status and the Via header."""
    proxy, _, _, client = front
    async with http.get(proxy.url + "/api/version") as resp:
        version = (await resp.json())["version"]
    assert tuple(int(part) for part in version.split(".")) >= (0, 12, 11)  # logprobs, answered by the front
    async with http.get(proxy.url + "/status") as resp:
        assert (await resp.json())["version"] == kvstream.__version__
        assert f"kvstream/{kvstream.__version__}" in resp.headers["Via"]


async def test_an_empty_chat_or_prompt_loads_or_unloads_and_generates_nothing(front):
    """Apps preload a model with an empty chat or prompt (``ollama run`` does) and unload it
    with ``keep_alive: 0`` (``ollama stop``): answered as Ollama answers them, ``done_reason``
    "load" or "unload", without a generation (the backend's model stays loaded)."""
    proxy, _, recorder, client = front
    loaded = await client.chat(model="llama3.2", messages=[])
    assert (loaded.done, loaded.done_reason, loaded.message.content) == (True, "load", "")
    unloaded = await client.chat(model="llama3.2", messages=[], keep_alive=0)
    assert unloaded.done_reason == "unload"
    for keep_alive, reason in [(None, "load"), ("0s", "unload"), ("0", "unload"), ("5m", "load"), (-1, "load"), (0.0, "unload")]:
        answer = await client.generate(model="llama3.2", prompt="", keep_alive=keep_alive, stream=False)
        assert (answer.done, answer.done_reason, answer.response) == (True, reason, ""), keep_alive
    streamed = [part async for part in await client.generate(model="llama3.2", stream=True)]
    assert [(p.done, p.done_reason) for p in streamed] == [(True, "load")]
    assert recorder.bodies == [] and proxy.engine.stats.requests_total == 0


async def test_errors_come_in_ollamas_shape(start_upstream, start_proxy, http):
    url, _ = await start_upstream(Script(status=500))
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with http.post(proxy.url + "/api/chat", json={"model": "llama3.2", "messages": [{"role": "user", "content": "x"}], "stream": False}) as resp:
        assert resp.status == 502 and set(await resp.json()) == {"error"}
    async with http.post(proxy.url + "/api/chat", data=b"{broken") as resp:
        assert resp.status == 400 and set(await resp.json()) == {"error"}
    async with http.post(proxy.url + "/api/chat", json={"model": "llama3.2", "messages": "hi"}) as resp:
        assert resp.status == 400 and "messages" in (await resp.json())["error"]
    async with http.post(proxy.url + "/api/chat", json={"model": 5, "messages": [{"role": "user", "content": "x"}]}) as resp:
        assert resp.status == 400 and (await resp.json()) == {"error": "model is required"}


async def test_a_body_past_the_limit_is_a_413_in_ollamas_shape(start_upstream, start_proxy, http):
    url, recorder = await start_upstream(Script())
    proxy = await start_proxy(OpenAICompatibleBackend(url), server={"max_body_bytes": 2048})
    body = {"model": "llama3.2", "messages": [{"role": "user", "content": "x" * 4096}], "stream": False}
    async with http.post(proxy.url + "/api/chat", json=body) as resp:
        assert resp.status == 413
        assert set(answer := await resp.json()) == {"error"} and "too large" in answer["error"]
    # Refused while it is read (not by aiohttp's own limit): a compressed body inflating past
    # the limit, an encoding KVStream cannot read; each keeps its status (they were 400s).
    packed = gzip.compress(json.dumps(body).encode())
    for headers, status in (({"Content-Encoding": "gzip"}, 413), ({"Content-Encoding": "br"}, 415)):
        async with http.post(proxy.url + "/api/chat", data=packed, headers=headers) as resp:
            assert resp.status == status, await resp.text()
            assert set(await resp.json()) == {"error"}
    assert not recorder.bodies


async def test_a_runtime_failing_mid_stream_ends_the_ndjson_with_an_error_line(start_upstream, start_proxy, http):
    url, _ = await start_upstream(Script(tokens=["a", "b", "c"], error_after=2))
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with http.post(proxy.url + "/api/chat", json={"model": "llama3.2", "messages": [{"role": "user", "content": "x"}]}) as resp:
        lines = [json.loads(line) for line in (await resp.text()).splitlines()]
    assert [line.get("message", {}).get("content") for line in lines[:2]] == ["a", "b"]
    assert set(lines[-1]) == {"error"}
    await wait_released(proxy)


async def test_in_front_of_ollama_its_own_api_passes_through_admitted(start_upstream, start_proxy):
    url, recorder = await start_upstream(Script(tokens=["x"] * 3), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url), scheduler={"max_batch_size": 1})
    client = ollama.AsyncClient(host=proxy.url)
    reply = await client.chat(model="llama3.2:latest", messages=[{"role": "user", "content": "hi"}], stream=False)
    assert reply.message.content == "xxx"
    assert recorder.bodies[-1]["model"] == "llama3.2:latest"  # Ollama's own body, as the client sent it
    assert [m.model for m in (await client.list()).models][:1] == ["deepseek-r1:latest"]  # Ollama's own list
    await wait_released(proxy)
    assert proxy.engine.stats.requests_finished == 1


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
async def test_the_ollama_client_gets_the_same_greedy_text_as_the_openai_route(start_proxy, llama_server):
    import openai

    proxy = await start_proxy(LlamaCppBackend(llama_server.url), scheduler={"max_batch_size": 2})
    question = [{"role": "user", "content": "What is the capital of France?"}]
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
        model = (await oa.models.list()).data[0].id
        expected = await oa.chat.completions.create(model=model, messages=question, max_tokens=16, temperature=0)
    client = ollama.AsyncClient(host=proxy.url)
    options = {"temperature": 0, "num_predict": 16}
    reply = await client.chat(model=model, messages=question, stream=False, options=options)
    assert reply.message.content == expected.choices[0].message.content
    assert reply.eval_count == expected.usage.completion_tokens and reply.prompt_eval_count == expected.usage.prompt_tokens
    streamed = [p async for p in await client.chat(model=model, messages=question, stream=True, options=options)]
    assert "".join(p.message.content for p in streamed) == expected.choices[0].message.content
    await wait_released(proxy)
    assert proxy.engine.stats.requests_finished == 3


async def test_the_ollama_client_gets_logprobs_from_llama_server(start_proxy, llama_server):
    """Ollama's logprobs/top_logprobs become OpenAI's for llama-server; its entries come
    back in the ollama client's Logprob shape, per chunk and whole."""
    proxy = await start_proxy(LlamaCppBackend(llama_server.url), scheduler={"max_batch_size": 2})
    client = ollama.AsyncClient(host=proxy.url)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    options = {"temperature": 0, "num_predict": 8}
    reply = await client.chat(model="any", messages=question, stream=False, options=options, logprobs=True, top_logprobs=2)
    assert reply.logprobs and len(reply.logprobs) == reply.eval_count
    assert "".join(e.token for e in reply.logprobs) == reply.message.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in reply.logprobs)
    assert reply.logprobs[0].logprob == pytest.approx(reply.logprobs[0].top_logprobs[0].logprob)  # greedy: the best
    parts = [p async for p in await client.chat(model="any", messages=question, stream=True, options=options, logprobs=True)]
    entries = [e for p in parts for e in p.logprobs or ()]
    assert [e.token for e in entries] == [e.token for e in reply.logprobs]
    assert all(not e.top_logprobs for e in entries)  # none asked for: none sent (llama-server adds some)
    plain = await client.chat(model="any", messages=question, stream=False, options=options)
    assert plain.logprobs is None
    await wait_released(proxy)


async def test_embed_comes_from_the_runtimes_openai_embeddings(start_proxy, aiohttp_server, http):
    from aiohttp import web

    from tests.doubles import Recorder, openai_upstream

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        return web.json_response({"object": "list", "data": [{"index": i, "embedding": [float(i), 0.5]} for i in reversed(range(len(inputs)))],
                                  "usage": {"prompt_tokens": 4, "total_tokens": 4}})

    app = openai_upstream(Script(), Recorder())
    app.router.add_post("/v1/embeddings", embeddings)
    server = await aiohttp_server(app)
    proxy = await start_proxy(OpenAICompatibleBackend(str(server.make_url("")).rstrip("/")))
    result = await ollama.AsyncClient(host=proxy.url).embed(model="all-minilm", input=["a", "b"])
    assert result.embeddings == [[0.0, 0.5], [1.0, 0.5]] and result.prompt_eval_count == 4  # in input order
    assert proxy.engine.scheduler.bm.is_idle() and proxy.engine.stats.requests_finished == 1


async def test_a_runtime_without_embeddings_says_so_through_embed_as_a_501(start_proxy, aiohttp_server):
    """llama-server started without --embeddings answers 501: the client learns that, not
    that the runtime failed."""
    from aiohttp import web

    from tests.doubles import Recorder, openai_upstream

    async def embeddings(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": 501, "message": "This server does not support embeddings. Start it with "
                                            "`--embeddings`", "type": "not_supported_error"}}, status=501)

    app = openai_upstream(Script(), Recorder())
    app.router.add_post("/v1/embeddings", embeddings)
    server = await aiohttp_server(app)
    proxy = await start_proxy(OpenAICompatibleBackend(str(server.make_url("")).rstrip("/")))
    with pytest.raises(ollama.ResponseError) as caught:
        await ollama.AsyncClient(host=proxy.url).embed(model="m", input="a")
    assert caught.value.status_code == 501 and "Start it with `--embeddings`" in caught.value.error
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.APIStatusError) as refused:  # the OpenAI route: passed through as it came
            await client.embeddings.create(model="m", input="a")
    assert refused.value.status_code == 501
    # The runtime's configuration, not its failure: counted refused (not red in `kvstream status`)
    assert (proxy.engine.stats.requests_refused, proxy.engine.stats.requests_failed) == (2, 0)


@pytest.mark.llamacpp
@pytest.mark.timeout(120)
async def test_embed_over_llama_server_truncates_and_shortens_as_ollama_does(start_proxy, http):
    """Ollama's ``truncate`` (on by default) and ``dimensions`` over a real llama-server with
    embeddings on: an input past the context is cut to it (llama-server itself fails on it,
    a 500), refused with a 400 when truncate is false; a shortened vector is renormalized.
    A short input's vector is llama-server's own."""
    from tests.conftest import launch_llama_server

    # (-ub 1024: llama-server computes a whole input in one physical batch, 512 by default)
    server = launch_llama_server(slots=2, ctx=2048, slot_saving=False, extra=["--embeddings", "--pooling", "mean", "-ub", "1024"])
    try:
        proxy = await start_proxy(LlamaCppBackend(server.url))
        client = ollama.AsyncClient(host=proxy.url)
        long = "harbour " * 3000
        async with http.post(server.url + "/v1/embeddings", json={"input": long}) as resp:
            assert resp.status == 500  # directly: too long for llama-server
        cut = await client.embed(model="m", input=["hello world", long])
        assert len(cut.embeddings) == 2 and cut.prompt_eval_count >= 1024  # the long one: the 1,024 a request may use
        with pytest.raises(ollama.ResponseError) as caught:
            await client.embed(model="m", input=long, truncate=False)
        assert caught.value.status_code == 400 and caught.value.error == "the input length exceeds the context length"
        async with http.post(server.url + "/v1/embeddings", json={"input": "hello world"}) as resp:
            own = (await resp.json())["data"][0]["embedding"]
        assert cut.embeddings[0] == pytest.approx(own, abs=1e-6)
        short = (await client.embed(model="m", input="hello world", dimensions=64)).embeddings[0]
        assert len(short) == 64 and sum(x * x for x in short) == pytest.approx(1.0)
        assert short == pytest.approx([x / sum(y * y for y in own[:64]) ** 0.5 for x in own[:64]], abs=1e-6)
        assert (await client.embeddings(model="m", prompt="hello world")).embedding == pytest.approx(own, abs=1e-6)
    finally:
        server.stop()


async def test_in_front_of_ollama_embed_is_ollamas_own(start_upstream, start_proxy, http):
    url, _ = await start_upstream(Script(), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    async with http.post(proxy.url + "/api/embed", json={"model": "llama3.2:latest", "input": "x"}) as resp:
        assert resp.status == 404  # the double serves no /api/embed: the runtime's own answer, passed through


async def test_a_client_leaving_an_ollama_stream_cancels_the_runtime_and_frees_the_slot(start_upstream, start_proxy):
    import aiohttp

    url, recorder = await start_upstream(Script(tokens=["tok"] * 50, delay_s=0.05))
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with aiohttp.ClientSession() as session:
        resp = await session.post(proxy.url + "/api/chat", json={"model": "llama3.2", "messages": [{"role": "user", "content": "hi"}]})
        assert json.loads(await resp.content.readline())["message"]["content"] == "tok"
        resp.close()  # the client hangs up mid-stream
    for _ in range(200):
        if recorder.cancelled:
            break
        await asyncio.sleep(0.02)
    assert recorder.cancelled == 1 and recorder.completed == 0
    await wait_released(proxy)
    assert proxy.engine.stats.requests_cancelled == 1


async def test_the_ollama_front_with_the_runtime_gone_is_a_503_in_ollamas_shape(start_proxy, http, unused_tcp_port_factory):
    proxy = await start_proxy(OpenAICompatibleBackend(f"http://127.0.0.1:{unused_tcp_port_factory()}", "some-model"))
    async with http.post(proxy.url + "/api/chat", json={"model": "some-model", "messages": [{"role": "user", "content": "x"}]}) as resp:
        assert resp.status == 503 and set(await resp.json()) == {"error"}
        assert resp.headers.get("Retry-After")
    async with http.get(proxy.url + "/api/tags") as resp:
        assert resp.status == 503 and set(await resp.json()) == {"error"}
    await wait_released(proxy)


async def test_ollama_front_routes_are_counted(start_upstream, start_proxy, http):
    """Issue 18, item 5: every route that computes shows in kvstream_requests_total."""
    url, _ = await start_upstream()
    proxy = await start_proxy(OpenAICompatibleBackend(url))
    async with http.post(proxy.url + "/api/chat", json={"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": False}) as resp:
        assert resp.status == 200
    async with http.post(proxy.url + "/api/generate", json={"model": "test-model", "prompt": 5}) as resp:
        assert resp.status == 400
    async with http.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    assert 'kvstream_requests_total{code="200",route="ollama_chat"} 1.0' in text
    assert 'kvstream_requests_total{code="400",route="ollama_generate"} 1.0' in text


async def test_after_ollama_reloads_its_model_the_hottest_prefixes_are_prefilled_again(start_upstream, start_proxy, http):
    """Issue 16: a load_duration of seconds means Ollama's caches are empty; KVStream then
    re-prefills the hottest system prompts (one token each, low priority), not the one the
    reloading request is computing anyway."""
    script = Script()
    url, recorder = await start_upstream(script, factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    hot, warm, cold = ("You are the billing assistant. " * 20, "You are the travel assistant. " * 20, "You are brief. " * 2)

    async def chat(system: str) -> None:
        body = {"model": "llama3.2:latest", "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}]}
        async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()

    for system in (hot, hot, hot, warm, warm, cold, cold, cold):
        await chat(system)
    sent = len(recorder.bodies)
    script.load_duration_s = [3.2]  # the next answer: Ollama had to load the model first
    await chat(warm)
    for _ in range(100):
        if proxy.engine.stats.rewarmed_prefixes == 1:
            break
        await asyncio.sleep(0.02)
    rewarms = recorder.bodies[sent + 1:]
    # Only `hot` (warm is the reloading request's own; cold is too short to be worth it).
    assert [b["messages"] for b in rewarms] == [[{"role": "system", "content": hot}]]
    assert rewarms[0]["options"]["num_predict"] == 1
    async with http.get(proxy.url + "/status") as resp:
        cache = (await resp.json())["prefix_cache"]
    assert cache["runtime_reloads"] == 1 and cache["rewarmed_prefixes"] == 1


@pytest.mark.parametrize("expires_in_s, renewed", [(30.0, True), (600.0, False)], ids=["about-to-lapse", "long-lease"])
async def test_ollama_keeps_the_model_loaded_while_traffic_flows(start_upstream, start_proxy, http, monkeypatch, expires_in_s, renewed):
    """Issue 16: Ollama unloads a model (and its prompt caches) 5 minutes after its last
    request; while traffic flows KVStream renews a lease about to lapse, and never touches a
    longer one (OLLAMA_KEEP_ALIVE on the server)."""
    from kvstream.backends import ollama as ollama_module

    monkeypatch.setattr(ollama_module, "KEEP_ALIVE_CHECK_S", 0.05)
    url, recorder = await start_upstream(Script(expires_in_s=expires_in_s), factory=ollama_double)
    proxy = await start_proxy(OllamaBackend(url))
    body = {"model": "llama3.2:latest", "messages": [{"role": "user", "content": "q"}]}
    async with http.post(proxy.v1 + "/chat/completions", json=body) as resp:
        assert resp.status == 200
    await asyncio.sleep(0.3)
    renewals = [b for b in recorder.bodies if "keep_alive" in b and "messages" not in b]
    assert bool(renewals) is renewed
    if renewed:
        assert renewals[0] == {"model": "llama3.2:latest", "keep_alive": "5m"}


@pytest.mark.llamacpp
async def test_ollama_apps_pull_through_kvstream_in_front_of_llama_server(start_proxy, llama_server):
    """llama-server keeps no model store: an app's pull of the model it serves succeeds
    (KVStream answers), deleting is a 501 that says whose the model is, and the older
    /api/embeddings route is translated like /api/embed (llama-server's own 501 without
    --embeddings)."""
    proxy = await start_proxy(LlamaCppBackend(llama_server.url))
    client = ollama.AsyncClient(host=proxy.url)
    name = (await client.list()).models[0].model
    assert (await client.pull(name)).status == "success"
    with pytest.raises(ollama.ResponseError) as caught:
        await client.delete(name)
    assert caught.value.status_code == 501 and "llamacpp backend's models are its runtime's own" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        await client.embeddings(model=name, prompt="hi")
    assert caught.value.status_code == 501 and "--embeddings" in caught.value.error


@pytest.mark.llamacpp
@pytest.mark.timeout(120)
async def test_ollama_apps_read_what_llama_server_serves_from_list_ps_and_show(start_proxy, llama_server, tmp_path):
    """What apps read of a model through the Ollama front over llama-server: its size, file
    type and parameter count (llama-server's /v1/models meta), a digest of 64 hex digits
    (Ollama's CLI prints ``digest[:12]`` in ``ollama list``/``ps`` and fails on an empty
    one), an expiry far ahead (the model stays loaded: Ollama's keep_alive -1, "Forever";
    a time past reads "Stopping..."), and the capabilities apps gate features on: tools
    where the chat template takes them (a llama-server whose template does), thinking where
    it shows <think> blocks, vision never for this text-only model."""
    from datetime import datetime, timedelta, timezone

    from tests.conftest import launch_llama_server

    client = ollama.AsyncClient(host=(await start_proxy(LlamaCppBackend(llama_server.url))).url)
    listed, running = (await client.list()).models, (await client.ps()).models
    assert len(listed) == len(running) == 1
    model, loaded = listed[0], running[0]
    assert model.model == loaded.model and model.digest == loaded.digest and re.fullmatch(r"[0-9a-f]{64}", model.digest)
    assert model.size == loaded.size and 50 * 2**20 < model.size < 200 * 2**20  # the 135M model's Q4_1 file
    assert (model.details.format, model.details.quantization_level, model.details.parameter_size) == ("gguf", "Q4_1", "135M")
    assert model.details.family == "llama" and model.details.families == ["llama"]  # the GGUF's own header
    assert loaded.expires_at > datetime.now(timezone.utc) + timedelta(days=365 * 20)
    assert loaded.context_length == 2048  # loaded: -c 4096 over 2 slots (trained: 8192, in show)
    shown = await client.show(model.model)
    assert shown.capabilities == ["completion"]  # SmolLM2's template shows no tools
    assert shown.details.quantization_level == "Q4_1"
    assert shown.modelinfo == {  # as Ollama names them, read from the GGUF's header
        "general.architecture": "llama", "llama.context_length": 8192, "general.basename": "smollm2",
        "general.name": "Smollm2 135M 8k Lc100K Mix1 Ep2", "general.size_label": "135M", "general.finetune": "8k-lc100k-mix1-ep2"}

    # Templates that take tools, and that show the model <think> blocks (Qwen3's way): apps
    # then offer tools, and their thinking switch.
    templates = {
        "tools": "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
                 "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "thinking": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if not enable_thinking %}<think>\n\n</think>\n\n"
                    "{% endif %}{% endif %}",
    }
    for capability, text in templates.items():
        template = tmp_path / f"{capability}.jinja"
        template.write_text(text)
        server = launch_llama_server(slots=1, ctx=1024, slot_saving=False, extra=["--jinja", "--chat-template-file", str(template)])
        try:
            client = ollama.AsyncClient(host=(await start_proxy(LlamaCppBackend(server.url))).url)
            assert (await client.show(model.model)).capabilities == ["completion", capability]
        finally:
            server.stop()


@pytest.mark.llamacpp
@pytest.mark.timeout(60)
async def test_images_for_a_llama_server_without_vision_are_a_400(start_proxy, llama_server, http):
    """llama-server without a projector answers images with a 500; its /props say it has no
    vision, so the Ollama front refuses them as the client's mistake, saying why."""
    proxy = await start_proxy(LlamaCppBackend(llama_server.url))
    client = ollama.AsyncClient(host=proxy.url)
    image = "iVBORw0KGgo="
    for call in (client.chat(model="m", messages=[{"role": "user", "content": "What is it?", "images": [image]}]),
                 client.generate(model="m", prompt="What is it?", images=[image])):
        with pytest.raises(ollama.ResponseError) as caught:
            await call
        assert caught.value.status_code == 400 and "does not support image input" in caught.value.error
    assert proxy.engine.stats.requests_failed == 0


@pytest.mark.llamacpp
@pytest.mark.timeout(120)
async def test_a_generate_context_continues_the_conversation_as_ollama_builds_it(start_proxy, llama_server, http):
    """/api/generate's ``context`` (Ollama's deprecated conversation memory, still sent by
    apps written for it): an answer carries its prompt's and its own tokens, and a request
    that sends them back is that context followed by its own templated turn, as Ollama builds
    it (it detokenizes the context and prepends the text): the same greedy answer as that
    prompt sent raw, and the whole of it counted. Raw answers carry none, as in Ollama."""
    proxy = await start_proxy(LlamaCppBackend(llama_server.url))
    client = ollama.AsyncClient(host=proxy.url)
    options = {"temperature": 0, "num_predict": 12}
    first = await client.generate(model="m", prompt="My name is Ada and I live in Lyon.", options=options)

    async def direct(path: str, body: dict) -> dict:
        async with http.post(llama_server.url + path, json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    templated = (await direct("/apply-template", {"messages": [{"role": "user", "content": "My name is Ada and I live in Lyon."}]}))["prompt"]
    assert first.prompt_eval_count > 10 and len(first.context) >= first.prompt_eval_count + 1
    assert (await direct("/detokenize", {"tokens": first.context}))["content"] == templated + first.response

    turn = (await direct("/apply-template", {"messages": [{"role": "user", "content": "What is my name?"}]}))["prompt"]
    tokens = (await direct("/tokenize", {"content": turn, "add_special": True, "parse_special": True}))["tokens"]
    second = await client.generate(model="m", prompt="What is my name?", context=first.context, options=options)
    assert second.prompt_eval_count == len(first.context) + len(tokens)
    raw = await client.generate(model="m", prompt=templated + first.response + turn, raw=True, options=options)
    assert second.response == raw.response and raw.context is None
    streamed = [part async for part in await client.generate(model="m", prompt="What is my name?", context=first.context,
                                                               options=options, stream=True)]
    assert "".join(p.response for p in streamed) == second.response and streamed[-1].context == second.context
    assert second.context[:len(first.context)] == first.context

    # The runtime failing to tokenize the answer: the answer still comes, its context empty
    # (the next request then starts afresh), never an error after the text was served.
    from kvstream.types import BackendError

    async def failing(text: str) -> list[int]:
        raise BackendError("runtime error (HTTP 500): tokenizer gone")

    backend = proxy.engine.backend
    backend.plain_text_ids = failing
    try:
        gone = await client.generate(model="m", prompt="What is my name?", context=first.context, options=options)
    finally:
        del backend.plain_text_ids
    assert gone.response == second.response and gone.context == []

    for body, error in [({"context": ["a"]}, "context must be an array of token ids"),
                        ({"context": [1, 2], "raw": True}, "raw mode does not support template, system, or context"),
                        ({"context": [10**9]}, "invalid tokens"),
                        ({"context": [1, 2], "images": ["aGk="]}, "images cannot follow a context here")]:
        async with http.post(proxy.url + "/api/generate", json={"model": "m", "prompt": "hi", "stream": False} | body) as resp:
            assert resp.status == 400 and error in (await resp.json())["error"], body
    await wait_released(proxy)


@pytest.mark.llamacpp
@pytest.mark.timeout(120)
async def test_a_generate_template_of_the_requests_own_is_rendered_as_ollama_renders_it(start_proxy, llama_server, http):
    """/api/generate's ``template`` (a Go template replacing the model's for one request):
    rendered over .System and .Prompt, cut where .Response stands, and sent as it is: the
    same greedy answer and count as that text sent raw, with a context to continue from (a
    templated answer carries one in Ollama). One KVStream cannot read is a 400 naming it,
    not ignored (the model's own template silently used instead)."""
    proxy = await start_proxy(LlamaCppBackend(llama_server.url))
    client = ollama.AsyncClient(host=proxy.url)
    options = {"temperature": 0, "num_predict": 8}
    template = ("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}<|im_start|>user\n{{ .Prompt }}"
                "<|im_end|>\n<|im_start|>assistant\n{{ .Response }}<|im_end|>\n")
    own = await client.generate(model="m", prompt="Name a fruit.", system="Answer in French.", template=template, options=options)
    text = "<|im_start|>system\nAnswer in French.<|im_end|>\n<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n"
    async with http.post(llama_server.url + "/tokenize", json={"content": text, "add_special": True, "parse_special": True}) as resp:
        tokens = (await resp.json())["tokens"]
    # (the prompt's tokens compared, not the answers: llama.cpp's greedy answer to the same
    # tokens may differ with what its slot held, its batches then computed otherwise)
    assert own.prompt_eval_count == len(tokens) and own.context[:len(tokens)] == tokens
    assert len(own.context) > len(tokens) and own.response
    raw = await client.generate(model="m", prompt=text, raw=True, options=options)
    assert raw.prompt_eval_count == len(tokens) and raw.context is None
    bare = await client.generate(model="m", prompt="Name a fruit.", template="{{ .Prompt }}", options=options)
    assert bare.prompt_eval_count < 8  # the prompt alone, not the model's chat template around it
    for body, error in [({"template": "{{ range .Messages }}{{ .Content }}{{ end }}"}, "'{{ range .Messages }}' in 'template'"),
                        ({"template": ["x"]}, "template must be a string"),
                        ({"template": "{{ .Prompt }}", "raw": True}, "raw mode does not support template"),
                        ({"template": "{{ .Prompt }}", "suffix": "}"}, "a suffix cannot go with a template")]:
        async with http.post(proxy.url + "/api/generate", json={"model": "m", "prompt": "hi", "stream": False} | body) as resp:
            assert resp.status == 400 and error in (await resp.json())["error"], body


async def test_a_generate_context_needs_a_backend_that_tokenizes(front):
    """In front of a runtime whose tokens KVStream cannot get, a context cannot be continued:
    a 400 that says what to do instead (not ignored, the conversation silently forgotten),
    and an answer's context is empty."""
    _, _, _, client = front
    assert (await client.generate(model="llama3.2", prompt="hi")).context == []
    with pytest.raises(ollama.ResponseError) as caught:
        await client.generate(model="llama3.2", prompt="hi", context=[1, 2, 3])
    assert caught.value.status_code == 400 and "send the conversation as messages to /api/chat" in caught.value.error
