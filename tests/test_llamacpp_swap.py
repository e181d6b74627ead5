"""Real swap on llama-server: a higher-priority request preempts a running one, whose slot
state is saved to a file and restored when it resumes; the client's stream pauses and then
continues where it stopped, with no token lost or repeated."""

from __future__ import annotations

import asyncio

import openai
import pytest

from kvstream.backends import LlamaCppBackend
from tests.conftest import launch_llama_server

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(300)]

COUNTING = "Count from 1 to 300, separated by commas: 1, 2, 3,"


@pytest.fixture
def one_slot_server(tmp_path):
    server = launch_llama_server(slots=1, ctx=4096, slot_dir=tmp_path)
    yield server
    server.stop()


async def start(start_proxy, server, slot_dir, **scheduler):
    backend = LlamaCppBackend(server.url, slot_save_path=str(slot_dir))
    proxy = await start_proxy(backend, scheduler=scheduler)
    await proxy.engine.start()
    client = openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    return proxy, backend, client, model


async def stream_text(client, model, chunks: list[str], priority: str, **kw) -> str | None:
    headers = {"X-KVStream-Priority": priority, "X-Conversation-Id": f"conv-{priority}"}
    stream = await client.completions.create(model=model, prompt=COUNTING, temperature=0, stream=True, extra_headers=headers, **kw)
    finish = None
    async for chunk in stream:
        if chunk.choices:
            chunks.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    return finish


@pytest.mark.parametrize("policy", ["swap", "recompute"])
async def test_preempted_stream_resumes_where_it_stopped(one_slot_server, start_proxy, tmp_path, policy):
    proxy, backend, client, model = await start(start_proxy, one_slot_server, tmp_path, preemption_policy=policy)
    assert proxy.engine.scheduler.preemptible and proxy.engine.scheduler.config.max_batch_size == 1
    reference = await client.completions.create(model=model, prompt=COUNTING, max_tokens=200, temperature=0)
    expected = reference.choices[0].text
    upstream = record_upstream_headers(backend)

    low_chunks: list[str] = []
    low = asyncio.create_task(stream_text(client, model, low_chunks, "low", max_tokens=200))
    while len(low_chunks) < 15:
        await asyncio.sleep(0.005)
    high = await client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
        extra_headers={"X-KVStream-Priority": "high"},
    )
    assert high.choices[0].text
    assert not low.done(), "the low-priority stream should still be paused or running"
    finish = await low

    assert finish == "length"
    # Greedy on both paths: the paused-and-resumed stream reads exactly like the plain one.
    assert "".join(low_chunks) == expected
    stats = proxy.engine.scheduler.stats
    assert stats.preemptions == 1
    if policy == "swap":
        assert backend.inject.stats.swap_outs == 1 and backend.inject.stats.swap_ins == 1
    else:
        assert backend.inject.stats.swap_outs == 0
    assert not list(tmp_path.glob("kvstream-swap-*")), "swap files are deleted once resumed"
    # The resumed leg (llama-server's /completion) carries the client's own headers, as the first leg did.
    conversations = [(path, h.get("x-conversation-id")) for path, h in upstream]
    assert conversations[0] == ("/v1/completions", "conv-low") and conversations[-1] == ("/completion", "conv-low")
    assert all("x-kvstream-priority" not in h for _, h in upstream)
    await wait_idle(proxy)


def record_upstream_headers(backend) -> list[tuple[str, dict[str, str]]]:
    """(path, headers with lower-case names) of every generation request the backend sends
    from now on."""
    seen: list[tuple[str, dict[str, str]]] = []
    send = backend.http.request

    def recording(method, path, **kw):
        if path in ("/completion", "/v1/completions"):
            seen.append((path, {name.lower(): value for name, value in (kw.get("headers") or {}).items()}))
        return send(method, path, **kw)

    backend.http.request = recording
    return seen


async def wait_idle(proxy) -> None:
    """The server releases a request just after its client got the last byte."""
    for _ in range(200):
        if proxy.engine.scheduler.bm.is_idle() and not proxy.engine.scheduler.swapped:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("blocks still held")


async def pause_low_for_high(client, model, backend, low_tokens: int, high_tokens: int):
    """Start a low-priority stream, then a high-priority request that preempts it; returns
    once the low one is paused with its state saved: (low task, its chunks, high task)."""
    low_chunks: list[str] = []
    low = asyncio.create_task(stream_text(client, model, low_chunks, "low", max_tokens=low_tokens))
    while len(low_chunks) < 15:
        await asyncio.sleep(0.005)
    high = asyncio.create_task(
        client.completions.create(
            model=model, prompt=COUNTING, max_tokens=high_tokens, temperature=0, extra_headers={"X-KVStream-Priority": "high"}
        )
    )
    for _ in range(500):
        if backend.inject.stats.swap_outs:
            break
        await asyncio.sleep(0.01)
    assert backend.inject.stats.swap_outs == 1
    return low, low_chunks, high


async def test_a_client_leaving_while_paused_frees_its_swap_file(one_slot_server, start_proxy, tmp_path):
    proxy, backend, client, model = await start(start_proxy, one_slot_server, tmp_path)
    low, _, high = await pause_low_for_high(client, model, backend, low_tokens=250, high_tokens=150)
    assert list(tmp_path.glob("kvstream-swap-*"))
    low.cancel()
    with pytest.raises(asyncio.CancelledError):
        await low
    await high
    await wait_idle(proxy)
    assert not list(tmp_path.glob("kvstream-swap-*"))


async def test_a_damaged_swap_file_is_recomputed_and_the_stream_still_completes(one_slot_server, start_proxy, tmp_path):
    proxy, backend, client, model = await start(start_proxy, one_slot_server, tmp_path)
    expected = (await client.completions.create(model=model, prompt=COUNTING, max_tokens=200, temperature=0)).choices[0].text
    low, low_chunks, high = await pause_low_for_high(client, model, backend, low_tokens=200, high_tokens=120)
    [swap_file] = tmp_path.glob("kvstream-swap-*")
    swap_file.write_bytes(b"not a slot file")
    await high
    assert await low == "length"
    assert "".join(low_chunks) == expected  # recomputed from the text, not restored
    assert backend.inject.stats.swap_outs == 1 and backend.inject.stats.swap_ins == 0
    await wait_idle(proxy)
    assert not list(tmp_path.glob("kvstream-swap-*"))


def test_a_resumed_leg_samples_as_the_first_leg_did():
    """The resumed /completion leg takes the client's sampling from the forwarded body (it
    lost temperature 0 once, and greedy resumes then continued at the server's 0.8)."""
    from kvstream.types import GenerateRequest

    forwarded = GenerateRequest(model="m", prompt="p", body={
        "model": "m", "prompt": "p", "stream": True, "max_tokens": 9, "temperature": 0, "top_k": 5, "min_p": 0.1, "stop": ["\n"],
        "stream_options": {"include_usage": True},
    })
    assert LlamaCppBackend._resume_sampling(forwarded) == {"temperature": 0, "top_k": 5, "min_p": 0.1, "stop": ["\n"]}
    built = GenerateRequest(model="m", prompt="p", temperature=0.0, seed=3, stop=["x"], extra={"min_p": 0.2, "user": "u"})
    assert LlamaCppBackend._resume_sampling(built) == {"temperature": 0.0, "seed": 3, "stop": ["x"], "min_p": 0.2}
