"""The in-process engine as users run it: ``kvstream serve --backend hf`` with its defaults,
driven by the official ``openai`` client, against sequential ``model.generate`` on the same
prompts, in the same run.

    python benchmarks/hf_serving.py [--concurrency 1 16] [--new-tokens 64] [--compare-batch 8]

At concurrency c, c chats (``hf_throughput``'s workload: prompts of 40 to 400 tokens) are sent
at once, each greedy for up to --new-tokens tokens; throughput is the completion tokens the
server reports (usage) per wall-clock second, from the first request sent to the last answer
read. The baseline runs the same chats' template ids through ``model.generate`` one after
another (fp32, SDPA; the server is idle meanwhile, and both use torch's default threads).
``--compare-batch N`` also runs the server with ``--max-batch-size N`` (8 was the default
before the batch was sized from the pool), to show what the sizing buys at c=16.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import urllib.request

from _util import PYTHON, free_port, spawn, stop, wait_http
from hf_throughput import chats, run_sequential, workload


async def run_clients(url: str, conversations: list[list[dict]], new_tokens: int) -> tuple[float, int]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:

        async def one(messages):
            resp = await client.chat.completions.create(model="smollm2", messages=messages, max_tokens=new_tokens, temperature=0)
            return resp.usage.completion_tokens

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(m) for m in conversations))
        return time.perf_counter() - start, sum(tokens)


def serve(extra: list[str]) -> tuple[object, str]:
    port = free_port()
    proc = spawn([PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", "hf", "--port", str(port), *extra], log=f"/tmp/kvstream-hf-serving-{port}.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", timeout=300, proc=proc)
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--compare-batch", type=int, default=None)
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import torch
    from transformers import AutoModelForCausalLM

    from kvstream.hf.loader import load_model

    loaded = load_model(None, device="cpu")  # converts the embedded GGUF once (cached), as the server does
    folder = loaded.model.config._name_or_path
    tokenizer = loaded.tokenizer
    del loaded
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    run_sequential(plain, tokenizer, workload(tokenizer, 1), 4)  # warm the baseline's kernels

    servers = {"kvstream serve (defaults)": []}
    if args.compare_batch:
        servers[f"kvstream serve --max-batch-size {args.compare_batch}"] = ["--max-batch-size", str(args.compare_batch)]
    results: dict[tuple[str, int], tuple[float, int]] = {}
    engines: dict[str, dict] = {}  # each server's /status backend section after its runs
    for name, extra in servers.items():
        proc, url = serve(extra)
        try:
            asyncio.run(run_clients(url, chats(2), 4))  # warm the server's kernels
            for c in args.concurrency:
                results[(name, c)] = asyncio.run(run_clients(url, chats(c), args.new_tokens))
            with urllib.request.urlopen(url + "/status", timeout=30) as resp:
                engines[name] = json.load(resp)["backend"]
        finally:
            stop(proc)
    print(f"SmolLM2-135M fp32 on CPU, {torch.get_num_threads()} threads, up to {args.new_tokens} new tokens, greedy")
    print(f"{'c':>3} {'system':<38} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs sequential':>14}")
    for c in args.concurrency:
        seconds, tokens = run_sequential(plain, tokenizer, workload(tokenizer, c), args.new_tokens)
        base = tokens / seconds
        print(f"{c:>3} {'sequential model.generate':<38} {tokens:>7} {seconds:>8.2f} {base:>8.1f} {1:>13.2f}x")
        for name in servers:
            seconds, tokens = results[(name, c)]
            rate = tokens / seconds
            print(f"{c:>3} {name:<38} {tokens:>7} {seconds:>8.2f} {rate:>8.1f} {rate / base:>13.2f}x")
    prompt_tokens = sum(len(p) for c in args.concurrency for p in workload(tokenizer, c)) + sum(map(len, workload(tokenizer, 2)))
    for name, info in engines.items():
        # The server's prefix cache is on by default: prompts sharing a head with an earlier
        # one (these chats share their filler) prefill only the rest; the baseline has none.
        print(f"{name}: attention tier {info['attention_backend']}, matmul {info['matmul_backend']}; prefilled {info['prefill_tokens']} of {prompt_tokens} "
              f"prompt tokens sent (warm-up included), the rest served by the prefix cache")


if __name__ == "__main__":
    sys.exit(main())
