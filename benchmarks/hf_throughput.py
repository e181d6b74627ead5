"""In-process throughput: KVStream's paged engine vs sequential ``model.generate`` vs
transformers' own continuous batching (``generate_batch``), same model, same run.

    python benchmarks/hf_throughput.py [--concurrency 1 4 16] [--new-tokens 64] [--threads N]

At concurrency c, c chat requests of mixed prompt lengths (40 to 400 tokens) arrive at once
and each is decoded greedily for up to --new-tokens tokens. KVStream runs them with
max_num_seqs=c; transformers' continuous batching gets the same c requests and
max_requests_per_batch=c; the baseline runs them one after another with model.generate.
Throughput is output tokens (as each system really produced them) per wall-clock second.
Prints the ratios to the sequential baseline and peak RSS, and, against this machine's
measured matmul peak (a large fp32 ``torch.mm`` in the same run), the share of the roofline
each system's forward FLOPs reach (2 FLOP per non-embedding parameter per computed token,
prefill and decode; attention's own FLOPs left out, so the share is a lower bound).
"""

from __future__ import annotations

import argparse
import logging
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvstream.hf.model_runner import RunnerConfig, ModelRunner  # noqa: E402
from kvstream.hf.loader import chat_token_ids, load_model  # noqa: E402
from kvstream.hf.sampling import SamplingParams  # noqa: E402

TOPICS = ["the ocean", "a lighthouse keeper", "how bridges are built", "the history of tea", "a robot learning to paint",
          "volcanoes", "a chess tournament", "the first day of school"]


def chats(n: int) -> list[list[dict]]:
    """n single-message chats whose prompts run from about 40 to 400 tokens."""
    out = []
    for i in range(n):
        filler = " ".join(["Some background for context."] * (5 + (i * 37) % 60))
        out.append([{"role": "user", "content": f"{filler}\nWrite a long, detailed story about {TOPICS[i % len(TOPICS)]}."}])
    return out


def workload(tokenizer, n: int) -> list[list[int]]:
    """The token ids of ``chats(n)`` through the model's chat template."""
    return [chat_token_ids(tokenizer, messages) for messages in chats(n)]


def matmul_peak() -> float:
    """FLOP/s of a large fp32 matmul on this machine: the compute roofline."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    for _ in range(2):
        a @ b
    start, repeats = time.perf_counter(), 8
    for _ in range(repeats):
        a @ b
    return 2 * 2048**3 * repeats / (time.perf_counter() - start)


def forward_flops_per_token(model) -> float:
    """2 FLOP per parameter that multiplies (the embedding table only looks rows up)."""
    embedding = model.get_input_embeddings().weight
    return 2.0 * sum(p.numel() for p in model.parameters() if p is not embedding)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_kvstream(model, tokenizer, prompts, new_tokens) -> tuple[float, int]:
    engine = ModelRunner(
        model, tokenizer,
        RunnerConfig(block_size=16, num_blocks=2048, num_cpu_blocks=0, max_num_seqs=len(prompts), enable_prefix_caching=False),
    )
    start = time.perf_counter()
    outs = engine.generate_sync(prompts, SamplingParams(max_tokens=new_tokens, temperature=0))
    return time.perf_counter() - start, sum(len(o) for o in outs)


def run_sequential(model, tokenizer, prompts, new_tokens) -> tuple[float, int]:
    start = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
            produced += out.shape[1] - len(ids)
    return time.perf_counter() - start, produced


def run_generate_batch(model, tokenizer, prompts, new_tokens) -> tuple[float, int]:
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    cb = ContinuousBatchingConfig(num_blocks=256, max_batch_tokens=2048, max_requests_per_batch=len(prompts), use_async_batching=False)
    start = time.perf_counter()
    with torch.inference_mode():
        outs = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
    return time.perf_counter() - start, sum(len(o.generated_tokens) for o in outs.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-generate-batch", action="store_true")
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(None, device="cpu")
    engine_model, tokenizer = loaded.model, loaded.tokenizer
    from transformers import AutoModelForCausalLM

    folder = engine_model.config._name_or_path
    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    print(f"SmolLM2-135M fp32 on CPU, {torch.get_num_threads()} threads, up to {args.new_tokens} new tokens, greedy")
    # Warm every path once (first calls allocate and pick kernels).
    warm = workload(tokenizer, 2)
    run_kvstream(engine_model, tokenizer, warm, 4)
    run_sequential(plain, tokenizer, warm[:1], 4)
    if not args.skip_generate_batch:
        run_generate_batch(plain, tokenizer, warm, 4)

    peak = matmul_peak()
    per_token = forward_flops_per_token(plain)
    print(f"matmul peak (2048^3 fp32 torch.mm) {peak / 1e9:.0f} GFLOP/s; {per_token / 1e6:.0f} MFLOP per computed token")
    print(f"{'c':>3} {'system':<28} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs sequential':>14} {'of roofline':>12}")
    for c in args.concurrency:
        prompts = workload(tokenizer, c)
        rows = [("sequential model.generate", run_sequential(plain, tokenizer, prompts, args.new_tokens))]
        if not args.skip_generate_batch:
            rows.append(("transformers generate_batch", run_generate_batch(plain, tokenizer, prompts, args.new_tokens)))
        rows.append(("kvstream paged engine", run_kvstream(engine_model, tokenizer, prompts, args.new_tokens)))
        base = rows[0][1][1] / rows[0][1][0]
        computed = sum(len(p) for p in prompts)  # every system prefills each prompt once...
        for name, (seconds, tokens) in rows:
            rate = tokens / seconds
            share = (computed + tokens) * per_token / seconds / peak  # ...and computes each output token once
            print(f"{c:>3} {name:<28} {tokens:>7} {seconds:>8.2f} {rate:>8.1f} {rate / base:>13.2f}x {share:>11.1%}")
    print(f"peak RSS {rss_mb():.0f} MB (two model copies loaded)")


if __name__ == "__main__":
    main()
