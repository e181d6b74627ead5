"""Embeddings from the in-process engine: /v1/embeddings with the openai client, Ollama's
/api/embed and /api/embeddings with the ollama client, checked against transformers' own
forward, and run between the engine's steps without stalling the generations."""

from __future__ import annotations

import asyncio
import base64
import struct

import ollama
import openai
import pytest
import torch
import torch.nn.functional as F

from kvstream.hf.embeddings import CHUNK_TOKENS

pytestmark = pytest.mark.timeout(300)

TEXTS = ["The cat sat on the mat.", "A kitten rested on the rug.", "Stock markets fell sharply today."]


def reference_vector(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' own forward of the whole input, mean-pooled and unit-length."""
    with torch.inference_mode():
        hidden = reference.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(hidden.mean(0), dim=0)


async def test_vectors_are_the_models_mean_pooled_hidden_states_in_chunks_too(hf_proxy, oa, smollm2, http):
    _, reference, tokenizer = smollm2
    long_text = "The committee met on Tuesday to review the budget and the schedule. " * 40
    texts = TEXTS + [long_text]
    ids = [tokenizer(t).input_ids for t in texts]
    assert len(ids[-1]) > 2 * CHUNK_TOKENS  # computed in three chunks
    answer = await oa.embeddings.create(model="smollm2", input=texts)  # the client asks for base64
    assert [d.index for d in answer.data] == [0, 1, 2, 3]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    for item, token_ids in zip(answer.data, ids, strict=True):
        vector = torch.tensor(item.embedding)
        assert vector.shape == (576,) and abs(vector.norm().item() - 1) < 1e-5
        assert torch.allclose(vector, reference_vector(reference, token_ids), atol=2e-5)
    # The same inputs as token ids, and as floats: the same vectors.
    as_ids = await oa.embeddings.create(model="smollm2", input=ids, encoding_format="float")
    assert [d.embedding for d in as_ids.data] == [d.embedding for d in answer.data]
    runner = hf_proxy.engine.backend.runner
    assert runner.counters.embedding_tokens == 2 * sum(map(len, ids)) and runner.counters.steps == 0  # no engine step
    async with http.get(hf_proxy.url + "/metrics") as resp:
        assert f'kvstream_engine_forward_tokens_total{{kind="embedding"}} {2 * sum(map(len, ids))}.0' in await resp.text()
    similar, unrelated = (torch.tensor(answer.data[0].embedding) @ torch.tensor(answer.data[i].embedding) for i in (1, 2))
    assert similar > unrelated


async def test_short_inputs_run_together_in_padded_jobs_with_each_ones_own_vector(hf_proxy, oa, smollm2, monkeypatch):
    """Inputs of many lengths in one request: the short ones share padded forwards (fewer
    jobs than inputs, none over the budget), a long one still goes a chunk at a time, and
    every vector is the input's own forward's, in the request's order."""
    _, reference, tokenizer = smollm2
    runner = hf_proxy.engine.backend.runner
    jobs: list = []
    run_between_steps = runner.run_between_steps
    monkeypatch.setattr(runner, "run_between_steps", lambda job: (jobs.append(job), run_between_steps(job))[1])
    words = "the committee met on tuesday to review the budget and the schedule of the new library".split()
    texts = [" ".join(words[i % 5:i % 5 + 1 + (i * 7) % 60]) for i in range(24)] + ["word " * 300, "Hi"]
    ids = [tokenizer(t).input_ids for t in texts]
    answer = await oa.embeddings.create(model="smollm2", input=texts, encoding_format="float")
    for item, token_ids in zip(answer.data, ids, strict=True):
        assert torch.allclose(torch.tensor(item.embedding), reference_vector(reference, token_ids), atol=2e-5)
    assert 2 + 1 < len(jobs) < len(texts)  # the 300-token input alone takes two chunk jobs
    assert answer.usage.prompt_tokens == runner.counters.embedding_tokens == sum(map(len, ids))


def test_jobs_pack_sorted_inputs_within_the_padded_budget():
    from kvstream.hf.embeddings import jobs

    lengths = [5, 300, 64, 64, 1, 65, 64, 120, 3, 256, 257]
    groups = jobs([[0] * n for n in lengths], budget=256)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= 256
    assert [300] in [[lengths[i] for i in group] for group in groups]  # past the budget: alone
    assert [lengths[i] for i in groups[0]] == [1, 3, 5, 64]  # sorted, as many as fit
    assert [lengths[i] for i in groups[1]] == [64, 64, 65] and len(groups) == 6


async def test_base64_is_little_endian_float32_of_the_same_vector(hf_proxy, http):
    body = {"model": "smollm2", "input": TEXTS[0]}
    async with http.post(hf_proxy.v1 + "/embeddings", json=body | {"encoding_format": "float"}) as resp:
        floats = (await resp.json())["data"][0]["embedding"]
    async with http.post(hf_proxy.v1 + "/embeddings", json=body | {"encoding_format": "base64"}) as resp:
        packed = base64.b64decode((await resp.json())["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(floats)}f", packed)) == pytest.approx(floats, abs=1e-7)


@pytest.mark.parametrize("fields, param, words", [
    ({"input": []}, "input", "empty list"),
    ({"input": [""]}, "input", "an input is empty"),
    ({"input": ""}, "input", "an input is empty"),
    ({"input": ["x", [1, 2]]}, "input", "expected a string"),
    ({"input": [True]}, "input", "expected a string"),
    ({"input": 5}, "input", "expected a string"),
    ({"input": [[1, 2], [999999]]}, "input", "token 999999 is outside the vocabulary"),
    ({"input": ["x"] * 2049}, "input", "more than the 2048"),
    ({"input": "word " * 9000}, "input", "more than the model's context of 8192"),
    ({"input": ["word " * 8000] * 40}, "input", "max 300000 tokens per request"),
    ({"input": "x", "dimensions": 64}, "dimensions", "have 576 dimensions and cannot be shortened"),
    ({"input": "x", "dimensions": "576"}, "dimensions", "cannot be shortened"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "expected 'float' or 'base64'"),
])
async def test_bad_input_is_a_400_naming_the_field(hf_proxy, http, fields, param, words):
    async with http.post(hf_proxy.v1 + "/embeddings", json={"model": "smollm2", **fields}) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == param and words in error["message"], error
    runner = hf_proxy.engine.backend.runner
    assert not runner._between_steps and runner.counters.embedding_tokens == 0  # refused before any was computed


async def test_the_ollama_client_gets_the_same_vectors(hf_proxy, oa, http):
    client = ollama.AsyncClient(host=hf_proxy.url)
    ours = await oa.embeddings.create(model="smollm2", input=TEXTS[:2], encoding_format="float")
    embedded = await client.embed(model="smollm2", input=TEXTS[:2])
    assert embedded.embeddings == [d.embedding for d in ours.data] and embedded.prompt_eval_count == ours.usage.prompt_tokens
    assert (await client.embeddings(model="smollm2", prompt=TEXTS[0])).embedding == ours.data[0].embedding
    assert (await client.embed(model="smollm2", input="")).embeddings == []  # apps send one to load the model
    short = (await client.embed(model="smollm2", input=TEXTS[0], dimensions=64)).embeddings[0]
    assert short == pytest.approx(F.normalize(torch.tensor(ours.data[0].embedding[:64]), dim=0).tolist(), abs=1e-6)
    # Past the context: cut to it by default, as Ollama does; refused with truncate false.
    assert len((await client.embed(model="smollm2", input="word " * 9000)).embeddings) == 1
    with pytest.raises(ollama.ResponseError) as caught:
        await client.embed(model="smollm2", input="word " * 9000, truncate=False)
    assert caught.value.status_code == 400 and "context of 8192" in caught.value.error
    for bad, words in [({"input": [1, 2]}, "input must be a string or a list of strings"),
                       ({"input": "x", "truncate": "yes"}, "truncate must be a boolean"),
                       ({"input": "x", "dimensions": 0}, "dimensions must be a positive integer")]:
        async with http.post(hf_proxy.url + "/api/embed", json={"model": "smollm2", **bad}) as resp:
            assert resp.status == 400 and words in (await resp.json())["error"]
    async with http.post(hf_proxy.url + "/api/embeddings", json={"model": "smollm2", "prompt": 5}) as resp:
        assert resp.status == 400 and (await resp.json()) == {"error": "prompt must be a string"}


async def test_a_long_embedding_does_not_stall_a_chat_and_a_client_that_leaves_cancels_it(hf_proxy, oa, monkeypatch):
    """A long input is computed a chunk at a time between the engine's steps: a chat sent
    once it has begun finishes first. A client that leaves takes its remaining chunks with it."""
    from kvstream.hf.embeddings import Embedding

    chunks: list[int] = []
    step = Embedding.step

    def counted_step(self):
        chunks.append(self.done_tokens)
        return step(self)

    monkeypatch.setattr(Embedding, "step", counted_step)
    long_text = "The committee met on Tuesday to review the budget and the schedule. " * 200  # ~2,600 tokens: 11 chunks
    embedding = asyncio.create_task(oa.embeddings.create(model="smollm2", input=long_text))
    runner = hf_proxy.engine.backend.runner
    for _ in range(1000):
        if chunks:
            break
        await asyncio.sleep(0.01)
    chat = await oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].message.content and not embedding.done(), chunks
    await embedding
    assert len(chunks) == 11
    # Leaving mid-way: no job is left queued, and the engine serves the next request.
    leaving = asyncio.create_task(oa.embeddings.create(model="smollm2", input=long_text))
    await asyncio.sleep(0.5)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    for _ in range(200):
        if not runner._between_steps:
            break
        await asyncio.sleep(0.05)
    assert not runner._between_steps
    assert (await oa.embeddings.create(model="smollm2", input="again")).data


async def test_an_embedding_the_engine_fails_is_a_502_and_the_engine_goes_on(hf_proxy, oa, monkeypatch):
    from kvstream.hf.embeddings import Embedding

    def broken(self):
        raise RuntimeError("boom")

    with monkeypatch.context() as patch:
        patch.setattr(Embedding, "step", broken)
        with pytest.raises(openai.APIStatusError) as caught:
            await oa.embeddings.create(model="smollm2", input="x")
    assert caught.value.status_code == 502 and "the engine failed" in caught.value.message
    assert (await oa.embeddings.create(model="smollm2", input="x")).data
    chat = await oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert chat.choices[0].message.content


async def test_a_full_queue_of_embedding_jobs_is_a_429_with_retry_after(hf_proxy, http, monkeypatch):
    from kvstream.scheduler import QueueFull

    def full(job):
        raise QueueFull("The queue is full (3 jobs waiting).")

    monkeypatch.setattr(hf_proxy.engine.backend.runner, "run_between_steps", full)
    async with http.post(hf_proxy.v1 + "/embeddings", json={"model": "smollm2", "input": "x"}) as resp:
        assert resp.status == 429 and resp.headers.get("Retry-After") and "queue is full" in (await resp.json())["error"]["message"]
    async with http.post(hf_proxy.url + "/api/embed", json={"model": "smollm2", "input": "x"}) as resp:
        assert resp.status == 429 and "queue is full" in (await resp.json())["error"]
