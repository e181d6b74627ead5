"""Soak: thousands of mixed requests (streaming, non-streaming, aborted mid-stream, invalid,
past the context) at high concurrency through KVStream against an instant upstream. Reports
requests served, answers by kind, KV blocks leaked (must be 0), and KVStream's RSS and open
file descriptors at start and end (RSS growth must stay under 5%).

    python benchmarks/soak.py [--requests 5000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import Counter
from pathlib import Path

import aiohttp

from _util import PYTHON, free_port, spawn, stop, wait_http

CHAT = {"model": "bench", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
# too_long: max_tokens past any context. In front of a runtime it goes upstream as sent (the
# runtime judges it, as it would directly), counted as what one request can hold.
KINDS = [("stream", 50), ("json", 20), ("aborted", 10), ("invalid", 10), ("too_long", 10)]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def one(session: aiohttp.ClientSession, url: str, kind: str) -> str:
    endpoint = url + "/v1/chat/completions"
    try:
        if kind == "invalid":
            async with session.post(endpoint, data=b'{"model": "bench", "messages": [}', headers={"Content-Type": "application/json"}) as r:
                await r.read()
                return f"invalid->{r.status}"
        if kind == "too_long":
            async with session.post(endpoint, json=CHAT | {"max_tokens": 10**7}) as r:
                await r.read()
                return f"too_long->{r.status}"
        if kind == "aborted":
            async with session.post(endpoint, json=CHAT | {"stream": True}) as r:
                await r.content.readline()
                r.close()  # hang up mid-stream
                return "aborted"
        async with session.post(endpoint, json=CHAT | {"stream": kind == "stream"}) as r:
            body = await r.read()
            if kind == "stream" and not body.endswith(b"data: [DONE]\n\n"):
                return f"{kind}->truncated"
            return f"{kind}->{r.status}"
    except aiohttp.ClientError as exc:
        return f"{kind}->client error {exc.__class__.__name__}"


async def load(url: str, total: int, concurrency: int, seed: int) -> Counter:
    rng = random.Random(seed)
    kinds = [k for k, w in KINDS for _ in range(w)]
    counts: Counter = Counter()
    remaining = total
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                counts[await one(session, url, rng.choice(kinds))] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


async def status(url: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/status") as r:
            return await r.json()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    up_port, port = free_port(), free_port()
    upstream = spawn([PYTHON, "benchmarks/_instant_upstream.py", "--port", str(up_port)])
    proxy = spawn([PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", "openai", "--backend-url", f"http://127.0.0.1:{up_port}",
                   "--port", str(port), "--max-batch-size", "32", "--log-level", "error"],
                  env={"KVSTREAM_SCHEDULER__MAX_QUEUE_SIZE": "100000", "KVSTREAM_MEMORY__NUM_GPU_BLOCKS": "4096"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"http://127.0.0.1:{up_port}/v1/models", proc=upstream)
        wait_http(url + "/health", proc=proxy)
        await load(url, max(500, args.requests // 10), args.concurrency, args.seed + 1)  # warm-up: allocator, caches
        await asyncio.sleep(0.5)
        rss0, fds0 = rss_bytes(proxy.pid), open_fds(proxy.pid)
        start = time.perf_counter()
        counts = await load(url, args.requests, args.concurrency, args.seed)
        elapsed = time.perf_counter() - start
        await asyncio.sleep(1.0)  # let aborted requests finish their cleanup
        rss1, fds1 = rss_bytes(proxy.pid), open_fds(proxy.pid)
        snap = await status(url)
    finally:
        stop(proxy)
        stop(upstream)
    kv, queue = snap["kv"], snap["queue"]
    leaked = kv["blocks_used"]
    growth = (rss1 - rss0) / rss0
    print(f"\nsoak: {args.requests:,} mixed requests at concurrency {args.concurrency} in {elapsed:.1f}s ({args.requests / elapsed:,.0f} req/s)\n")
    for answer, n in sorted(counts.items()):
        print(f"  {answer:<40} {n:>6,}")
    print(f"\n  KV blocks still held: {leaked} (running {queue['running']}, waiting {queue['waiting']})")
    print(f"  RSS: {rss0 / 1e6:.1f} MB -> {rss1 / 1e6:.1f} MB ({growth:+.1%}, limit +5%)")
    print(f"  open file descriptors: {fds0} -> {fds1}")
    ok = leaked == 0 and growth < 0.05 and not any("client error" in k or "truncated" in k or "->5" in k for k in counts)
    print(f"\n{'PASS' if ok else 'FAIL'}")
    print(json.dumps({"requests": args.requests, "answers": counts, "blocks_leaked": leaked, "rss_start": rss0, "rss_end": rss1, "fds_start": fds0, "fds_end": fds1}))


if __name__ == "__main__":
    asyncio.run(main())
