"""Embeddings from the in-process engine as users ask for them (``kvstream serve --backend
hf`` with its defaults, the ``openai`` client's ``embeddings.create``), against transformers'
own forward of the same inputs in the same run, and what a long embedding does to a chat
streaming beside it.

    python benchmarks/embeddings.py [--inputs 16] [--tokens 16 64 512 2048] [--long-tokens 4000]

Throughput: for each length T, one request carrying --inputs texts of T tokens; tokens per
second from the request sent to the answer read (tokenizing, HTTP, base64 included). Two
baselines run the same token ids through the plain model's decoder (float32, SDPA, torch's
threads), mean-pool and normalize, timed with the same clock while the server is idle: one
input at a time (``model.model(input_ids)``, the whole input in one forward), and all the
request's inputs as one padded batch (``attention_mask`` marking the padding, as
sentence-transformers batches; its best mode for short inputs, while for long ones it pads
nothing and equals the first). The largest difference between the server's vectors and the
first baseline's is printed (float rounding: the server packs short inputs into padded
forwards of at most 256 tokens and computes long ones in 256-token chunks against a cache).

Interference: a chat streams 64 tokens alone, then again with a --long-tokens embedding sent
just after its first token: the gaps between its tokens (median, worst) both times, and
whether the embedding was still running when the chat ended (it is computed 256 tokens at a
time between the engine's steps, so the chat's gaps grow by a chunk's time, never by the
whole embedding's).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import time

from _util import PYTHON, free_port, spawn, stop, wait_http

WORDS = "the committee met on tuesday to review the budget and the schedule of the new library".split()


def texts(tokenizer, count: int, tokens: int) -> list[str]:
    """``count`` different texts of exactly ``tokens`` tokens each (cut at a token boundary)."""
    out = []
    for i in range(count):
        words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(tokens * 2))
        ids = tokenizer(words).input_ids[:tokens]
        out.append(tokenizer.decode(ids))
    return out


def baseline(model, token_lists: list[list[int]]) -> tuple[float, list]:
    """One input at a time."""
    import torch
    import torch.nn.functional as F

    vectors = []
    start = time.perf_counter()
    with torch.inference_mode():
        for ids in token_lists:
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            vectors.append(F.normalize(hidden.mean(0), dim=0))
    return time.perf_counter() - start, vectors


def batched_baseline(model, token_lists: list[list[int]]) -> float:
    """Every input in one right-padded forward, the padding masked and left out of the mean."""
    import torch
    import torch.nn.functional as F

    start = time.perf_counter()
    longest = max(map(len, token_lists))
    ids = torch.zeros(len(token_lists), longest, dtype=torch.long)
    valid = torch.zeros(len(token_lists), longest, dtype=torch.long)
    for i, row in enumerate(token_lists):
        ids[i, :len(row)], valid[i, :len(row)] = torch.tensor(row), 1
    with torch.inference_mode():
        hidden = model.model(input_ids=ids, attention_mask=valid).last_hidden_state
        pooled = (hidden * valid[..., None]).sum(1) / valid.sum(1, keepdim=True)
        F.normalize(pooled, dim=-1)
    return time.perf_counter() - start


async def through_server(url: str, inputs: list[str]) -> tuple[float, list, int]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600) as client:
        start = time.perf_counter()
        answer = await client.embeddings.create(model="smollm2", input=inputs)
        return time.perf_counter() - start, [d.embedding for d in answer.data], answer.usage.prompt_tokens


async def chat_gaps(url: str, long_input: str | None) -> tuple[list[float], bool | None]:
    """A 64-token chat's gaps between tokens; with ``long_input``, an embedding of it sent
    after the chat's first token, and whether that embedding was still running at the end."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600) as client:
        stream = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            max_tokens=64, temperature=0, stream=True)
        times, embedding = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter())
                if long_input is not None and embedding is None:
                    embedding = asyncio.create_task(client.embeddings.create(model="smollm2", input=long_input))
        running = None if embedding is None else not embedding.done()
        if embedding is not None:
            await embedding
        return [b - a for a, b in zip(times, times[1:])], running


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 512, 2048])
    parser.add_argument("--long-tokens", type=int, default=4000)
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import torch
    from transformers import AutoModelForCausalLM

    from kvstream.hf.loader import load_model

    loaded = load_model(None, device="cpu")  # converts the embedded GGUF once (cached), as the server does
    folder, tokenizer = loaded.model.config._name_or_path, loaded.tokenizer
    del loaded
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    port = free_port()
    proc = spawn([PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", "hf", "--port", str(port)],
                 log=f"/tmp/kvstream-embeddings-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", timeout=300, proc=proc)
        asyncio.run(through_server(url, texts(tokenizer, 2, 32)))  # warm both
        baseline(plain, [tokenizer(t).input_ids for t in texts(tokenizer, 2, 32)])
        batched_baseline(plain, [tokenizer(t).input_ids for t in texts(tokenizer, 2, 32)])
        print(f"SmolLM2-135M fp32 on CPU, {torch.get_num_threads()} threads; {args.inputs} inputs a request")
        print(f"{'tokens':>7} {'server tok/s':>13} {'one-at-a-time tok/s':>20} {'ratio':>7} "
              f"{'padded batch tok/s':>19} {'ratio':>7} {'max |diff|':>11}")
        for length in args.tokens:
            inputs = texts(tokenizer, args.inputs, length)
            ids = [tokenizer(t).input_ids for t in inputs]
            served_s, served, counted = asyncio.run(through_server(url, inputs))
            base_s, expected = baseline(plain, ids)
            batched_s = batched_baseline(plain, ids)
            assert counted == sum(map(len, ids))
            diff = max(float((torch.tensor(v) - e).abs().max()) for v, e in zip(served, expected, strict=True))
            print(f"{length:>7} {counted / served_s:>13.0f} {counted / base_s:>20.0f} {base_s / served_s:>6.2f}x "
                  f"{counted / batched_s:>19.0f} {batched_s / served_s:>6.2f}x {diff:>11.1e}")
        long_input = texts(tokenizer, 1, args.long_tokens)[0]
        alone, _ = asyncio.run(chat_gaps(url, None))
        beside, running = asyncio.run(chat_gaps(url, long_input))
        for name, gaps in (("chat alone", alone), (f"chat beside a {args.long_tokens}-token embedding", beside)):
            print(f"{name}: gap between tokens median {statistics.median(gaps) * 1000:.0f} ms, worst {max(gaps) * 1000:.0f} ms")
        print(f"the embedding was {'still running' if running else 'done'} when the chat ended")
    finally:
        stop(proc)


if __name__ == "__main__":
    sys.exit(main())
