"""What KVStream adds on top of an instant upstream: latency (p50/p99, TTFT for streams),
requests/s and streams/s, and the proxy's CPU time per request; direct vs through KVStream,
at concurrency 1, 32 and 128, streaming and not. Every request goes through the scheduler.

    python benchmarks/proxy_overhead.py [--requests 2000] [--tokens 8]

The upstream and KVStream run as separate processes; the load generator is this process.
On a 2-core machine the three compete for CPU, so absolute numbers are pessimistic; the
ratios are measured in the same run on the same box.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp

from _util import PYTHON, cpu_seconds, free_port, percentile, spawn, stop, wait_http

BODY = {"model": "bench", "messages": [{"role": "user", "content": "Say something short."}], "max_tokens": 8}


async def run_load(url: str, concurrency: int, total: int, stream: bool) -> dict:
    """Closed-loop load: ``concurrency`` workers send ``total`` requests in all."""
    latencies: list[float] = []
    ttfts: list[float] = []
    errors = 0
    body = json.dumps(BODY | {"stream": stream}).encode()
    headers = {"Content-Type": "application/json"}
    remaining = total
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                start = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", data=body, headers=headers) as resp:
                    if stream:
                        first = None
                        async for line in resp.content:
                            if first is None and b't0 ' in line:
                                first = time.perf_counter()
                        if first is not None:
                            ttfts.append(first - start)
                    else:
                        await resp.read()
                    if resp.status != 200:
                        errors += 1
                latencies.append(time.perf_counter() - start)

        wall = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - wall
    return {
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "ttft_p50_ms": percentile(ttfts, 50) * 1000 if stream else None,
        "rps": total / wall,
        "errors": errors,
    }


def fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:,.2f}{unit}" if v < 100 else f"{v:,.0f}{unit}"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests per cell (c=1 uses a fifth)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per response")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 128])
    args = parser.parse_args()

    up_port, proxy_port = free_port(), free_port()
    upstream = spawn([PYTHON, "benchmarks/_instant_upstream.py", "--port", str(up_port), "--tokens", str(args.tokens)])
    proxy = spawn(
        [PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", "openai", "--backend-url", f"http://127.0.0.1:{up_port}",
         "--port", str(proxy_port), "--max-batch-size", "512", "--log-level", "warning"],
        env={"KVSTREAM_SCHEDULER__MAX_QUEUE_SIZE": "100000", "KVSTREAM_MEMORY__NUM_GPU_BLOCKS": "20000"},
    )
    direct_url, proxy_url = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{proxy_port}"
    try:
        wait_http(direct_url + "/v1/models", proc=upstream)
        wait_http(proxy_url + "/health", proc=proxy)
        await run_load(proxy_url, 8, 200, False)  # warm both paths
        await run_load(proxy_url, 8, 200, True)
        rows = []
        for stream in (False, True):
            for c in args.concurrency:
                n = max(200, args.requests // 5) if c == 1 else args.requests
                d = await run_load(direct_url, c, n, stream)
                cpu0 = cpu_seconds(proxy.pid)
                p = await run_load(proxy_url, c, n, stream)
                cpu_ms = (cpu_seconds(proxy.pid) - cpu0) / n * 1000
                rows.append((stream, c, d, p, cpu_ms))
        print(f"\nKVStream proxy overhead vs direct (instant upstream, {args.tokens} tokens/response)\n")
        header = f"{'mode':<7}{'conc':>5} | {'direct p50':>10} {'proxy p50':>10} {'added p50':>10} | {'direct p99':>10} {'proxy p99':>10} | {'TTFT d/p':>14} | {'direct r/s':>10} {'proxy r/s':>10} {'ratio':>6} | {'CPU/req':>8} | err"
        print(header)
        print("-" * len(header))
        for stream, c, d, p, cpu_ms in rows:
            ttft = f"{fmt(d['ttft_p50_ms'])}/{fmt(p['ttft_p50_ms'])}" if stream else "-"
            print(
                f"{'stream' if stream else 'json':<7}{c:>5} | {fmt(d['p50_ms'])+'ms':>10} {fmt(p['p50_ms'])+'ms':>10} {fmt(p['p50_ms'] - d['p50_ms'])+'ms':>10} | "
                f"{fmt(d['p99_ms'])+'ms':>10} {fmt(p['p99_ms'])+'ms':>10} | {ttft:>14} | {fmt(d['rps']):>10} {fmt(p['rps']):>10} {p['rps'] / d['rps']:>6.2f} | "
                f"{cpu_ms:>6.2f}ms | {d['errors'] + p['errors']}"
            )
        print("\nratio = proxy throughput / direct throughput; CPU/req = KVStream process CPU time per request.")
        print("Targets (issue 2): < 1 ms added at c=1; >= 3,000 req/s and >= 1,000 streams/s from one process.")
    finally:
        stop(proxy)
        stop(upstream)


if __name__ == "__main__":
    asyncio.run(main())
