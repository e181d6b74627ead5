"""KV reuse in the in-process engine against KVBoost (pip install kvboost), same model
(SmolLM2-135M, fp32, CPU), same workloads, same run.

    python benchmarks/reuse.py [--quick] [--no-kvboost]

(a) a ~1,000-token system prompt + a question: full prefill, cold, warm, and the suffix-only
    limit (prefilling just the uncached tail, no context);
(b) a multi-turn replay, 5 conversations x 6 turns, each turn's prompt = the history with the
    model's own replies + a new user message: per-turn TTFT and reuse;
(c) RAG, 4 documents of ~400 tokens, seen once in one order, then asked about in shuffled
    orders: TTFT and quality against full prefill (greedy token agreement over 16 tokens,
    first divergence, first-token KL) for blend (repair 0.15), blend without repair, and
    KVBoost's cacheblend and selective;
(d) spilled blocks at full precision, int8 and int4: bytes per block and quality after a
    round trip through the host tier (first-token agreement and KL vs no reuse).

Every TTFT is measured from the call: tokenizing, lookup, moves, repair, forward and
sampling are included; KVStream writes nothing after the answer. KVBoost runs in a child
process (it patches attention globally) on its own copy of the same fp32 weights, handed to
its InferenceEngine as a model object, timed with the same clock from the call to its first
token (its on_token callback), in ``none`` mode (no recompute) for the exact-prefix
workloads (a) and (b), and in its cacheblend and selective modes for the RAG case (c).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from kvstream.hf.model_runner import RunnerConfig  # noqa: E402
from kvstream.hf.kv_store import BlockCodec  # noqa: E402
from kvstream.hf.loader import load_model  # noqa: E402
from kvstream.hf import HFEngine  # noqa: E402

GEN = 16

SUBJECTS = ["the river authority", "the northern rail line", "the city archive", "the glass works", "the harbour board",
            "the weather service", "the copper mine", "the seed bank", "the observatory", "the ferry company"]
VERBS = ["reported", "recorded", "announced", "measured", "estimated", "confirmed", "published", "noted"]
THINGS = ["a rise in traffic", "a fall in costs", "a new record", "an unusual delay", "a change of schedule",
          "higher water levels", "a shortage of parts", "a surplus of grain", "a drop in visitors", "a longer season"]


def document(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    parts = [f"Report {seed}."]
    for _ in range(sentences):
        parts.append(
            f"In {rng.randint(1900, 2024)}, {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(THINGS)} "
            f"of {rng.randint(2, 97)} percent near kilometre {rng.randint(1, 900)}."
        )
    return " ".join(parts)


def workloads(quick: bool) -> dict:
    system = "You are a meticulous analyst. " + " ".join(document(900 + i, 4) for i in range(9 if not quick else 4))
    questions = [f"Question {i}: summarise report {900 + i} in one sentence." for i in range(3)]
    docs = [document(i, 22 if not quick else 8) for i in range(4)]
    rag_orders = [[3, 1, 0, 2], [2, 0, 3, 1], [1, 3, 2, 0]][: 1 if quick else 3]
    turns = [f"Tell me about report {100 + i}." for i in range(6)]
    return {"system": system, "questions": questions, "docs": docs, "rag_orders": rag_orders,
            "convs": 2 if quick else 5, "turns": turns, "conv_system": "You are a helpful assistant. " + document(77, 6),
            "d_prompts": 6 if quick else 20}


def rag_text(docs: list[str], order: list[int]) -> str:
    return "\n\n".join(docs[i] for i in order) + "\n\nQuestion: which report mentions the ferry company first? Answer:"


def agreement(a: list[int], b: list[int]) -> tuple[float, int | None]:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return sum(x == y for x, y in zip(a, b)) / max(len(a), len(b), 1), first


def kl(p_logits, q_logits) -> float:
    p = torch.log_softmax(torch.as_tensor(p_logits).double().flatten(), -1)
    q = torch.log_softmax(torch.as_tensor(q_logits).double().flatten(), -1)
    return float((p.exp() * (p - q)).sum())


# ------------------------------------------------------------------ KVStream
def make(loaded, strategy: str = "none", caching: bool = True, **config) -> HFEngine:
    cfg = dict(block_size=16, num_blocks=4096, num_cpu_blocks=0, max_num_seqs=4, enable_prefix_caching=caching, model_identity="bench")
    cfg.update(config)
    return HFEngine(loaded, RunnerConfig(**cfg), recompute_strategy=strategy)


def section_a(loaded, w) -> dict:
    tok = loaded.tokenizer
    prompts = [w["system"] + "\n" + q for q in w["questions"]]
    plain = make(loaded, caching=False)
    full = statistics.median(plain.generate(p, 1).ttft_ms for p in prompts)
    engine = make(loaded)
    cold = engine.generate(prompts[0], 1)
    warm = [engine.generate(p, 1) for p in prompts[1:]]
    # The least reuse can cost: prefilling just the uncached tail, with no context at all.
    tails = [tok(p).input_ids[r.cached_tokens :] for p, r in zip(prompts[1:], warm)]
    limit = statistics.median(plain._run([t], [_greedy(1)])[0].ttft_ms for t in tails)
    return {"prompt_tokens": cold.prompt_tokens, "full_ms": full, "cold_ms": cold.ttft_ms,
            "warm_ms": statistics.median(r.ttft_ms for r in warm), "limit_ms": limit,
            "warm_reuse": statistics.median(r.kv_reuse_ratio for r in warm)}


def section_b(loaded, w, engine: HFEngine | None = None) -> list[list[dict]]:
    """Per conversation, per turn: TTFT and reuse (the model's own greedy replies go back in)."""
    engine = engine or make(loaded)
    out = []
    for c in range(w["convs"]):
        messages = [{"role": "system", "content": w["conv_system"] + f" Conversation {c}."}]
        rows = []
        computed: list[int] = []  # what the last turn computed: its prompt and reply but the last token
        for turn in w["turns"]:
            messages.append({"role": "user", "content": turn})
            prompt = engine.encode(messages)
            common = next((i for i, (a, b) in enumerate(zip(computed, prompt)) if a != b), min(len(computed), len(prompt)))
            r = engine.generate(messages, GEN)
            rows.append({"ttft_ms": r.ttft_ms, "reuse": r.kv_reuse_ratio, "prompt_tokens": r.prompt_tokens,
                         "ceiling": min(common, len(prompt) - 1) / len(prompt)})
            messages.append({"role": "assistant", "content": r.output_text})
            computed = prompt + r.token_ids[:-1]
        out.append(rows)
    return out


def section_c(loaded, w) -> dict:
    docs = w["docs"]
    plain = make(loaded, caching=False)
    results: dict[str, list[dict]] = {"full": [], "blend 0.15": [], "blend, no repair": [], "exact only": []}
    for order in w["rag_orders"]:
        text = rag_text(docs, order)
        reference = plain._run([plain.encode(text)], [_greedy()], keep_logits=True)[0]
        results["full"].append({"ttft_ms": reference.ttft_ms, "agree": 1.0, "first_div": None, "kl": 0.0, "reuse": 0.0})
        for name, strategy in (("blend 0.15", "cacheblend"), ("blend, no repair", "selective"), ("exact only", "none")):
            engine = make(loaded, strategy)
            engine.generate(rag_text(docs, [0, 1, 2, 3]), 1)  # the documents were seen before, in another order
            engine.generate(rag_text(docs, [0, 1, 2, 3]), 1)  # and the cost model has measured a prefill
            r = engine._run([engine.encode(text)], [_greedy()], keep_logits=True)[0]
            agree, first = agreement(reference.token_ids, r.token_ids)
            results[name].append({"ttft_ms": r.ttft_ms, "agree": agree, "first_div": first,
                                  "kl": kl(reference.first_token_logits, r.first_token_logits), "reuse": r.kv_reuse_ratio})
    return results


def section_d(loaded, w) -> dict:
    tok = loaded.tokenizer
    prompts = [w["system"][: 400 + 37 * i] + f"\nQuestion {i}: what was reported?" for i in range(w["d_prompts"])]
    plain = make(loaded, caching=False)
    reference = [plain._run([plain.encode(p)], [_greedy()], keep_logits=True)[0] for p in prompts]
    shape = plain.engine.kv_shape
    pool_blocks = 40
    # Fills the pool but one block: every prompt's blocks are pushed out to the host tier.
    flusher = tok(" ".join(document(5000 + i, 4) for i in range(12))).input_ids[: (pool_blocks - 1) * 16 - 1]
    out = {}
    for bits in (None, 8, 4):
        codec = BlockCodec(shape.num_layers, 16, shape.num_kv_heads, shape.head_dim, plain.engine.kv_dtype, bits)
        fp16 = BlockCodec(shape.num_layers, 16, shape.num_kv_heads, shape.head_dim, torch.float16, None)
        engine = make(loaded, num_blocks=pool_blocks, host_cache_bytes=512 * 1024**2, kv_cache_bits=bits)
        firsts, kls, agrees = [], [], []
        for p, ref in zip(prompts, reference):
            engine.generate(p, 1)
            engine._run([flusher], [_greedy(1)])
            r = engine._run([engine.encode(p)], [_greedy()], keep_logits=True)[0]
            firsts.append(r.token_ids[0] == ref.token_ids[0])
            kls.append(kl(ref.first_token_logits, r.first_token_logits))
            agrees.append(agreement(ref.token_ids, r.token_ids)[0])
        out[str(bits or "fp")] = {
            "bytes_vs_model": codec.record_bytes / codec.full_precision_bytes,
            "bytes_vs_fp16": codec.record_bytes / fp16.record_bytes,
            "restored_blocks": engine.engine.counters.restored_blocks,
            "first_token_agreement": sum(firsts) / len(firsts), "kl": statistics.median(kls), "agreement": statistics.mean(agrees),
        }
    return out


def _greedy(max_tokens: int = GEN):
    from kvstream.hf.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


# ------------------------------------------------------------------- KVBoost
def kvboost_worker(model_dir: str, w: dict) -> dict:
    """Runs in a child process: the same workloads through KVBoost's public API, on the same
    fp32 weights KVStream runs (a model object handed to its InferenceEngine: its own
    from_pretrained loads fp16 on CPU), in its best mode for each workload (``none``, no
    recompute, where the reuse is an exact prefix; cacheblend and selective for moved RAG
    documents), and timed as KVStream is: from the call to the first token (its on_token
    callback), not by its own ttft_ms."""
    from kvboost.engine import InferenceEngine, RecomputeStrategy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def engine(strategy: str = "none", bits: int = 16):
        return InferenceEngine(
            model, tokenizer, max_cache_bytes=2 * 1024**3, chunk_size=128,
            recompute_strategy=RecomputeStrategy(strategy), kv_cache_bits=bits, device="cpu",
        )

    def timed(fn, *args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        return result, (time.perf_counter() - start) * 1000

    def first_token(e, prompt: str, max_new_tokens: int):
        """(result, ms from the call to the first sampled token, ms to the end)."""
        firsts: list[float] = []
        start = time.perf_counter()
        result = e.generate(prompt, max_new_tokens=max_new_tokens, on_token=lambda _t: firsts.append(time.perf_counter()))
        end = time.perf_counter()
        return result, (firsts[0] - start) * 1000, (end - start) * 1000

    out: dict = {}
    prompts = [w["system"] + "\n" + q for q in w["questions"]]
    e = engine("none")
    _, cold_ms, _ = first_token(e, prompts[0], 1)
    _, warm_write_ms = timed(e.warm, w["system"])
    warm = [first_token(e, p, 1) for p in prompts[1:]]
    out["a"] = {"cold_ms": cold_ms, "warm_ms": statistics.median(ms for _, ms, _ in warm),
                "warm_reuse": statistics.median(r.kv_reuse_ratio for r, _, _ in warm), "warm_write_ms": warm_write_ms}

    e = engine("none")
    tok = e.tokenizer
    convs = []
    for c in range(w["convs"]):
        messages = [{"role": "system", "content": w["conv_system"] + f" Conversation {c}."}]
        rows = []
        for turn in w["turns"]:
            messages.append({"role": "user", "content": turn})
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            r, ttft_ms, wall = first_token(e, text, GEN)
            rows.append({"ttft_ms": ttft_ms, "reuse": r.kv_reuse_ratio, "wall_ms": wall})
            messages.append({"role": "assistant", "content": r.output_text})
        convs.append(rows)
    out["b"] = convs

    out["c"] = {}
    for strategy in ("cacheblend", "selective"):
        rows = []
        for order in w["rag_orders"]:
            e = engine(strategy)
            for i in range(4):
                e.warm(w["docs"][i])
            r, ttft_ms, wall = first_token(e, rag_text(w["docs"], order), GEN)
            rows.append({"ttft_ms": ttft_ms, "wall_ms": wall, "reuse": r.kv_reuse_ratio, "text": r.output_text,
                         "logits": r.first_token_logits.tolist() if r.first_token_logits is not None else None})
        out["c"][strategy] = rows
    return out


def run_kvboost(model_dir: str, w: dict) -> dict | None:
    try:
        import kvboost  # noqa: F401
    except ImportError:
        print("kvboost is not installed (pip install kvboost): its columns are skipped")
        return None
    proc = subprocess.run(
        [sys.executable, __file__, "--kvboost-worker", model_dir, "--workloads", json.dumps(w)],
        capture_output=True, text=True, timeout=3600,
    )
    if proc.returncode != 0:
        print("KVBoost failed:", proc.stderr[-2000:])
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -------------------------------------------------------------------- report
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    parser.add_argument("--no-kvboost", action="store_true")
    parser.add_argument("--kvboost-results", help="reuse KVBoost's results saved here by an earlier run of the same workloads (it takes ~10 min)")
    parser.add_argument("--sections", default="abcd", help="which of the sections a-d to run (default: all)")
    parser.add_argument("--kvboost-worker", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kvboost_worker:
        print(json.dumps(kvboost_worker(args.kvboost_worker, json.loads(args.workloads))))
        return

    w = workloads(args.quick)
    loaded = load_model(None, device="cpu")
    kvb = None
    saved = Path(args.kvboost_results) if args.kvboost_results else None
    if saved is not None and saved.exists() and json.loads(saved.read_text()).get("workloads") == w:
        kvb = json.loads(saved.read_text())["results"]
        print(f"KVBoost: results of an earlier run on the same workloads ({saved})")
    elif not args.no_kvboost:
        kvb = run_kvboost(loaded.model.config._name_or_path, w)
        if kvb is not None and saved is not None:
            saved.write_text(json.dumps({"workloads": w, "results": kvb}))

    for section, report in (("a", report_a), ("b", report_b), ("c", report_c), ("d", report_d)):
        if section in args.sections:
            report(loaded, w, kvb)


def report_a(loaded, w: dict, kvb: dict | None) -> None:
    a = section_a(loaded, w)
    print(f"\n(a) system prompt + question ({a['prompt_tokens']} tokens), TTFT from the call")
    print(f"  full prefill {a['full_ms']:,.0f} ms | KVStream cold {a['cold_ms']:,.0f} ms, warm {a['warm_ms']:,.0f} ms "
          f"(reuse {a['warm_reuse']:.0%}) | suffix-only prefill {a['limit_ms']:,.0f} ms (the uncached tail alone, without even "
          f"attending to the prefix: a lower bound) -> warm/suffix {a['warm_ms'] / a['limit_ms']:.2f}x (target <= 1.3x), "
          f"full/warm {a['full_ms'] / a['warm_ms']:.1f}x")
    if kvb:
        k = kvb["a"]
        print(f"  KVBoost cold {k['cold_ms']:,.0f} ms, warm {k['warm_ms']:,.0f} ms (reuse {k['warm_reuse']:.0%}), "
              f"plus warm() write {k['warm_write_ms']:,.0f} ms")


def report_b(loaded, w: dict, kvb: dict | None) -> None:
    b = section_b(loaded, w)
    plain_b = section_b(loaded, w, make(loaded, caching=False))
    print(f"\n(b) multi-turn replay, {w['convs']} conversations x {len(w['turns'])} turns: median per turn")
    print(f"  {'turn':>4} | {'prompt':>6} | {'full ms':>8} | {'KVStream ms':>11} {'reuse':>6} {'ceiling':>7} | {'KVBoost ms':>10} {'reuse':>6} {'wall ms':>8}")
    for t in range(len(w["turns"])):
        col = lambda rows, key: statistics.median(conv[t][key] for conv in rows)  # noqa: E731
        line = (f"  {t + 1:>4} | {col(b, 'prompt_tokens'):>6.0f} | {col(plain_b, 'ttft_ms'):>8,.0f} | {col(b, 'ttft_ms'):>11,.0f} "
                f"{col(b, 'reuse'):>6.0%} {(format(col(b, 'ceiling'), '.0%') if t else '-'):>7} |")
        if kvb:
            line += f" {col(kvb['b'], 'ttft_ms'):>10,.0f} {col(kvb['b'], 'reuse'):>6.0%} {col(kvb['b'], 'wall_ms'):>8,.0f}"
        print(line)
    late = [conv[t]["reuse"] for conv in b for t in range(2, len(w["turns"]))]
    print(f"  KVStream reuse from turn 3 on: min {min(late):.0%}, median {statistics.median(late):.0%} (target >= 95%)")
    print("  ceiling = the most any exact reuse can serve: the common token prefix with what the previous turn")
    print("  computed (the new user message and the reply's last token, never fed back, are always new)")


def report_c(loaded, w: dict, kvb: dict | None) -> None:
    tok = loaded.tokenizer
    c = section_c(loaded, w)
    n_tokens = len(tok(rag_text(w["docs"], w["rag_orders"][0])).input_ids)
    print(f"\n(c) RAG, 4 documents in shuffled order ({n_tokens} tokens), {len(w['rag_orders'])} orders; vs full prefill")
    print(f"  {'method':<22} | {'TTFT ms':>8} {'speedup':>7} | {'reuse':>6} | {'agreement':>9} {'first div':>9} | {'first-token KL':>14}")
    full_ms = statistics.median(r["ttft_ms"] for r in c["full"])
    for name, rows in c.items():
        ms = statistics.median(r["ttft_ms"] for r in rows)
        divs = [r["first_div"] for r in rows if r["first_div"] is not None]
        print(f"  {name:<22} | {ms:>8,.0f} {full_ms / ms:>6.2f}x | {statistics.mean(r['reuse'] for r in rows):>6.0%} | "
              f"{statistics.mean(r['agree'] for r in rows):>9.0%} {(min(divs) if divs else '-'):>9} | {statistics.median(r['kl'] for r in rows):>14.4f}")
    if kvb:
        plain = make(loaded, caching=False)
        for strategy, rows in kvb["c"].items():
            agrees, kls = [], []
            for order, r in zip(w["rag_orders"], rows):
                ref = plain._run([plain.encode(rag_text(w["docs"], order))], [_greedy()], keep_logits=True)[0]
                got = tok(r["text"], add_special_tokens=False).input_ids[:GEN]
                agrees.append(agreement(ref.token_ids, got)[0])
                if r["logits"] is not None:
                    kls.append(kl(ref.first_token_logits, r["logits"]))
            ms = statistics.median(r["ttft_ms"] for r in rows)
            wall = statistics.median(r["wall_ms"] for r in rows)
            print(f"  {'KVBoost ' + strategy:<22} | {ms:>8,.0f} {full_ms / ms:>6.2f}x | {statistics.mean(r['reuse'] for r in rows):>6.0%} | "
                  f"{statistics.mean(agrees):>9.0%} {'':>9} | {(statistics.median(kls) if kls else float('nan')):>14.4f}  (wall {wall:,.0f} ms)")
    print("  agreement = share of the 16 greedy tokens equal to full prefill's; KVBoost's is on re-tokenized text.")


def report_d(loaded, w: dict, kvb: dict | None) -> None:
    d = section_d(loaded, w)
    print("\n(d) spilled blocks: precision, bytes and quality after a round trip through the host tier")
    for bits, r in d.items():
        print(f"  {bits:>3}: {r['bytes_vs_model']:.2f}x the bytes of the model's precision ({loaded.model.dtype}), "
              f"{r['bytes_vs_fp16']:.2f}x fp16 | restored {r['restored_blocks']} blocks | "
              f"first-token agreement {r['first_token_agreement']:.0%} | median KL {r['kl']:.5f} | 16-token agreement {r['agreement']:.0%}")
    print("  targets: int8 halves KV bytes with first-token agreement >= 95%")


if __name__ == "__main__":
    main()
