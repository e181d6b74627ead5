"""What a request costs KVStream's scheduler as the queue in front of a runtime grows.

    python benchmarks/queue_cost.py [--depths 0 64 256 1024] [--requests 2000] [--batch 8]

In front of a runtime with ``--batch`` slots (KVStream's default: 8) and ``depth`` requests
already waiting, each cycle is what the server does for one request under sustained load: a
running request finishes (its slot frees and the next waiting one is admitted, lpm choosing
the one whose prefix an idle slot holds) and a new one arrives (queued behind the others).
The prompts are what a busy server sees: four system prompts shared by many users, each
with a question of its own (~120 tokens, 7 blocks). Reported: the event loop's CPU time per
request, and its ratio to the same cycle with nothing waiting (depth 0), measured in the
same run. Nothing goes over the network: the runtime is never called, so this is the
scheduling alone (queueing, ordering, admission, the slot model, the block manager)."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstream.backends.openai_compat import OpenAICompatibleBackend  # noqa: E402
from kvstream.config import Settings  # noqa: E402
from kvstream.engine import KVStreamEngine  # noqa: E402
from kvstream.types import GenerateRequest  # noqa: E402

SYSTEM_PROMPTS = [f"You are assistant number {i}. " + "Answer briefly and politely, citing sources. " * 8 for i in range(4)]


def request(rng: random.Random, i: int) -> GenerateRequest:
    system = rng.choice(SYSTEM_PROMPTS)
    question = f"Question {i}: what is {rng.randrange(10**6)} plus {rng.randrange(10**6)}?"
    return GenerateRequest(model="m", messages=[{"role": "system", "content": system},
                                                {"role": "user", "content": question}], max_tokens=64)


async def cost_per_request(depth: int, requests: int, batch: int) -> float:
    """Microseconds of CPU per request with ``depth`` waiting (the median of three runs)."""
    settings = Settings()
    settings.scheduler.max_batch_size = batch
    settings.scheduler.max_queue_size = depth + batch + 16
    settings.memory.num_gpu_blocks = 1 << 16
    engine = KVStreamEngine(OpenAICompatibleBackend("http://127.0.0.1:9", "m"), settings)
    rng = random.Random(0)
    running = [await engine.submit(request(rng, i)) for i in range(batch + depth)]
    prepared = [request(rng, batch + depth + i) for i in range(3 * requests)]
    runs = []
    for r in range(3):
        start = time.process_time()
        for i in range(requests):
            # The oldest admitted request finishes: its slot goes to a waiting one.
            gen = next(g for g in running if g.ticket.done())
            running.remove(gen)
            gen.finish_reason = "stop"
            gen.close()
            running.append(await engine.submit(prepared[r * requests + i]))
        runs.append((time.process_time() - start) / requests * 1e6)
        assert len(engine.scheduler.waiting) == depth and len(engine.scheduler.running) == batch
    for gen in running:
        gen.close()
    return sorted(runs)[1]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 64, 256, 1024])
    parser.add_argument("--requests", type=int, default=2000, help="requests per run (three runs per depth)")
    parser.add_argument("--batch", type=int, default=8, help="the runtime's slots (KVStream's default batch: 8)")
    args = parser.parse_args()
    depths = sorted(set([0, *args.depths]))
    costs = {d: await cost_per_request(d, args.requests, args.batch) for d in depths}
    print(f"\nScheduling cost per request, {args.batch} slots, lpm (KVStream's default in front of a runtime)\n")
    print(f"{'waiting':>8} | {'CPU us/request':>14} | {'x depth 0':>9}")
    for d in depths:
        print(f"{d:>8} | {costs[d]:>14.1f} | {costs[d] / costs[0]:>9.2f}")


if __name__ == "__main__":
    asyncio.run(main())
