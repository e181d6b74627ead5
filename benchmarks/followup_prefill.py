"""A follow-up turn after a cached conversation, end to end: time to the first token when the
native tier reads the new tokens' chunk in place (chunks of up to ``NATIVE_CHUNK_MAX``
tokens) against the old limit of 8 tokens (longer chunks gather the context and run SDPA),
same engine, same run, rounds alternating.

    python benchmarks/followup_prefill.py [--cached 2000] [--rounds 4]

The embedded SmolLM2-135M, float32, 2 threads. The cached head is block-aligned and every
request's tail starts with a tag of its own, so each one hits exactly the head and computes
its tail; the script checks that. Prints best and median TTFT per tail length and limit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvstream.hf import HFEngine, attention  # noqa: E402

OLD_LIMIT = 8  # the limit before chunks were tiled (one kernel row at a time)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cached", type=int, default=2000, help="tokens of cached conversation (a multiple of 16)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(2)
    engine = HFEngine.from_pretrained(None, device="cpu", dtype="float32", max_cache_bytes=512 * 2**20)
    if engine.engine.attention.name != "native":
        sys.exit(f"the native tier is not running here: {engine.engine.attention}")
    words = " ".join(f"fact{i} is {i * 7 % 13}." for i in range(args.cached // 2))
    head = engine.tokenizer.decode(engine.encode(words)[: args.cached])
    engine.generate(head, max_new_tokens=1)  # the conversation so far, cached
    limits = (OLD_LIMIT, attention.NATIVE_CHUNK_MAX)
    tails = (12, 30, 60)  # words; each tokenizes to about three times as many tokens
    times: dict[tuple[int, int], list[float]] = {}
    new_tokens: dict[int, int] = {}
    try:
        for r in range(args.rounds):
            for limit in limits:
                attention.NATIVE_CHUNK_MAX = limit
                for words_in_tail in tails:
                    tail = f" [{r}.{limit}.{words_in_tail}] " + " ".join(f"w{j}" for j in range(words_in_tail))
                    out = engine.generate(head + tail, max_new_tokens=1)
                    if out.cached_tokens > args.cached:
                        sys.exit(f"the tail hit the cache ({out.cached_tokens} cached tokens): the A/B would be void")
                    new_tokens[words_in_tail] = out.prompt_tokens - out.cached_tokens
                    times.setdefault((limit, words_in_tail), []).append(out.ttft_ms)
    finally:
        attention.NATIVE_CHUNK_MAX = limits[1]
    print(f"{args.cached} cached tokens, native tier, {args.rounds} rounds; TTFT best / median ms")
    print(f"{'new tokens':>10} " + " ".join(f"{f'limit {limit}':>16}" for limit in limits) + f" {'ratio (best)':>13}")
    for words_in_tail in tails:
        cells = [times[(limit, words_in_tail)] for limit in limits]
        shown = " ".join(f"{min(c):>7.0f} / {statistics.median(c):>6.0f}" for c in cells)
        print(f"{new_tokens[words_in_tail]:>10} {shown} {min(cells[0]) / min(cells[1]):>12.2f}x")


if __name__ == "__main__":
    main()
