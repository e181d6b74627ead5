"""KV memory: paged allocation with prefix sharing vs reserving max_seq_len per sequence (what
Ollama and llama.cpp do per slot), on a realistic mix of prompt and output lengths, and the
waste inside the last, partly filled blocks (PagedAttention's figure: under 4%).

    python benchmarks/kv_memory.py [--sequences 64] [--max-seq-len 4096] [--seed 0]

Each sequence is a chat request: one of a few shared system prompts (as apps send), a user
turn of log-normal length, and a log-normal number of generated tokens. All sequences are
resident at once (the peak of a busy server); the block manager allocates the prompt on
admission and one block per block_size generated tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstream.kv import BlockManager  # noqa: E402


def workload(n: int, seed: int, max_seq_len: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, generated tokens) per sequence."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(rng.choice([180, 350, 600]))] for _ in range(4)]
    out = []
    for _ in range(n):
        system = rng.choice(systems)
        user = [rng.randrange(50_000) for _ in range(min(1500, int(rng.lognormvariate(4.5, 0.9))))]
        prompt = system + user
        gen = min(max_seq_len - len(prompt), max(1, int(rng.lognormvariate(5.0, 0.8))))
        out.append((prompt, gen))
    return out


def measure(seqs: list[tuple[list[int], int]], block_size: int, share: bool) -> dict:
    total_tokens = sum(len(p) + g for p, g in seqs)
    bm = BlockManager(10**6 // block_size, block_size, 0, enable_prefix_cache=share, model_identity="bench")
    for i, (prompt, gen) in enumerate(seqs):
        bm.allocate(i, prompt)
        for t in range(gen):
            bm.append_token(i, t)
    used = bm.pool.num_used
    last_block_waste = sum(-(len(p) + g) % block_size for p, g in seqs)
    return {"blocks": used, "tokens_of_kv": used * block_size, "total_tokens": total_tokens,
            "last_block_waste": last_block_waste / (sum(-(-(len(p) + g) // block_size) for p, g in seqs) * block_size)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    seqs = workload(args.sequences, args.seed, args.max_seq_len)
    reserved = args.sequences * args.max_seq_len
    tokens = sum(len(p) + g for p, g in seqs)
    print(f"\n{args.sequences} resident sequences, {tokens:,} tokens of real KV "
          f"(prompt mean {sum(len(p) for p, _ in seqs) / len(seqs):.0f}, output mean {sum(g for _, g in seqs) / len(seqs):.0f}); "
          f"reserving max_seq_len={args.max_seq_len} per sequence takes {reserved:,} token slots\n")
    print(f"{'block':>5} | {'paged, no sharing':>18} {'vs reserve':>10} | {'paged + prefix sharing':>22} {'vs reserve':>10} | {'last-block waste':>16}")
    print("-" * 96)
    for bs in (8, 16, 32):
        plain = measure(seqs, bs, share=False)
        shared = measure(seqs, bs, share=True)
        print(f"{bs:>5} | {plain['tokens_of_kv']:>18,} {plain['tokens_of_kv'] / reserved:>10.3f} | "
              f"{shared['tokens_of_kv']:>22,} {shared['tokens_of_kv'] / reserved:>10.3f} | {plain['last_block_waste']:>15.2%}")
    print("\nratio = KV token slots used / slots reserved by max_seq_len allocation (lower is better).")
    print("last-block waste = empty slots in partly filled last blocks / all allocated slots (target < 4%).")


if __name__ == "__main__":
    main()
