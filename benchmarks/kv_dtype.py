"""A half-precision KV pool under the float32 model against the float32 pool: decode speed at
long context, pool bytes, and how often greedy output stays the same.

    python benchmarks/kv_dtype.py [--context 2000] [--sequences 8] [--new-tokens 32] [--rounds 2]
        [--kv-dtype float16 bfloat16] [--shared-document]

The embedded SmolLM2-135M in float32, 2 threads, the native attention tier, one engine per
pool dtype, rounds interleaved (this machine's speed drifts). Each sequence holds its own
~--context-token document (distinct, so that their K/V are distinct memory: what a decode
step reads grows with every sequence's context), or with --shared-document one document
behind every question (its blocks shared through the prefix cache: read once, from cache).
Timed: the decode phase alone, from the step after every prompt has its first token to the
end, greedy with EOS ignored. Same timer, same prompts, same scheduler for every dtype.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvstream.hf.loader import load_model  # noqa: E402
from kvstream.hf.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from kvstream.hf.sampling import SamplingParams  # noqa: E402
from kvstream.scheduler import Sequence  # noqa: E402


def documents(tokenizer, context: int, n: int, shared: bool) -> list[list[int]]:
    """n prompts of about ``context`` tokens: one document each (or one for all), a question."""
    prompts = []
    for i in range(n):
        tag = 0 if shared else i
        sentence = f"Ledger {tag}: the harbour records list ship {tag}, its cargo, its crew and the weather of the day it sailed. "
        per_sentence = len(tokenizer(sentence)["input_ids"])
        document = sentence * max(1, context // per_sentence)
        prompts.append(tokenizer(f"{document}\nQuestion {i}: what did ship {i} carry?")["input_ids"])
    return prompts


def decode_phase(model, tokenizer, prompts, new_tokens: int, kv_dtype: str | None) -> tuple[float, int, list[list[int]], ModelRunner]:
    """(seconds, tokens, each sequence's tokens, the engine) of the decode phase alone."""
    engine = ModelRunner(
        model, tokenizer,
        RunnerConfig(block_size=16, num_blocks=sum(-(-(len(p) + new_tokens) // 16) for p in prompts) + 8, num_cpu_blocks=0, max_num_seqs=len(prompts),
                     attention="native", kv_dtype=kv_dtype),
    )
    tokens: list[list[int]] = [[] for _ in prompts]
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        def sink(events, i=i):
            tokens[i].extend(e.token_id for e in events if e.kind == "token")
        engine.add_request(Sequence(list(prompt), new_tokens), params, sink)
    while min(map(len, tokens)) == 0:
        engine.step()
    first = sum(map(len, tokens))
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start, sum(map(len, tokens)) - first, tokens, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-dtype", nargs="+", default=["float16"], choices=["float16", "bfloat16"])
    parser.add_argument("--shared-document", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model(None, device="cpu")
    prompts = documents(loaded.tokenizer, args.context, args.sequences, args.shared_document)
    print(f"{len(prompts)} sequences at ~{len(prompts[0])} tokens of context ({'one shared document' if args.shared_document else 'distinct documents'}), "
          f"{args.new_tokens} new tokens each, decode phase only, native tier")
    dtypes: list[str | None] = [None, *args.kv_dtype]
    speeds: dict[str | None, list[float]] = {d: [] for d in dtypes}
    outputs: dict[str | None, list[list[int]]] = {}
    pool_bytes: dict[str | None, int] = {}
    for _ in range(args.rounds):
        for dtype in dtypes:
            seconds, count, tokens, engine = decode_phase(loaded.model, loaded.tokenizer, prompts, args.new_tokens, dtype)
            assert engine.attention.name == "native", engine.attention
            speeds[dtype].append(count / seconds)
            outputs[dtype] = tokens
            pool_bytes[dtype] = engine.kv_shape.bytes_per_token(engine.kv_dtype)
            del engine
    base = max(speeds[None])
    print(f"{'KV pool':>9} {'decode tok/s by round':>28} {'best/fp32':>10} {'bytes/token':>12} {'same greedy tokens':>19}")
    for dtype in dtypes:
        same = sum(a == b for a, b in zip(outputs[dtype], outputs[None], strict=True))
        rounds = " / ".join(f"{s:.1f}" for s in speeds[dtype])
        print(f"{dtype or 'float32':>9} {rounds:>28} {max(speeds[dtype]) / base:>9.2f}x {pool_bytes[dtype]:>12,} {same:>12} of {len(prompts)}")


if __name__ == "__main__":
    main()
