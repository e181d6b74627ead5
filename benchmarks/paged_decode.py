"""The ``native`` tier's decode kernel alone against what the ``sdpa`` tier does for the same
decodes (gather each context out of the pool with index_select, pad and mask, SDPA), per
layer, same inputs, same timer, same run.

    python benchmarks/paged_decode.py [--heads 9] [--kv-heads 3] [--head-dim 64] [--block-size 16] [--layers 30]

SmolLM2-135M's geometry by default (9 query heads over 3 KV heads, head dim 64, float32), the
pool's blocks handed out in shuffled order as a busy pool's are; each case is a batch of
decodes at a context length (lengths vary a little within the batch, as they do). Each case
has ``--layers`` layers' pools (SmolLM2's 30), each call reading the next layer's, as a
decode step does: a layer's K/V come from memory, not from the cache the previous call
filled (``--layers 1``: the same pool every call, in cache where it fits). Prints the best-of-5
mean time per call of each, their ratio, the largest difference between the two, and the K/V
bytes per second the native kernel reads; ``unsplit``: the native kernel with long contexts
not cut into pieces (``native_attention.SPLIT_KEYS``), and native's speed-up over it;
``unprefetched``: the kernel built without its software prefetches (``KVSTREAM_NO_PREFETCH``),
and what they buy.

A second table: prefill chunks (T new tokens after L cached ones, one sequence; L = 0 is a
whole prompt), as the ``sdpa`` path runs them (gather the context, SDPA with the chunk's
causal mask) and as the ``native`` tier runs chunks of up to ``attention.NATIVE_CHUNK_MAX``
tokens (T kernel rows, row t over its first L + t + 1 tokens, tiled): where that limit comes
from. Past the limit the table still times the kernel, for comparison.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvstream.hf import native_attention, native_build  # noqa: E402
from kvstream.hf.attention import NATIVE_CHUNK_MAX, _gather  # noqa: E402

CASES = ((1, 300), (16, 150), (16, 300), (8, 2000), (2, 2000), (1, 2000), (1, 8000))  # (decodes, tokens of context)
UNSPLIT = 2**30  # split_keys past any context: each (sequence, KV head) one unit, as before contexts were split
CHUNKS = ((0, (16, 64, 256)), (500, (4, 8, 16, 32, 64)), (2000, (4, 8, 16, 32, 64, 128)), (8000, (8, 16, 64)))  # (cached tokens, chunk sizes)


def best_ms(fn, calls: int = 30) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30, help="layers' pools per case, read in turn (1: one pool, in cache)")
    args = parser.parse_args()
    module, how = native_attention.load()
    if module is None:
        sys.exit(f"the native kernel did not build: {how}")
    unprefetched, why = native_build.load_extension(
        "kvstream_paged_decode_unprefetched", native_attention.SOURCE,
        extra_flags=(*native_attention.EXTRA_FLAGS, "-DKVSTREAM_NO_PREFETCH"))
    if unprefetched is None:
        sys.exit(f"the kernel without prefetches did not build: {why}")
    bs, kv_heads, heads, dim = args.block_size, args.kv_heads, args.heads, args.head_dim
    print(f"{heads} query heads, {kv_heads} KV heads, head dim {dim}, block size {bs}, float32, "
          f"{torch.get_num_threads()} threads, {args.layers} layers' pools read in turn; native kernel built with {how}")
    print(f"{'decodes':>7} {'context':>7} {'gather+SDPA ms':>15} {'native ms':>10} {'ratio':>7} {'max diff':>9} {'native GB/s':>12} "
          f"{'unsplit ms':>11} {'split gain':>10} {'unprefetched ms':>16} {'prefetch gain':>13}")
    generator = torch.Generator().manual_seed(0)

    def layer_pools(slots: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``--layers`` (K, V) pools of ``slots`` rows each."""
        return [(torch.randn(slots, kv_heads, dim, generator=generator), torch.randn(slots, kv_heads, dim, generator=generator))
                for _ in range(args.layers)]

    def in_turn(fn, pools, **kwargs):
        """``fn`` called on the next layer's pools at each call."""
        turn = itertools.cycle(pools)
        return lambda: fn(*next(turn), **kwargs)

    for batch, context in CASES:
        lengths = torch.tensor([context - (i * 7) % 50 for i in range(batch)], dtype=torch.int32)
        per_seq = -(-context // bs)
        num_blocks = batch * per_seq + 8
        pools = layer_pools(num_blocks * bs)
        order = torch.randperm(num_blocks, generator=generator)[: batch * per_seq].view(batch, per_seq)
        tables = order.to(torch.int32)
        q = torch.randn(batch, heads, dim, generator=generator)
        slots = (order[:, :, None] * bs + torch.arange(bs)).reshape(batch, -1)[:, : int(lengths.max())]
        mask = (torch.arange(slots.shape[1])[None] < lengths[:, None].long())[:, None, None, :]

        def gathered(k_pool, v_pool):
            k, v = _gather(k_pool, slots, q.dtype), _gather(v_pool, slots, q.dtype)
            return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)[:, :, 0]

        def native(k_pool, v_pool, split_keys=native_attention.SPLIT_KEYS, kernel=module):
            return kernel.paged_decode(q, k_pool, v_pool, tables, lengths, bs, dim ** -0.5, split_keys)

        diff = float((gathered(*pools[0]) - native(*pools[0])).abs().max())
        base, ours = best_ms(in_turn(gathered, pools)), best_ms(in_turn(native, pools))
        unsplit, plain = best_ms(in_turn(native, pools, split_keys=UNSPLIT)), best_ms(in_turn(native, pools, kernel=unprefetched))
        read = int(lengths.sum()) * kv_heads * dim * 4 * 2  # K and V bytes the decodes attend to
        print(f"{batch:>7} {context:>7} {base:>15.3f} {ours:>10.3f} {base / ours:>6.2f}x {diff:>9.1e} {read / ours / 1e6:>12.1f} "
              f"{unsplit:>11.3f} {unsplit / ours:>9.2f}x {plain:>16.3f} {plain / ours:>12.2f}x")
        del pools
    print(f"\nprefill chunks (the native tier reads chunks of up to {NATIVE_CHUNK_MAX} tokens in place)")
    print(f"{'cached':>7} {'chunk':>6} {'gather+SDPA ms':>15} {'native ms':>10} {'ratio':>7} {'max diff':>9} {'unsplit ms':>11} {'split gain':>10} "
          f"{'unprefetched ms':>16} {'prefetch gain':>13}")
    for cached, sizes in CHUNKS:
        for new in sizes:
            total = cached + new
            per_seq = -(-total // bs)
            pools = layer_pools((per_seq + 8) * bs)
            order = torch.randperm(per_seq + 8, generator=generator)[:per_seq]
            slots = (order[:, None] * bs + torch.arange(bs)).reshape(-1)[:total]
            q = torch.randn(new, heads, dim, generator=generator)
            mask = torch.arange(total)[None, :] <= torch.arange(cached, total)[:, None]
            tables = order.to(torch.int32)[None].expand(new, -1).contiguous()
            lengths = torch.arange(cached + 1, total + 1, dtype=torch.int32)

            def chunk_gathered(k_pool, v_pool):
                k, v = _gather(k_pool, slots, q.dtype), _gather(v_pool, slots, q.dtype)
                return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)

            def chunk_native(k_pool, v_pool, split_keys=native_attention.SPLIT_KEYS, kernel=module):
                return kernel.paged_decode(q, k_pool, v_pool, tables, lengths, bs, dim ** -0.5, split_keys)

            diff = float((chunk_gathered(*pools[0]) - chunk_native(*pools[0])).abs().max())
            base, ours = best_ms(in_turn(chunk_gathered, pools), 10), best_ms(in_turn(chunk_native, pools), 10)
            unsplit = best_ms(in_turn(chunk_native, pools, split_keys=UNSPLIT), 10)
            plain = best_ms(in_turn(chunk_native, pools, kernel=unprefetched), 10)
            print(f"{cached:>7} {new:>6} {base:>15.3f} {ours:>10.3f} {base / ours:>6.2f}x {diff:>9.1e} {unsplit:>11.3f} {unsplit / ours:>9.2f}x "
                  f"{plain:>16.3f} {plain / ours:>12.2f}x")
            del pools

if __name__ == "__main__":
    main()
