"""End to end through KVStream against the real llama-server running the real SmolLM2 model,
driven by the official openai client, compared with calling llama-server directly."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import openai
import pytest

from kvstream.backends import GenerateRequest, LlamaCppBackend

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(300)]

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colors.",
    "What is 2 + 2?",
]


def clients(proxy, llama_server) -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
    return (
        openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0),
        openai.AsyncOpenAI(base_url=llama_server.url + "/v1", api_key="unused", max_retries=0),
    )


@pytest.fixture
async def proxy(start_proxy, llama_server):
    return await start_proxy(LlamaCppBackend(llama_server.url), scheduler={"max_batch_size": 2})


async def model_id(c: openai.AsyncOpenAI) -> str:
    return (await c.models.list()).data[0].id


async def test_chat_greedy_output_and_usage_equal_direct(proxy, llama_server):
    via, direct = clients(proxy, llama_server)
    model = await model_id(via)
    assert model == await model_id(direct)
    for question in QUESTIONS:
        kwargs = dict(model=model, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0)
        # Cold in both runs: llama-server's cache can make a revisit differ (documented).
        await direct.chat.completions.create(**kwargs)
        a = await direct.chat.completions.create(**kwargs)
        b = await via.chat.completions.create(**kwargs)
        assert b.choices[0].message.content == a.choices[0].message.content, question
        assert b.choices[0].finish_reason == a.choices[0].finish_reason
        assert (b.usage.prompt_tokens, b.usage.completion_tokens) == (a.usage.prompt_tokens, a.usage.completion_tokens)
    assert proxy.engine.scheduler.bm.is_idle()


async def test_streaming_equals_non_streaming_and_completions_work(proxy, llama_server):
    via, direct = clients(proxy, llama_server)
    model = await model_id(via)
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=16, temperature=0)
    whole = await via.chat.completions.create(**kwargs)
    stream = await via.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens and finish == whole.choices[0].finish_reason
    a = await direct.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    b = await via.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert b.choices[0].text == a.choices[0].text
    assert b.usage.prompt_tokens == a.usage.prompt_tokens
    # max_tokens reached: "length", as the runtime says.
    assert b.choices[0].finish_reason == "length"


async def test_a_batch_of_prompts_streams_every_prompt_as_directly(proxy, llama_server):
    """OpenAI's completions take a list of prompts; llama-server streams their generations
    interleaved, with a `data: null` line between them. KVStream read that line as the
    stream's end ([DONE] decodes to None too), so the client got the first prompt's text
    and never the second's; and it pinned the batch to one slot, where the prompts ran one
    after another instead of side by side."""
    via, direct = clients(proxy, llama_server)
    model = await model_id(via)
    prompts = ["Once upon a time", "The sky is", "My favourite fruit is"]

    async def texts(client: openai.AsyncOpenAI) -> dict[int, tuple[str, str | None]]:
        out: dict[int, list] = {}
        stream = await client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, stream=True)
        async for chunk in stream:
            if chunk is None:  # (the openai client hands llama-server's `data: null` on as None)
                continue
            for choice in chunk.choices:
                text, finish = out.get(choice.index, ("", None))
                out[choice.index] = (text + choice.text, choice.finish_reason or finish)
        return out

    through = await texts(via)
    assert sorted(through) == [0, 1, 2] and all(finish == "length" and text for text, finish in through.values())
    assert through == await texts(direct)
    # Token ids as the prompt are counted as they are (they were the text of the list).
    from kvstream.api.schemas import forwarded_request

    request = forwarded_request({"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 1}, False, "req-ids")
    assert await proxy.engine.prompt_tokens(request) == ([1, 2, 3, 4], True)
    single = forwarded_request({"model": model, "prompt": [5], "max_tokens": 1}, False, "req-id")
    assert await proxy.engine.prompt_tokens(single) == ([5], True)
    # A batch of one prompt (LangChain's way) is that prompt's tokens, not its list's text.
    one = forwarded_request({"model": model, "prompt": ["The sky is"], "max_tokens": 1}, False, "req-one")
    plain = forwarded_request({"model": model, "prompt": "The sky is", "max_tokens": 1}, False, "req-plain")
    assert await proxy.engine.prompt_tokens(one) == await proxy.engine.prompt_tokens(plain)
    out = await via.completions.create(model=model, prompt=[1, 2, 3, 4], max_tokens=1)
    assert out.usage.prompt_tokens == 4
    assert proxy.engine.scheduler.bm.is_idle()


async def test_prompt_token_count_is_exact(proxy, llama_server):
    backend = proxy.engine.backend
    via, _ = clients(proxy, llama_server)
    model = await model_id(via)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there, how are you?"}]
    tokens = await backend.tokenize(GenerateRequest(model=model, messages=messages))
    out = await via.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert len(tokens) == out.usage.prompt_tokens
    # A completions prompt: llama-server reads special tokens' spellings in it as those
    # tokens (a prompt written in the chat markup, Ollama's raw mode).
    for prompt in ["Once upon a time", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]:
        tokens = await backend.tokenize(GenerateRequest(model=model, prompt=prompt))
        out = await via.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        assert len(tokens) == out.usage.prompt_tokens, prompt


async def test_pool_is_sized_from_the_runtime(proxy, http):
    async with http.get(proxy.url + "/ready") as resp:
        assert resp.status == 200
    status = proxy.engine.snapshot()
    # llama-server -np 2 -c 4096: two slots of 2048 tokens.
    assert status["model_context"] == 2048
    assert status["kv"]["blocks_total"] * status["kv"]["block_size"] == 4096
    assert status["queue"]["max_batch_size"] == 2


async def test_64_concurrent_streams_never_exceed_two_in_flight(proxy, llama_server):
    """Admission control: 64 clients, max_batch_size 2: everything completes, llama-server
    never queues a request itself (requests_deferred stays 0), the pool ends all-free."""
    via, _ = clients(proxy, llama_server)
    model = await model_id(via)
    system = "You are a helpful assistant. Answer in one short sentence. " * 4  # a shared prefix
    observed = {"deferred": 0.0, "processing": 0.0, "running": 0}
    done = asyncio.Event()

    async def watch():
        async with aiohttp.ClientSession() as session:
            while not done.is_set():
                async with session.get(llama_server.url + "/metrics") as resp:
                    text = await resp.text()
                for name in ("deferred", "processing"):
                    match = re.search(rf"^llamacpp:requests_{name} (\S+)$", text, re.M)
                    observed[name] = max(observed[name], float(match.group(1)))
                observed["running"] = max(observed["running"], len(proxy.engine.scheduler.running))
                await asyncio.sleep(0.05)

    async def one(i: int) -> str:
        stream = await via.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Say the number {i}."}],
            max_tokens=8, temperature=0, stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(one(i) for i in range(64)))
    done.set()
    await watcher
    assert len(results) == 64 and all(results)
    assert observed["deferred"] == 0 and observed["processing"] <= 2 and observed["running"] <= 2
    assert proxy.engine.scheduler.bm.is_idle()
    assert proxy.engine.stats.requests_finished == 64
    # The shared system prompt was counted once: later requests hit its cached blocks.
    assert proxy.engine.stats.prefix_hit_tokens > 0


async def test_client_disconnect_stops_the_runtime(proxy, llama_server):
    via, _ = clients(proxy, llama_server)
    model = await model_id(via)
    async with aiohttp.ClientSession() as session:
        body = {"model": model, "messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 1500, "stream": True}
        async with session.post(proxy.v1 + "/chat/completions", json=body) as resp:
            for _ in range(4):
                await resp.content.readline()
    for _ in range(100):
        async with aiohttp.ClientSession() as session:
            async with session.get(llama_server.url + "/slots") as resp:
                slots = await resp.json()
        if not any(s["is_processing"] for s in slots) and proxy.engine.scheduler.bm.is_idle():
            break
        await asyncio.sleep(0.1)
    assert not any(s["is_processing"] for s in slots), "llama-server kept generating for a client that left"
    assert proxy.engine.scheduler.bm.is_idle()


async def test_a_conversation_extended_turn_by_turn_is_tokenized_exactly_from_its_known_prefix(proxy, llama_server):
    backend = proxy.engine.backend
    await proxy.engine.start()
    system = {"role": "system", "content": "You are the archivist of a seaside museum. " * 30}
    history = [system, {"role": "user", "content": "When do you open?"}]

    async def full_tokens(messages):  # what llama-server itself makes of the whole prompt
        text = (await backend.http.post_json("/apply-template", {"messages": messages}))["prompt"]
        return (await backend.http.post_json("/tokenize", {"content": text, "add_special": True, "parse_special": True}))["tokens"]

    for turn in range(4):
        tokens = await backend.tokenize(GenerateRequest(model=None, messages=history))
        assert tokens == await full_tokens(history), f"turn {turn}"
        await asyncio.gather(*backend._background)  # the prefix is learned off the request path
        history = history + [{"role": "assistant", "content": f"Answer {turn}: at nine, café ☕ open."},
                             {"role": "user", "content": f"And question {turn + 1}?"}]
    # From the second turn on, the earlier messages came from the cache.
    assert backend.conversations.hits >= 1 and backend.conversations.mismatches == 0


async def test_a_backend_url_given_as_the_runtimes_v1_base_works_as_its_root(start_proxy, llama_server):
    """Users paste the base URL a runtime gives its OpenAI clients (``http://host:port/v1``):
    KVStream adds ``/v1/...`` itself, and llama-server's own routes live at the root."""
    proxy = await start_proxy(LlamaCppBackend(llama_server.url + "/v1/"))
    assert proxy.engine.backend.base_url == llama_server.url
    via = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    out = await via.chat.completions.create(model=await model_id(via), messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert out.choices[0].message.content
    async with aiohttp.ClientSession() as http, http.get(proxy.url + "/props") as resp:
        assert resp.status == 200 and (await resp.json())["total_slots"] >= 1  # a passed-through native route


async def test_a_request_past_the_context_is_answered_as_llama_server_answers_it(proxy, llama_server):
    """llama-server takes a max_tokens past its context (it stops at the context's end; many
    clients send 4096 or more by default) and refuses a prompt past it with its own 400.
    Through KVStream the same answers: before, KVStream refused both with a 400 of its own."""
    via, direct = clients(proxy, llama_server)
    model = await model_id(via)
    kwargs = dict(model=model, messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=100_000, temperature=0)
    a = await direct.chat.completions.create(**kwargs)
    b = await via.chat.completions.create(**kwargs)
    assert b.choices[0].message.content == a.choices[0].message.content and b.choices[0].finish_reason == "stop"
    refused = []
    for c in (direct, via):
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * 10_000}])
        refused.append(err.value.body)
    assert refused[0] == refused[1] and "exceeds the available context size" in refused[0]["message"]
    assert proxy.engine.scheduler.bm.is_idle()
    # Said where an operator looks: /status (and the log, and kvstream_prompts_past_context_total);
    # the runtime's refusal of the client's request counted as such, not as a failure.
    async with aiohttp.ClientSession() as http, http.get(proxy.url + "/status") as resp:
        requests = (await resp.json())["requests"]
    assert requests["prompts_past_context"] == 1 and (requests["refused"], requests["failed"]) == (1, 0)


async def test_a_web_page_reads_the_answers_through_kvstream_as_it_does_directly(proxy, llama_server):
    """A browser app served from another origin (a chat UI on localhost:5173) can read
    llama-server's answers because llama-server grants the page's origin on every answer. The
    answers KVStream rebuilds carried no grant: the browser refused them all. Now each carries
    the one llama-server gave (its own 400 too); without an Origin nothing is added."""
    page = {"Origin": "http://localhost:5173"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    asks = [("/v1/chat/completions", chat), ("/v1/chat/completions", dict(chat, stream=True)),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/completion", {"prompt": "hi", "n_predict": 2}),
            ("/v1/chat/completions", {"messages": "not a list"})]
    async with aiohttp.ClientSession() as http:
        for path, body in asks:
            grants = []
            for base in (llama_server.url, proxy.url):
                async with http.post(base + path, json=body, headers=page) as resp:
                    await resp.read()
                    grants.append((resp.status, resp.headers.get("Access-Control-Allow-Origin")))
            assert grants[0] == grants[1] and grants[0][1] == page["Origin"], (path, grants)
        # Ollama's API, which KVStream answers over llama-server's.
        async with http.post(proxy.url + "/api/chat", json={"messages": chat["messages"], "stream": False}, headers=page) as resp:
            assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == page["Origin"]
        async with http.post(proxy.url + "/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200 and "Access-Control-Allow-Origin" not in resp.headers
    assert proxy.engine.scheduler.bm.is_idle()


async def test_a_runtime_that_comes_up_after_kvstream_or_restarts_is_sized_when_it_answers(start_proxy):
    """Started together (a compose file, a boot), KVStream may come up first, or while
    llama-server still loads its model. It was sized at the first /ready only: until then 8
    requests in flight against a 3-slot runtime, hard inject off, and /status not ready while
    requests were served. Now it probes until the runtime answers, and sizes it again when it
    comes back from a restart."""
    import socket

    from tests.conftest import launch_llama_server

    held = socket.socket()  # the runtime's port, held until KVStream listens (it cannot draw it then)
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    proxy = await start_proxy(LlamaCppBackend(f"http://127.0.0.1:{port}"), routing={"health_interval_s": 0.2})
    held.close()
    default = proxy.engine.scheduler.config.max_batch_size
    assert not proxy.engine.ready and default != 3

    async def sized_to(slots: int) -> None:
        for _ in range(100):  # probed every 2 s until sized
            if proxy.engine.scheduler.config.max_batch_size == slots:
                break
            await asyncio.sleep(0.1)
        assert proxy.engine.scheduler.config.max_batch_size == slots and proxy.engine.ready

    server = await asyncio.to_thread(launch_llama_server, 3, 4096, None, None, port)
    try:
        await sized_to(3)
        assert proxy.engine.backend.inject is not None and proxy.engine.limits.n_ctx_per_request  # its slots read
        async with aiohttp.ClientSession() as http, http.get(proxy.url + "/status") as resp:
            assert (await resp.json())["backend"]["ready"] is True
        via = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
        out = await via.chat.completions.create(model=await model_id(via), messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert out.choices[0].message.content
        # Restarted with other slots: sized again when it comes back (and its slot table too).
        server.stop()
        server = await asyncio.to_thread(launch_llama_server, 2, 4096, None, None, port)
        await sized_to(2)
        assert len(proxy.engine.backend.inject.table.slots) == 2
        out = await via.chat.completions.create(model=await model_id(via), messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert out.choices[0].message.content
    finally:
        server.stop()


async def test_limits_that_failed_to_be_read_at_first_contact_are_read_again(start_proxy, llama_server, monkeypatch, caplog):
    """A read of llama-server's /props that fails at first contact (a timeout, a 503 while
    it is busy) sized KVStream with the defaults until the runtime next went down: 8 in
    flight against its 2 slots, hard inject off. Now it is read again at the next probes,
    said once in the log."""
    from kvstream.types import BackendError

    backend = LlamaCppBackend(llama_server.url)
    real, failures = backend.fetch_props, [BackendError("runtime error (HTTP 503): busy")] * 3

    async def flaky() -> dict:
        if failures:
            raise failures.pop()
        return await real()

    monkeypatch.setattr(backend, "fetch_props", flaky)
    proxy = await start_proxy(backend)
    assert proxy.engine.scheduler.config.max_batch_size != 2
    for _ in range(150):  # probed every 2 s until read
        if proxy.engine.scheduler.config.max_batch_size == 2:
            break
        await asyncio.sleep(0.1)
    assert proxy.engine.scheduler.config.max_batch_size == 2 and not failures
    assert backend.inject is not None and proxy.engine.limits.n_ctx_per_request == 2048
    assert caplog.text.count("could not read the runtime's limits (read again at the next probe)") == 1


async def test_a_restart_between_two_health_probes_is_sized_again(start_proxy):
    """llama-server restarted with fewer slots faster than the health probe looks (here it
    never looks): the first request after it sees it in /slots (its slots hold less than
    KVStream left there). Before,
    that reset the slot beliefs only, and KVStream kept 3 requests in flight against 2 slots
    (llama-server's own queue taking the third) until the runtime next went down for longer
    than a probe interval. Now the engine reads the limits again at once (and until then
    leaves requests to llama-server's own slot choice: a slot id may not exist)."""
    from tests.conftest import launch_llama_server

    server = await asyncio.to_thread(launch_llama_server, 3, 4096)
    port = int(server.url.rsplit(":", 1)[1])
    proxy = await start_proxy(LlamaCppBackend(server.url), routing={"health_interval_s": 3600})
    try:
        assert proxy.engine.scheduler.config.max_batch_size == 3
        via = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
        model = await model_id(via)
        await via.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        server.stop()
        server = await asyncio.to_thread(launch_llama_server, 2, 4096, None, None, port)
        out = await via.chat.completions.create(model=model, messages=[{"role": "user", "content": "bye"}], max_tokens=2)
        assert out.choices[0].message.content
        for _ in range(100):
            if proxy.engine.scheduler.config.max_batch_size == 2:
                break
            await asyncio.sleep(0.1)
        assert proxy.engine.scheduler.config.max_batch_size == 2 and len(proxy.engine.backend.inject.table.slots) == 2
        assert proxy.engine.stats.runtime_reloads == 1
        out = await via.chat.completions.create(model=model, messages=[{"role": "user", "content": "again"}], max_tokens=2)
        assert out.choices[0].message.content
    finally:
        server.stop()


async def test_a_runtime_behind_its_own_api_key(start_proxy, caplog):
    """llama-server started with --api-key: each client's key goes through with its request,
    but KVStream's own reads (/props, /slots, /tokenize) need the key too. Without it the log
    says which setting gives it (the warning said only "refused KVStream's credentials");
    with it the runtime is sized from its slots and prompts are counted exactly."""
    import logging

    from tests.conftest import launch_llama_server

    server = await asyncio.to_thread(launch_llama_server, 3, 4096, None, ["--api-key", "runtime-key"])
    try:
        with caplog.at_level(logging.WARNING, logger="kvstream.engine.core"):
            blind = await start_proxy(LlamaCppBackend(server.url))
        assert "set backend.api_key (KVSTREAM_BACKEND__API_KEY)" in caplog.text
        client = openai.AsyncOpenAI(base_url=blind.v1, api_key="runtime-key", max_retries=0)
        out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert out.choices[0].message.content  # the client's key went with its request
        keyed = await start_proxy(LlamaCppBackend(server.url, api_key="runtime-key"))
        assert keyed.engine.scheduler.config.max_batch_size == 3
        client = openai.AsyncOpenAI(base_url=keyed.v1, api_key="unused", max_retries=0)
        out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert out.choices[0].message.content and keyed.engine.stats.prompts_exact == 1
    finally:
        server.stop()
