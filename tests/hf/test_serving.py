"""The hf backend behind the proxy, driven by the official openai client."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import require_import

torch = require_import("torch")

import openai  # noqa: E402
from openai import AsyncOpenAI, BadRequestError  # noqa: E402

from kvstream.hf import HFBackend  # noqa: E402
from kvstream.hf.loader import LoadedModel  # noqa: E402


async def wait_idle(proxy) -> None:
    engine = proxy.engine.backend.runner
    for _ in range(500):
        if engine.is_idle():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.scheduler.running} {engine.scheduler.waiting}")


async def test_sixteen_concurrent_streams_complete_and_release_everything(hf_proxy, oa):

    async def one(i: int) -> tuple[str, str]:
        stream = await oa.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"Write a sentence about the number {i}."}],
            max_tokens=12 + i,
            stream=True,
            temperature=0,
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    results = await asyncio.gather(*(one(i) for i in range(16)))
    assert all(text and finish in ("stop", "length") for text, finish in results)
    await wait_idle(hf_proxy)
    async with aiohttp.ClientSession() as http:
        status = await (await http.get(hf_proxy.url + "/status")).json()
    assert status["kv"]["estimated"] is False and status["kv"]["blocks_total"] == 256
    assert status["kv"]["blocks_used"] == 0 and status["queue"]["running"] == 0
    assert status["requests"]["finished"] == 16
    async with aiohttp.ClientSession() as http:
        metrics = await (await http.get(hf_proxy.url + "/metrics")).text()
    assert "kvstream_kv_estimated 0.0" in metrics
    assert 'kvstream_kv_blocks{state="free",tier="gpu"} 256.0' in metrics
    decode = next(line for line in metrics.splitlines() if line.startswith('kvstream_engine_forward_tokens_total{kind="decode"}'))
    assert float(decode.split()[-1]) > 16


async def test_greedy_through_the_proxy_equals_the_engine_alone(oa, smollm2):
    from kvstream.hf.model_runner import RunnerConfig, ModelRunner
    from kvstream.hf.sampling import SamplingParams

    messages = [{"role": "user", "content": "Name a planet."}]
    reply = await oa.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
    tokenizer = smollm2[2]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    alone = ModelRunner(smollm2[0], tokenizer, RunnerConfig(block_size=16, num_blocks=64, num_cpu_blocks=0))
    [out] = alone.generate_sync([list(ids)], SamplingParams(max_tokens=16, temperature=0))
    assert reply.choices[0].message.content == tokenizer.decode(out, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(ids)


async def test_seeded_sampling_is_reproducible(oa):

    async def draw(seed: int) -> str:
        r = await oa.completions.create(model="smollm2", prompt="My favourite animal is", max_tokens=12, temperature=1.0, seed=seed)
        return r.choices[0].text

    a, b, c = await asyncio.gather(draw(7), draw(7), draw(8))
    assert a == b and a != c


async def test_stop_string_ends_the_generation_before_it(oa):
    r = await oa.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=["7"])
    assert r.choices[0].finish_reason == "stop"
    assert "7" not in r.choices[0].text and "6" in r.choices[0].text


async def test_a_prompt_longer_than_the_pool_is_rejected_at_once(hf_proxy, oa):
    with pytest.raises(BadRequestError) as err:
        await oa.completions.create(model="smollm2", prompt="word " * 5000, max_tokens=4)
    assert err.value.status_code == 400 and err.value.code == "context_length_exceeded"
    await wait_idle(hf_proxy)


async def test_a_large_prompt_is_templated_and_tokenized_off_the_event_loop(hf_proxy, oa, monkeypatch):
    """A few MB of messages take seconds to template and tokenize (benchmarks/loop_stall.py:
    3 s of every stream paused per 3.5 MB request when it ran on the event loop): the work
    runs on a worker thread while another client's stream goes on, and the answer is still
    the exact count's 400. That thread is the large requests' own, at a lower CPU priority than
    the engine's (low_priority.py; on Linux, where a thread has a priority of its own)."""
    import os
    import sys
    import threading

    import kvstream.hf.loader as loader

    on_loop, threads = [], set()

    def where(call):
        def recorded(*args, **kwargs):
            if len(repr(args)) > 100_000:  # the large prompt's (small probes run where they like)
                try:
                    asyncio.get_running_loop()
                    on_loop.append(True)
                except RuntimeError:
                    on_loop.append(False)
                    threads.add((threading.current_thread().name.split("_")[0],
                                 os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
            return call(*args, **kwargs)
        return recorded

    tokenizer = hf_proxy.engine.backend.runner.tokenizer
    monkeypatch.setattr(loader, "chat_token_ids", where(loader.chat_token_ids))
    monkeypatch.setattr(type(tokenizer), "__call__", where(type(tokenizer).__call__))
    victim = asyncio.ensure_future(oa.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=24, temperature=0,
        stream=True))
    text = "The keeper climbed the stairs at dusk and lit the lamp. " * 9000  # 500 KB, ~90,000 tokens
    for call in (lambda: oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": text}],
                                                    max_tokens=4),
                 lambda: oa.completions.create(model="smollm2", prompt=text, max_tokens=4)):
        with pytest.raises(BadRequestError) as err:
            await call()
        assert err.value.code == "context_length_exceeded" and "prompt" in err.value.message
    chunks = [chunk async for chunk in await victim]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert on_loop and not any(on_loop), on_loop
    lowered = os.getpriority(os.PRIO_PROCESS, 0) + 10 if sys.platform.startswith("linux") else os.getpriority(os.PRIO_PROCESS, 0)
    assert threads == {("kvstream-large", min(19, lowered))}, threads
    await wait_idle(hf_proxy)


async def test_tools_past_the_context_are_refused_before_their_schema_is_read(hf_proxy, oa, monkeypatch):
    """Reading hundreds of tools' schema into the constraint machine is a second of pure
    Python beside every stream (benchmarks/loop_stall.py): for a prompt the context cannot
    hold it is not done, and the answer is the context's 400; tools that fit are read, once."""
    from kvstream.hf import HFBackend

    built = []
    for name in ("_sampling_params", "_call_hold"):
        def recorded(self, request, *args, _call=getattr(HFBackend, name), _name=name):
            built.append((_name, len(request.extra["tools"])))
            return _call(self, request, *args)
        monkeypatch.setattr(HFBackend, name, recorded)

    def tools(count: int) -> list[dict]:
        return [{"type": "function", "function": {
            "name": f"lookup_{t}", "description": "Looks something up in the archive. " * 3,
            "parameters": {"type": "object", "properties": {f"arg_{p}": {"type": "string"} for p in range(6)}}}}
            for t in range(count)]

    question = [{"role": "user", "content": "Which tool fits?"}]
    with pytest.raises(BadRequestError) as err:
        await oa.chat.completions.create(model="smollm2", messages=question, tools=tools(100), max_tokens=4)
    assert err.value.code == "context_length_exceeded"
    assert built == []
    reply = await oa.chat.completions.create(model="smollm2", messages=question, tools=tools(3), max_tokens=4)
    assert reply.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert {count for _, count in built} == {3} and ("_sampling_params", 3) in built
    await wait_idle(hf_proxy)


async def test_a_client_that_leaves_while_its_prompt_is_tokenized_queues_nothing(hf_proxy, oa, monkeypatch):
    """The prompt is templated and tokenized on a worker thread, which cannot be stopped: a
    client that leaves meanwhile cancels its handler, the thread's ids are dropped when it
    ends, and nothing is queued or computed for it; the next request is served."""
    import threading

    import kvstream.hf.loader as loader

    entered, release = threading.Event(), threading.Event()
    original = loader.chat_token_ids

    def held(tokenizer, messages, *args, **kwargs):
        if "LEAVING" in str(messages):  # the leaving client's prompt: held until it has gone
            entered.set()
            release.wait(10)
        return original(tokenizer, messages, *args, **kwargs)

    monkeypatch.setattr(loader, "chat_token_ids", held)
    runner = hf_proxy.engine.backend.runner
    before = runner.counters.prefill_tokens
    leaving = asyncio.ensure_future(oa.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "LEAVING " * 50}], max_tokens=8))
    assert await asyncio.to_thread(entered.wait, 10)
    leaving.cancel()  # the client closes its connection mid-request
    with pytest.raises(asyncio.CancelledError):
        await leaving
    await asyncio.sleep(0.2)  # the server sees the connection gone and cancels the handler
    release.set()
    for _ in range(50):  # the thread ends; its ids must go nowhere
        await asyncio.sleep(0.02)
        assert not runner.scheduler.waiting and not runner.scheduler.running
    assert runner.counters.prefill_tokens == before
    reply = await oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    await wait_idle(hf_proxy)


async def test_client_disconnect_aborts_and_frees_the_blocks(hf_proxy):
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            hf_proxy.v1 + "/completions",
            json={"model": "smollm2", "prompt": "1, 2, 3, 4,", "max_tokens": 400, "stream": True, "temperature": 0},
        )
        await resp.content.readline()  # the first chunk: generating
        resp.close()
    await wait_idle(hf_proxy)
    assert hf_proxy.engine.backend.runner.counters.decode_tokens < 400
    for _ in range(200):
        if hf_proxy.engine.stats.requests_cancelled == 1:
            break
        await asyncio.sleep(0.01)
    assert hf_proxy.engine.stats.requests_cancelled == 1


async def test_auto_falls_back_to_the_in_process_engine_when_nothing_answers(monkeypatch):
    """`kvstream serve` on a machine with no runtime and no llama-server build."""
    from kvstream.cli import serve as serve_cli
    from tests.conftest import make_settings

    async def nothing(*args, **kwargs):
        return None

    monkeypatch.setattr(serve_cli, "probe_runtimes", nothing)
    monkeypatch.setattr(serve_cli, "find_binary", lambda: None)
    settings = make_settings(scheduler={"max_batch_size": 5, "preemption_policy": "recompute"})
    backend = await serve_cli.build_backend(settings)
    assert isinstance(backend, HFBackend)
    # The one config object reaches the backend as it is.
    assert backend.settings is settings


async def test_hf_settings_size_the_engine(smollm2):
    """Config keys reach the engine: block size, pool, batch, preemption, chunk budget."""
    from tests.conftest import make_settings

    settings = make_settings(
        memory={"block_size": 8, "num_gpu_blocks": 100, "num_cpu_blocks": 10},
        scheduler={"max_batch_size": 3, "preemption_policy": "recompute", "max_num_batched_tokens": 64,
                   "prefill_step_ms": 250},
    )
    backend = HFBackend(None, None, settings, preloaded=LoadedModel(smollm2[0], smollm2[2], "smollm2", "hf:test"))
    await backend.start()
    try:
        config = backend.runner.config
        assert (config.block_size, config.num_blocks, config.num_cpu_blocks) == (8, 100, 10)
        assert (config.max_num_seqs, config.preemption_mode, config.max_num_batched_tokens) == (3, "recompute", 64)
        assert backend.describe()["prefill_pacing"] == {"step_ms": 250, "tokens_per_s": None, "tokens_beside_decodes": 63}
        limits = await backend.limits()
        assert limits.n_ctx_total == 800 and limits.parallel == 3
    finally:
        await backend.close()


async def test_the_default_batch_is_sized_from_the_pool(smollm2):
    """max_batch_size "auto" (the default): one sequence per 1,024 pool tokens, 8 to 256, so
    that 16 concurrent chats on the default pool run in one wave, not two."""
    from kvstream.hf.kv_cache import auto_batch_size
    from tests.conftest import make_settings

    assert (auto_batch_size(100, 8), auto_batch_size(2048, 16), auto_batch_size(10**6, 16)) == (8, 32, 256)
    for blocks, expected in ((2048, 32), (100, 8)):
        settings = make_settings(memory={"block_size": 16, "num_gpu_blocks": blocks})
        assert settings.scheduler.max_batch_size == "auto"
        backend = HFBackend(None, None, settings, preloaded=LoadedModel(smollm2[0], smollm2[2], "smollm2", "hf:test"))
        await backend.start()
        try:
            assert backend.runner.config.max_num_seqs == expected
            assert backend.runner.scheduler.config.max_batch_size == expected
            assert (await backend.limits()).parallel == expected
        finally:
            await backend.close()


async def test_the_engine_failing_mid_stream_ends_that_stream_with_an_error_and_serves_the_next(hf_proxy, oa, monkeypatch):
    from tests.conftest import fail_forward_at

    fail_forward_at(monkeypatch, 4)
    received = ""
    with pytest.raises(openai.APIError):
        stream = await oa.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=40, temperature=0, stream=True)
        async for chunk in stream:
            received += chunk.choices[0].text if chunk.choices else ""
    assert received  # tokens before the failure reached the client; then an error, not a fake finish
    await wait_idle(hf_proxy)
    after = await oa.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=4, temperature=0)
    assert after.choices[0].finish_reason == "length"


async def test_a_request_left_nothing_to_draw_ends_alone_and_the_others_stream_on(hf_proxy, oa, monkeypatch):
    """A row whose draw raises (its distribution NaN) ends that request with a 400; the step's
    exception used to fail every running request with it (a client's temperature of 1e-320 or
    repeat_penalty of 1e-300 did that: test_sampling_detokenize.py)."""
    from kvstream.hf import sampling

    real = sampling.filtered
    monkeypatch.setattr(sampling, "filtered", lambda scores, p: (
        torch.full_like(scores, float("nan")) if p.temperature == 0.77 else real(scores, p)))
    streaming = asyncio.Event()
    task = asyncio.create_task(bystander(oa, streaming))
    await streaming.wait()
    with pytest.raises(BadRequestError, match="leave no token to draw"):
        await oa.completions.create(model="smollm2", prompt="Hello", max_tokens=8, temperature=0.77)
    assert not task.done()  # it was running beside the failed one
    assert await task == (64, "length")
    await wait_idle(hf_proxy)
    assert hf_proxy.engine.scheduler.bm.is_idle()


async def bystander(oa, streaming: asyncio.Event) -> tuple[int, str | None]:
    """A greedy stream of 64 tokens (``streaming`` set at its first chunk): its count and finish."""
    stream = await oa.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=64, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    finish, tokens = None, 0
    async for chunk in stream:
        streaming.set()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return tokens, finish


async def test_a_request_whose_own_state_raises_in_a_step_ends_alone(hf_proxy, oa, monkeypatch):
    """What raises in one request's part of a step (its detokenizer here; its constraint or
    stop strings alike) ends that request with the engine's error, the step going on for the
    others: the step's handler used to fail every running request."""
    from kvstream.hf.detokenize import IncrementalDetokenizer

    real = IncrementalDetokenizer.add

    def add(self, token):
        if "BOOM" in self.stop and self.read_offset:
            raise RuntimeError("this request's own fault")
        return real(self, token)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    streaming = asyncio.Event()
    task = asyncio.create_task(bystander(oa, streaming))
    await streaming.wait()
    with pytest.raises(openai.InternalServerError, match="own fault"):
        await oa.completions.create(model="smollm2", prompt="Hello", max_tokens=8, temperature=0, stop=["BOOM"])
    assert not task.done()
    assert await task == (64, "length")
    await wait_idle(hf_proxy)
    assert hf_proxy.engine.scheduler.bm.is_idle()


MIXED = [{"role": "user", "content": "Tell me a story about a cat."}]
MIXED_KINDS: dict[str, tuple[str, dict, set[int]]] = {  # kind: (path, body, the statuses it may get)
    "plain": ("/v1/chat/completions", {"messages": MIXED, "max_tokens": 16}, {200}),
    "stream": ("/v1/chat/completions", {"messages": MIXED, "max_tokens": 16, "stream": True}, {200}),
    "choices": ("/v1/chat/completions", {"messages": MIXED, "max_tokens": 8, "n": 3, "temperature": 1, "logprobs": True,
                                         "top_logprobs": 3}, {200}),
    # Decided on the side thread (a lookahead the machine cannot read), streamed.
    "lookahead": ("/v1/chat/completions", {"messages": MIXED, "max_tokens": 8, "stream": True,
                                           "guided_regex": "(?=[A-Za-z ])[A-Za-z ,.]{1,40}"}, {200}),
    "schema": ("/v1/chat/completions", {"messages": MIXED, "max_tokens": 16, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}, {200}),
    "lazy": ("/completion", {"prompt": "hi", "n_predict": 8, "stream": True, "grammar": 'root ::= "x" [a-z]*',
                             "grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "(?<=a)b"}]}, {200}),
    "crashing regex": ("/v1/chat/completions", {"messages": MIXED, "max_tokens": 4, "guided_regex": "(?:ab|c){1000000}"}, {400}),
    "tiny penalty": ("/v1/chat/completions", {"messages": MIXED, "max_tokens": 4, "repeat_penalty": 1e-300}, {200}),
}


async def test_a_mixed_crowd_with_hostile_requests_and_aborts_leaves_nothing_behind(hf_proxy):
    """48 requests, 12 at a time, of every kind above, a quarter of them left mid-answer by
    their client: each answered with its kind's status, then nothing running, queued or held,
    and the next request answered."""
    import random

    rng = random.Random(7)
    wrong: list[str] = []

    async def one(session: aiohttp.ClientSession, kind: str, leave: bool) -> None:
        path, body, statuses = MIXED_KINDS[kind]
        async with session.post(hf_proxy.url + path, json={"model": "smollm2", **body}) as response:
            if leave:
                await asyncio.sleep(rng.random() * 0.3)
                return
            await response.read()
            if response.status not in statuses:
                wrong.append(f"{kind}: {response.status} {await response.text()}")

    gate = asyncio.Semaphore(12)

    async def paced(session: aiohttp.ClientSession, kind: str, leave: bool) -> None:
        async with gate:
            await one(session, kind, leave)

    plan = [(rng.choice(list(MIXED_KINDS)), rng.random() < 0.25) for _ in range(48)]
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(paced(session, kind, leave) for kind, leave in plan))
        assert not wrong
        await wait_idle(hf_proxy)
        assert hf_proxy.engine.scheduler.bm.is_idle()
        async with session.post(hf_proxy.url + "/v1/chat/completions",
                                json={"model": "smollm2", "messages": MIXED, "max_tokens": 4}) as response:
            assert response.status == 200


async def test_sampling_values_at_the_edge_of_float32_answer(oa):
    greedy = await oa.completions.create(model="smollm2", prompt="The sky is", max_tokens=8, temperature=0)
    tiny = await oa.completions.create(model="smollm2", prompt="The sky is", max_tokens=8, temperature=1e-320)
    assert tiny.choices[0].text == greedy.choices[0].text
    penalized = await oa.completions.create(model="smollm2", prompt="The sky is", max_tokens=8, seed=1,
                                            extra_body={"repeat_penalty": 1e-300})
    assert penalized.choices[0].finish_reason == "length" and penalized.usage.completion_tokens == 8


async def test_top_p_zero_is_accepted_and_greedy(oa):
    greedy = await oa.completions.create(model="smollm2", prompt="The sky is", max_tokens=8, temperature=0)
    nucleus = await oa.completions.create(model="smollm2", prompt="The sky is", max_tokens=8, temperature=1.0, top_p=0)
    assert nucleus.choices[0].text == greedy.choices[0].text


async def test_a_request_waiting_past_the_queue_timeout_gets_503(smollm2, start_proxy):
    model, _, tokenizer = smollm2
    backend = HFBackend(
        None, None, preloaded=LoadedModel(model, tokenizer, "smollm2", "hf:test"),
        block_size=16, num_gpu_blocks=64, num_cpu_blocks=0, max_batch_size=1, queue_timeout_s=0.3,
    )
    proxy = await start_proxy(backend)
    await proxy.engine.start()
    try:
        async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
            long = asyncio.create_task(client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=200, temperature=0))
            await asyncio.sleep(0.2)
            with pytest.raises(openai.APIStatusError) as err:
                await client.completions.create(model="smollm2", prompt="Hello", max_tokens=4)
            assert err.value.status_code == 503 and err.value.code == "queue_timeout"
            assert err.value.response.headers.get("Retry-After")
            await long
        await wait_idle(proxy)
    finally:
        await proxy.engine.close()


async def test_warm_endpoint_prefills_a_system_prompt_the_next_chat_reuses(hf_proxy, oa):
    system = "You are KVStream's support bot. Answer in one short sentence, politely. " * 4
    async with aiohttp.ClientSession() as http:
        async with http.post(hf_proxy.v1 + "/warm", json={"system": system}) as resp:
            assert resp.status == 200
            warmed = await resp.json()
        assert warmed["object"] == "kvstream.warm" and warmed["prompt_tokens"] > 48 and warmed["cached_tokens"] == 0
        raw = await oa.chat.completions.with_raw_response.create(
            model="smollm2", messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi!"}], max_tokens=4
        )
        hit = int(raw.headers["X-KVStream-Prefix-Hit-Tokens"])
        # The warm-up prefilled the system turn without the assistant header, so all of it
        # is reused, token for token (its partial last block included).
        assert warmed["model"] == "smollm2"
        assert hit == warmed["prompt_tokens"]
        async with http.post(hf_proxy.v1 + "/warm", json={"system": system, "prompt": "x"}) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_value"
        # The in-process engine serves one model: any name is served by it (llama-server's way).
        async with http.post(hf_proxy.v1 + "/warm", json={"model": "no-such-model", "system": "x"}) as resp:
            assert resp.status == 200 and (await resp.json())["model"] == "smollm2"
    await wait_idle(hf_proxy)


async def test_ollama_front_on_the_in_process_engine(hf_proxy, http):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hi."}], "stream": False, "options": {"temperature": 0, "num_predict": 4}}
    async with http.post(hf_proxy.url + "/api/chat", json=body) as resp:
        reply = await resp.json()
    assert reply["done"] and reply["message"]["content"] and reply["eval_count"] >= 1
    async with http.post(hf_proxy.url + "/api/chat", json=body | {"logprobs": True, "top_logprobs": 1}) as resp:
        scored = await resp.json()
    assert scored["message"]["content"] == reply["message"]["content"]  # greedy both times
    assert "".join(e["token"] for e in scored["logprobs"]) == reply["message"]["content"]
    assert all(len(e["top_logprobs"]) == 1 for e in scored["logprobs"])
    async with http.post(hf_proxy.url + "/api/chat", json=body | {"logprobs": True, "top_logprobs": 21}) as resp:
        assert resp.status == 400 and "top_logprobs" in (await resp.json())["error"]
    async with http.post(hf_proxy.url + "/api/chat", json=body | {"logprobs": "yes"}) as resp:
        assert resp.status == 400 and "logprobs" in (await resp.json())["error"]
    async with http.post(hf_proxy.url + "/api/chat", json=body | {"options": {"repeat_penalty": 0}}) as resp:
        assert resp.status == 400 and "repeat_penalty" in (await resp.json())["error"]
    # The engine computes embeddings itself (tests/hf/test_embeddings.py).
    async with http.post(hf_proxy.url + "/api/embed", json={"model": "smollm2", "input": "x"}) as resp:
        assert resp.status == 200 and len((await resp.json())["embeddings"][0]) == 576


async def test_the_ollama_client_pulls_the_served_model_and_is_told_the_store_is_not_here(hf_proxy):
    """Apps pull before they chat: the engine's model is there already. Creating, copying,
    pushing and deleting are a model store's: a 501 that says so, in Ollama's shape."""
    import ollama

    client = ollama.AsyncClient(host=hf_proxy.url)
    shown = await client.show("smollm2")
    # SmolLM2's template renders no tools (offered the generic way: generic_calls.py), no thinking
    assert shown.capabilities == ["completion", "tools", "embedding"]
    assert (shown.details.family, shown.details.parameter_size, shown.details.quantization_level) == ("llama", "135M", "F32")
    assert (shown.modelinfo["general.architecture"], shown.modelinfo["general.basename"]) == ("llama", "smollm2")
    assert shown.modelinfo["llama.context_length"] == 8192  # where apps look for it: <architecture>.context_length
    listed = (await client.list()).models[0]
    assert listed.details.family == "llama" and listed.size > 500 * 2**20  # 135M parameters in float32
    assert (await client.ps()).models[0].size_vram == 0  # on the CPU
    assert (await client.pull("smollm2")).status == "success"
    assert [part.status async for part in await client.pull("smollm2", stream=True)] == ["success"]
    for call in (client.delete("smollm2"), client.copy("smollm2", "other"), client.create("other", from_="smollm2"),
                 client.push("smollm2")):
        with pytest.raises(ollama.ResponseError) as caught:
            await call
        assert caught.value.status_code == 501 and "the in-process engine's, loaded at start" in caught.value.error



async def test_logprobs_are_the_models_own_streamed_or_not_chat_and_completions(oa, smollm2):
    """The first token's log-probability is log-softmax of the model's logits after the
    prompt (plain transformers, same weights); the streamed chunks carry what the
    non-streamed answer joins; completions get OpenAI's legacy shape."""
    _, reference_model, tokenizer = smollm2
    messages = [{"role": "user", "content": "Name a planet."}]
    reply = await oa.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in entries)
    assert "".join(e.token for e in entries) == reply.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in entries).decode() == reply.choices[0].message.content
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        reference = torch.log_softmax(reference_model(torch.tensor([list(ids)])).logits[0, -1].float(), dim=-1)
    best = reference.topk(3)
    assert entries[0].token == tokenizer.decode([int(best.indices[0])])  # greedy: the most likely
    assert entries[0].logprob == pytest.approx(float(best.values[0]), abs=1e-3)
    assert [t.logprob for t in entries[0].top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-3)

    stream = await oa.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for chunk in [c async for c in stream] if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]

    plain = await oa.chat.completions.create(model="smollm2", messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == reply.choices[0].message.content

    text = await oa.completions.create(model="smollm2", prompt="The sky is", max_tokens=5, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == len(lp.tokens) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    assert all(len(top) <= 2 and token in top for top, token in zip(lp.top_logprobs, lp.tokens, strict=True))


async def test_logit_bias_and_penalties_change_the_answer(oa, smollm2):
    tokenizer = smollm2[2]
    messages = [{"role": "user", "content": "Say hi."}]
    greedy = await oa.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0, logprobs=True)
    first = greedy.choices[0].logprobs.content[0]
    [first_id] = tokenizer.convert_tokens_to_ids([tokenizer.tokenize(first.token)[0]])
    assert tokenizer.decode([first_id]) == first.token
    banned = await oa.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0, logprobs=True, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first.token
    penalized = await oa.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalized.choices[0].message.content != greedy.choices[0].message.content


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": 2}}}},
         "response_format"),  # a keyword structured outputs cannot enforce
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"logit_bias": {"not-an-id": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),  # past SmolLM2's vocabulary
        # A forced call of a function the request does not list (forced calls: test_tool_calls.py).
        ({"tool_choice": {"type": "function", "function": {"name": "g"}},
          "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
        # SmolLM2's template does not render tools: offered the generic way, the answer held to
        # their parameters' schemas, which must be ones the engine can hold it to where strict.
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "type": "object", "properties": {"code": {"type": "string", "pattern": "^A$"}}}}}]}, "tools"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"extra_body": {"typical_p": 1.2}}, "typical_p"),
        ({"extra_body": {"repeat_penalty": "strong"}}, "repeat_penalty"),  # Ollama's options arrive unchecked
        ({"extra_body": {"repeat_last_n": -2}}, "repeat_last_n"),
        ({"extra_body": {"logit_bias": [5, 1]}}, "logit_bias"),
        # Samplers of llama-server, Ollama and vLLM the engine lacks, set on.
        ({"extra_body": {"mirostat": 2}}, "mirostat"),
        ({"extra_body": {"dry_multiplier": 0.8}}, "dry_multiplier"),
        # Constraints it has (test_grammar.py), given what it cannot read.
        ({"extra_body": {"grammar": 'root ::= "a'}}, "grammar"),
        ({"extra_body": {"guided_regex": "a+("}}, "guided_regex"),
        # An expression whose compile ends the process with a segmentation fault, as the
        # server's did (bounded_compile.py), and one that takes gigabytes to compile.
        ({"extra_body": {"guided_regex": "(?:ab|c){1000000}"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"regex": "(?=a)(?:(?:a{1000}){1000}){64}"}}}, "structured_outputs.regex"),
        ({"extra_body": {"guided_choice": "a"}}, "guided_choice"),
        # Tools of the wrong shape: said so, not a chat template's attribute error about 'messages'.
        ({"tools": "get_weather"}, "tools"),
        ({"tools": ["get_weather"]}, "tools.0"),
        # A spoken answer asked of a text model (OpenAI's audio output): not text without audio.
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ],
)
async def test_what_the_engine_cannot_honour_is_a_400_naming_the_field(hf_proxy, oa, kwargs, param):
    with pytest.raises(BadRequestError) as err:
        await oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kwargs)
    assert err.value.status_code == 400 and err.value.param == param
    await wait_idle(hf_proxy)
    assert hf_proxy.engine.scheduler.bm.is_idle()


async def test_completions_refuse_suffix_and_take_tools_none(oa):
    # (echo is served: test_echo_scoring.py; best_of: test_best_of.py)
    for kwargs, param in (({"suffix": "y"}, "suffix"), ({"logprobs": 6}, "logprobs")):
        with pytest.raises(BadRequestError) as err:
            await oa.completions.create(model="smollm2", prompt="x", max_tokens=2, **kwargs)
        assert err.value.param == param
    # tool_choice "none": the client wants no call; the tools are left out and it is answered.
    reply = await oa.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}], user="someone", metadata={"a": "b"}, store=False,
        modalities=["text"])
    assert reply.choices[0].message.content is not None
    # Samplers the engine lacks, sent at the values that leave them off (llama.cpp's web UI does): taken.
    reply = await oa.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"grammar": "", "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0, "top_n_sigma": -1})
    assert reply.choices[0].message.content is not None


async def test_stop_token_ids_end_the_answer_at_that_token(oa, smollm2):
    """vLLM's ``stop_token_ids``: the answer ends at the first of them, as at its end of turn
    (the token's own text left out), against transformers' greedy tokens."""
    import torch

    _, reference, tokenizer = smollm2
    ids = tokenizer("1, 2, 3, 4,").input_ids
    generated = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0][len(ids):].tolist()
    stop = generated[3]
    cut = generated[:generated.index(stop)]
    reply = await oa.completions.create(model="smollm2", prompt="1, 2, 3, 4,", max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": [stop]})
    assert reply.choices[0].text == tokenizer.decode(cut) and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(cut) + 1
    for bad in ("x", [-1], [10**9], [True]):
        with pytest.raises(BadRequestError) as err:
            await oa.completions.create(model="smollm2", prompt="x", max_tokens=2, extra_body={"stop_token_ids": bad})
        assert err.value.param == "stop_token_ids"


async def test_typical_p_is_honoured_and_seeded_answers_repeat(oa):
    """llama-server's and Ollama's ``typical_p`` (locally typical sampling): served, and a seed
    repeats its answer."""
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, seed=11,
                  temperature=1.0, extra_body={"typical_p": 0.5})
    first = await oa.chat.completions.create(**kwargs)
    again = await oa.chat.completions.create(**kwargs)
    assert first.choices[0].message.content == again.choices[0].message.content


async def test_a_generate_context_continues_on_the_in_process_engine(hf_proxy, smollm2):
    """Ollama's ``context`` on the in-process engine: the answer's tokens are the prompt's and
    the answer's own, and sent back they open the next prompt (the same greedy answer as the
    whole conversation sent raw)."""
    import ollama

    from kvstream.hf.loader import chat_token_ids

    _, _, tokenizer = smollm2
    client = ollama.AsyncClient(host=hf_proxy.url)
    options = {"temperature": 0, "num_predict": 8}
    first = await client.generate(model="smollm2", prompt="My name is Ada.", options=options)
    prompt_ids = chat_token_ids(tokenizer, [{"role": "user", "content": "My name is Ada."}])
    assert first.context[:len(prompt_ids)] == prompt_ids and len(first.context) > len(prompt_ids)
    assert tokenizer.decode(first.context[len(prompt_ids):]) == first.response
    second = await client.generate(model="smollm2", prompt="What is my name?", context=first.context, options=options)
    turn = chat_token_ids(tokenizer, [{"role": "user", "content": "What is my name?"}])
    assert second.prompt_eval_count == len(first.context) + len(turn)
    raw = await client.generate(model="smollm2", prompt=tokenizer.decode(first.context + turn), raw=True, options=options)
    assert second.response == raw.response
    await wait_idle(hf_proxy)
