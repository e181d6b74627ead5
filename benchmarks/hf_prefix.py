"""Prefix reuse in the in-process engine: TTFT for a long shared prefix plus a short question,
cold vs warm, against transformers reusing the same prefix through its own DynamicCache,
same model, same run.

    python benchmarks/hf_prefix.py [--prefix-tokens 2000] [--question-tokens 30] [--repeats 5]

* cold: a fresh prefix, nothing cached: the whole prompt is prefilled;
* warm: the same prefix as an earlier request, a new question: the engine finds the prefix's
  blocks in its cache and computes only the rest (the question plus the tail of the prefix
  that does not fill a whole block);
* plain: transformers' own forward over the whole prompt (what no reuse costs);
* DynamicCache: plain transformers holding the prefix's KV in a DynamicCache (computed
  beforehand, untimed), prefilling the question alone: transformers' own way to reuse a
  prefix, the baseline for warm. It is not a floor: it attends through the cache's
  concatenated tensors, and the engine's warm path can beat it.

TTFT is measured from handing the request to the engine to its first sampled token,
everything included (hashing, lookup, block allocation, the forward pass, sampling).
Medians over --repeats questions. Target: warm within 1.3x of the DynamicCache baseline.
Prints peak RSS.
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvstream.hf import compat  # noqa: E402
from kvstream.hf.model_runner import RunnerConfig, ModelRunner  # noqa: E402
from kvstream.hf.loader import load_model  # noqa: E402
from kvstream.hf.sampling import SamplingParams  # noqa: E402
from kvstream.scheduler import Sequence  # noqa: E402


def text_tokens(tokenizer, seed: int, n: int) -> list[int]:
    words = ["river", "engine", "quiet", "market", "seven", "glass", "north", "paper", "storm", "violet", "copper", "field"]
    text = " ".join(words[(seed * 31 + i * 7 + i // 5) % len(words)] for i in range(n * 2))
    return tokenizer(text).input_ids[:n]


def engine_ttft(engine: ModelRunner, prompt: list[int]) -> float:
    """Seconds from add_request to the first token, driving the engine on this thread."""
    first: list[float] = []
    start = time.perf_counter()
    engine.add_request(
        Sequence(prompt, 1), SamplingParams(max_tokens=1, temperature=0),
        lambda events: first.append(time.perf_counter()) if any(e.kind == "token" for e in events) and not first else None,
    )
    while engine.has_work():
        engine.step()
    return first[0] - start


def suffix_only(model, prefix: list[int], question: list[int]) -> float:
    """Prefill the question alone on top of the prefix's KV (computed beforehand, untimed)."""
    from transformers import DynamicCache

    name = compat.cache_kwarg(model)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([prefix]), use_cache=True, **{name: cache})
        start = time.perf_counter()
        out = model(torch.tensor([question]), use_cache=True, logits_to_keep=1, **{name: cache})
        int(out.logits[0, -1].argmax())
        return time.perf_counter() - start


def full_prefill(model, prompt: list[int]) -> float:
    """Plain transformers, no cache: the whole prompt, logits of the last token only."""
    with torch.inference_mode():
        start = time.perf_counter()
        int(model(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1].argmax())
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--question-tokens", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)

    loaded = load_model(None, device="cpu")
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(loaded.model.config._name_or_path, dtype=torch.float32).eval()
    tok = loaded.tokenizer
    engine = ModelRunner(
        loaded.model, tok,
        RunnerConfig(block_size=args.block_size, num_blocks=4096 // args.block_size * 4, num_cpu_blocks=0, max_num_seqs=4),
    )
    questions = [text_tokens(tok, 100 + i, args.question_tokens) for i in range(args.repeats + 1)]
    shared = text_tokens(tok, 1, args.prefix_tokens)
    engine_ttft(engine, text_tokens(tok, 99, 64))  # warm up kernels
    suffix_only(plain, shared[:64], questions[0])

    cold = [engine_ttft(engine, text_tokens(tok, 200 + i, args.prefix_tokens) + q) for i, q in enumerate(questions[1:])]
    engine_ttft(engine, shared + questions[0])  # the first request with the shared prefix
    hits_before = engine.counters.cached_tokens
    warm = [engine_ttft(engine, shared + q) for q in questions[1:]]
    reused = (engine.counters.cached_tokens - hits_before) / len(warm)
    dynamic = [suffix_only(plain, shared, q) for q in questions[1:]]
    plain_cold = [full_prefill(plain, shared + q) for q in questions[1:3]]

    c, w, dyn, pc = (statistics.median(x) * 1000 for x in (cold, warm, dynamic, plain_cold))
    print(f"SmolLM2-135M fp32 on CPU, {torch.get_num_threads()} threads; prefix {args.prefix_tokens} + question "
          f"{args.question_tokens} tokens, block size {args.block_size}, median of {args.repeats}")
    print(f"  plain transformers full prefill     {pc:9.1f} ms")
    print(f"  cold TTFT (full prefill)            {c:9.1f} ms   {c / pc:.2f}x plain")
    print(f"  warm TTFT (prefix from the cache)   {w:9.1f} ms   {reused:.0f} tokens reused per request")
    print(f"  transformers, prefix in a DynamicCache, question alone {dyn:9.1f} ms")
    print(f"  warm / DynamicCache {w / dyn:.2f}x (target <= 1.3x); cold / warm {c / w:.1f}x")
    print(f"  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB (two model copies loaded)")


if __name__ == "__main__":
    main()
