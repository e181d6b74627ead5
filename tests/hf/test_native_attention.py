"""The native tier's decode kernel (paged_decode.cpp) against the reference, read through
block tables in any order, on the shapes models have: head dims 64/96/128, GQA and plain
multi-head, contexts that end anywhere in a block."""

from __future__ import annotations

import pytest

from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf import native_attention  # noqa: E402
from kvstream.hf.attention import eager_attention  # noqa: E402
from tests.hf.conftest import built_kernel  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def kernel():
    built_kernel(native_attention.load, "the native attention kernel")


def make_case(heads, kv_heads, dim, block_size, lengths, seed=0):
    """A pool holding each sequence's context in shuffled blocks, their tables and queries."""
    generator = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_seq) + 3  # some blocks no table names
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(lengths), max(per_seq), dtype=torch.int32)
    taken = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = torch.tensor(order[taken : taken + n], dtype=torch.int32)
        taken += n
    k_pool = torch.randn(num_blocks * block_size, kv_heads, dim, generator=generator)
    v_pool = torch.randn(num_blocks * block_size, kv_heads, dim, generator=generator)
    q = torch.randn(len(lengths), heads, dim, generator=generator)
    return q, k_pool, v_pool, tables, torch.tensor(lengths, dtype=torch.int32)


def reference(q, k_pool, v_pool, tables, lengths, block_size, scale):
    """Each sequence's context gathered slot by slot, then the eager kernel."""
    outs = []
    for b, n in enumerate(lengths.tolist()):
        slots = [int(tables[b, j // block_size]) * block_size + j % block_size for j in range(n)]
        k = k_pool[slots].transpose(0, 1)[None]  # [1, H_kv, L, D]
        v = v_pool[slots].transpose(0, 1)[None]
        outs.append(eager_attention(q[b][None, :, None], k, v, None, False, scale)[0, :, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (8, 8, 128, 4), (4, 1, 64, 8), (6, 2, 96, 16), (2, 1, 20, 5)])
def test_the_kernel_matches_eager_through_shuffled_tables(heads, kv_heads, dim, block_size):
    """Lengths from 1 to past several tiles (32 keys), ending mid-block and at a block's end;
    head dim 20 takes the plain C++ path the AVX2 one skips (not a multiple of 8)."""
    lengths = [1, 7, 8, block_size, block_size + 1, 33, 70, 3 * block_size]
    q, k_pool, v_pool, tables, lens = make_case(heads, kv_heads, dim, block_size, lengths)
    for scale in (None, 0.05):
        out = native_attention.paged_decode(q, k_pool, v_pool, tables, lens, block_size, scale)
        expected = reference(q, k_pool, v_pool, tables, lens, block_size, scale if scale is not None else dim**-0.5)
        assert out.shape == (len(lengths), heads, dim)
        assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5), (out - expected).abs().max()


def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch():
    q, k_pool, v_pool, tables, lens = make_case(9, 3, 64, 16, [50, 3, 200, 17], seed=1)
    batched = native_attention.paged_decode(q, k_pool, v_pool, tables, lens, 16, None)
    for b in range(4):
        alone = native_attention.paged_decode(q[b : b + 1], k_pool, v_pool, tables[b : b + 1], lens[b : b + 1], 16, None)
        assert torch.equal(alone[0], batched[b])


def test_the_pool_layer_views_the_engine_passes_are_read_in_place():
    """The engine hands one layer of the [layers, slots, H_kv, D] pool: a view at an offset."""
    q, k_pool, v_pool, tables, lens = make_case(9, 3, 64, 16, [40, 9])
    k_all, v_all = torch.stack([torch.zeros_like(k_pool), k_pool]), torch.stack([torch.zeros_like(v_pool), v_pool])
    out = native_attention.paged_decode(q, k_all[1], v_all[1], tables, lens, 16, None)
    assert torch.equal(out, native_attention.paged_decode(q, k_pool, v_pool, tables, lens, 16, None))


def test_tables_and_lengths_that_do_not_fit_the_pool_are_errors_not_reads():
    q, k_pool, v_pool, tables, lens = make_case(9, 3, 64, 16, [20, 30])
    slots = k_pool.shape[0]
    cases = {
        "block id outside the pool": (tables.masked_fill(tables == tables[1, 1], slots // 16), lens),
        "context length out of range": (tables, torch.tensor([20, 33], dtype=torch.int32)),
    }
    for message, (bad_tables, bad_lens) in cases.items():
        with pytest.raises(RuntimeError, match=message):
            native_attention.paged_decode(q, k_pool, v_pool, bad_tables, bad_lens, 16, None)
    with pytest.raises(RuntimeError, match="context length out of range"):
        native_attention.paged_decode(q, k_pool, v_pool, tables, torch.tensor([0, 30], dtype=torch.int32), 16, None)
    with pytest.raises(RuntimeError, match="float32 queries"):
        native_attention.paged_decode(q.double(), k_pool.double(), v_pool.double(), tables, lens, 16, None)
    with pytest.raises(RuntimeError, match="float16 or bfloat16 pools, K and V alike"):
        native_attention.paged_decode(q, k_pool.double(), v_pool.double(), tables, lens, 16, None)
    with pytest.raises(RuntimeError, match="K and V alike"):
        native_attention.paged_decode(q, k_pool.half(), v_pool, tables, lens, 16, None)
    with pytest.raises(RuntimeError, match="int32"):
        native_attention.paged_decode(q, k_pool, v_pool, tables.long(), lens, 16, None)
    with pytest.raises(RuntimeError, match="head counts"):
        native_attention.paged_decode(q[:, :8], k_pool, v_pool, tables, lens, 16, None)
    for split_keys in (0, -32, 48):  # a split must be a positive multiple of the kernel's 32-key tile
        with pytest.raises(RuntimeError, match="split_keys must be a positive multiple of 32"):
            native_attention.paged_decode(q, k_pool, v_pool, tables, lens, 16, None, split_keys)


@pytest.mark.parametrize("block_size", [4, 16])
def test_short_prefill_chunks_are_read_in_place_and_match_eager(block_size):
    """Chunks of up to NATIVE_CHUNK_MAX new tokens (after a cached head, or a whole short
    prompt) run as kernel rows, each over its own causal context; a longer one still gathers.
    One packed step with decodes between them, against the eager tier on the same pool."""
    from types import SimpleNamespace

    from kvstream.hf.attention import NATIVE_CHUNK_MAX, AttentionPlan, paged_attention
    from kvstream.hf.kv_cache import KVShape, PagedKVCache

    heads, kv_heads, dim = 9, 3, 64
    rows = [(block_size + 3, 2), (40, 1), (0, 5), (2 * block_size - 1, NATIVE_CHUNK_MAX), (7, NATIVE_CHUNK_MAX + 1), (3, 1)]
    per_seq = -(-max(c + n for c, n in rows) // block_size)
    generator = torch.Generator().manual_seed(11)
    cache = PagedKVCache(KVShape(1, kv_heads, dim), per_seq * len(rows), block_size, 0, torch.float32, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    order = torch.randperm(per_seq * len(rows), generator=generator).tolist()
    seqs = [(order[i * per_seq : (i + 1) * per_seq], cached, new) for i, (cached, new) in enumerate(rows)]
    tokens = sum(new for _, new in rows)
    query = torch.randn(1, heads, tokens, dim, generator=generator)
    key, value = torch.randn(1, kv_heads, tokens, dim, generator=generator), torch.randn(1, kv_heads, tokens, dim, generator=generator)
    layer = SimpleNamespace(layer_idx=0)
    native_plan = AttentionPlan.build(cache, seqs, "native", heads)
    assert [(c.start, c.end) for c in native_plan.prefills] == [(tokens - 1 - (NATIVE_CHUNK_MAX + 1), tokens - 1)]
    assert len(native_plan.decode_rows) == tokens - (NATIVE_CHUNK_MAX + 1)
    with torch.inference_mode():
        got = paged_attention(layer, query, key, value, None, dim**-0.5, kvstream_plan=native_plan)[0]
        want = paged_attention(layer, query, key, value, None, dim**-0.5, kvstream_plan=AttentionPlan.build(cache, seqs, "eager", heads))[0]
    assert float((got - want).abs().max()) < 1e-5


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (2, 1, 20)])
def test_a_chunks_rows_tiled_together_give_what_each_gives_alone(heads, kv_heads, dim):
    """The kernel takes consecutive rows of one sequence (a prefill chunk's queries) 16 at a
    time, sharing each K/V tile among them: every row's output is bit for bit what it is run
    alone, and matches eager. 40 rows after 57 cached tokens (tiles of 16, 16, 8), then a
    second sequence whose first row's length follows on (a different table: not tiled in),
    then a decode sharing the first sequence's table."""
    block_size = 8
    generator = torch.Generator().manual_seed(5)
    num_blocks = 40
    order = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    first, second = order[:13], order[13:26]  # 97 and up to 104 tokens
    chunk = [(first, n) for n in range(58, 98)]
    rows = chunk + [(second, 98), (second, 99), (first, 97)]
    tables = torch.stack([t for t, _ in rows])
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    k_pool = torch.randn(num_blocks * block_size, kv_heads, dim, generator=generator)
    v_pool = torch.randn(num_blocks * block_size, kv_heads, dim, generator=generator)
    q = torch.randn(len(rows), heads, dim, generator=generator)
    together = native_attention.paged_decode(q, k_pool, v_pool, tables, lens, block_size, None)
    for b in range(len(rows)):
        alone = native_attention.paged_decode(q[b : b + 1], k_pool, v_pool, tables[b : b + 1], lens[b : b + 1], block_size, None)
        assert torch.equal(together[b : b + 1], alone), f"row {b}"
    expected = reference(q, k_pool, v_pool, tables, lens, block_size, dim**-0.5)
    assert float((together - expected).abs().max()) < 1e-5


@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (4, 1, 64, 5), (2, 1, 20, 7)])
def test_long_contexts_split_into_pieces_match_eager(heads, kv_heads, dim, block_size):
    """Contexts past the kernel's split (``SPLIT_KEYS``, 512 keys) run as pieces combined
    afterwards: at, just past and several pieces past the cut, ending mid-block (block size 5
    and 7: pieces start inside a block), beside short ones in the same batch."""
    cut = native_attention.SPLIT_KEYS
    lengths = [cut - 1, cut, cut + 1, 3, 700, 2 * cut + 6, 3 * cut + 31]
    q, k_pool, v_pool, tables, lens = make_case(heads, kv_heads, dim, block_size, lengths, seed=3)
    out = native_attention.paged_decode(q, k_pool, v_pool, tables, lens, block_size, None)
    expected = reference(q, k_pool, v_pool, tables, lens, block_size, dim**-0.5)
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5), (out - expected).abs().max()


def test_a_long_context_gets_the_same_bits_alone_and_in_any_batch():
    q, k_pool, v_pool, tables, lens = make_case(9, 3, 64, 16, [900, 40, 300, 512, 1500], seed=4)
    batched = native_attention.paged_decode(q, k_pool, v_pool, tables, lens, 16, None)
    for b in range(len(lens)):
        alone = native_attention.paged_decode(q[b : b + 1], k_pool, v_pool, tables[b : b + 1], lens[b : b + 1], 16, None)
        assert torch.equal(alone[0], batched[b]), b
    half = native_attention.paged_decode(q, k_pool.half().float(), v_pool.half().float(), tables, lens, 16, None)
    assert torch.equal(native_attention.paged_decode(q, k_pool.half(), v_pool.half(), tables, lens, 16, None), half)


def test_a_chunks_rows_across_the_split_give_what_each_gives_alone():
    """Rows of one chunk whose lengths straddle the cut (496..527 around 512, tiled 16 at a
    time): the rows with at most 512 keys run in one piece alone but in a split tile together,
    and must not notice; every row matches eager."""
    block_size, cut = 16, native_attention.SPLIT_KEYS
    generator = torch.Generator().manual_seed(6)
    num_blocks = cut // block_size + 8
    table = torch.randperm(num_blocks, generator=generator).to(torch.int32)[: cut // block_size + 2]
    lens = torch.arange(cut - 16, cut + 16, dtype=torch.int32)
    tables = table.expand(len(lens), -1).contiguous()
    k_pool = torch.randn(num_blocks * block_size, 3, 64, generator=generator)
    v_pool = torch.randn(num_blocks * block_size, 3, 64, generator=generator)
    q = torch.randn(len(lens), 9, 64, generator=generator)
    together = native_attention.paged_decode(q, k_pool, v_pool, tables, lens, block_size, None)
    for b in range(len(lens)):
        alone = native_attention.paged_decode(q[b : b + 1], k_pool, v_pool, tables[b : b + 1], lens[b : b + 1], block_size, None)
        assert torch.equal(together[b : b + 1], alone), f"row {b} (length {int(lens[b])})"
    expected = reference(q, k_pool, v_pool, tables, lens, block_size, 64**-0.5)
    assert float((together - expected).abs().max()) < 1e-5
