"""The block manager, block by block: exact ids, eviction order, sharing, CoW and swap."""

from __future__ import annotations

import pytest

from kvstream.kv import UNKNOWN_TOKEN, BlockManager, NoFreeBlocks, block_hashes, hash_block, model_key


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_bm(num_blocks: int = 8, block_size: int = 4, cpu: int = 4, **kw) -> BlockManager:
    return BlockManager(num_blocks, block_size, cpu, model_identity="test-model", **kw)


def test_hashes_are_chained_and_deterministic():
    salt = model_key("m")
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, salt)
    assert len(a) == 2  # the partial tail block carries no hash
    assert a[0] == hash_block(None, [1, 2, 3, 4], salt)
    assert a[1] == hash_block(a[0], [5, 6, 7, 8], salt)
    # Same second block after a different first block: a different hash.
    assert block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, salt)[1] != a[1]
    # Another model: different hashes for the same tokens.
    assert block_hashes([1, 2, 3, 4], 4, model_key("other"))[0] != a[0]
    # Known values: the hash must not change across processes or releases (slot and disk-tier
    # files are named by it). Computed once with blake2b-128, keyed by the model key.
    assert model_key("m").hex() == "25ee4a05c339424604bfc268f854dafa"
    assert hash_block(None, [1, 2, 3, 4], model_key("m")).hex() == "700b0f1276f1e1702690999f0bbd8999"
    assert hash_block(None, (1, 2, 3, 4), model_key("m")) == hash_block(None, [1, 2, 3, 4], model_key("m"))


def test_streaming_allocation_takes_one_block_per_boundary():
    bm = make_bm()
    assert bm.allocate("a", [1, 2, 3, 4, 5]) == 0
    assert len(bm.tables["a"].blocks) == 2
    for t in (6, 7, 8):
        bm.append_token("a", t)
    assert len(bm.tables["a"].blocks) == 2  # nothing reserved ahead
    bm.append_token("a", 9)
    assert len(bm.tables["a"].blocks) == 3
    bm.check_invariants()
    bm.free("a")
    assert bm.is_idle()


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute():
    bm = make_bm()
    bm.allocate("a", list(range(10)))  # blocks [0-3] [4-7] [8,9]
    assert [b.block_id for b in bm.tables["a"].blocks] == [0, 1, 2]
    cached = bm.allocate("b", list(range(8)) + [99, 98])
    assert cached == 8
    assert [b.block_id for b in bm.tables["b"].blocks] == [0, 1, 3]
    assert [b.ref_cnt for b in bm.pool.blocks[:4]] == [2, 2, 1, 1]
    # A prompt that is exactly two cached blocks reuses only the first: one token must run.
    assert bm.allocate("c", list(range(8))) == 4
    assert [b.block_id for b in bm.tables["c"].blocks] == [0, 4]
    assert bm.pool.free_block_ids() == [5, 6, 7]
    bm.check_invariants()


def test_freed_blocks_stay_cached_until_reallocated_lru():
    clock = FakeClock()
    bm = make_bm(num_blocks=4, block_size=2, clock=clock)
    bm.allocate("a", [1, 2, 3])  # 2 blocks, [1,2] hashed
    clock.now = 1
    bm.allocate("b", [5, 6, 7])  # 2 blocks, [5,6] hashed
    clock.now = 2
    bm.free("a")
    clock.now = 3
    bm.free("b")
    # a: [0]=[1,2] cached, [1]=[3]; b: [2]=[5,6] cached, [3]=[7]. Unhashed tail blocks are
    # handed out first (last freed first), then cached blocks oldest first.
    assert bm.pool.num_cached == 2
    assert bm.pool.free_block_ids() == [3, 1, 0, 2]
    assert bm.allocate("c", [1, 2, 9]) == 2  # revived from the cache
    assert [b.block_id for b in bm.tables["c"].blocks] == [0, 3]
    assert bm.pool.free_block_ids() == [1, 2]
    bm.allocate("d", [8, 8, 8])  # needs 2 blocks: the free unhashed one, then evict [5,6]
    assert [b.block_id for b in bm.tables["d"].blocks] == [1, 2]
    assert bm.cached_prefix([5, 6, 7]) == []  # [5,6] was the least recently used
    assert len(bm.cached_prefix([1, 2, 7])) == 1 and len(bm.cached_prefix([8, 8, 7])) == 1
    assert bm.pool.stats.evictions == 1
    bm.check_invariants()


def test_ttl_drops_only_idle_stale_blocks():
    clock = FakeClock()
    bm = make_bm(num_blocks=4, block_size=2, clock=clock)
    bm.allocate("a", [1, 2, 3])
    bm.allocate("b", [4, 5, 6])
    bm.free("a")
    clock.now = 100
    assert bm.pool.drop_expired(ttl_seconds=50) == 1  # a's block; b still holds its own
    assert bm.cached_prefix([1, 2, 3]) == []
    assert len(bm.cached_prefix([4, 5, 6])) == 1
    bm.check_invariants()


def test_retained_blocks_are_evicted_after_every_ordinary_cached_block_and_never_refused():
    """A client's retention (cache_control): the prefix's cached blocks wait apart from the
    free queue until their time, handed out only once the queue is empty (the one whose
    retention ends first), and join the queue as used when their time ends."""
    clock = FakeClock()
    bm = make_bm(num_blocks=6, block_size=2, cpu=0, clock=clock)
    bm.allocate("a", [1, 2, 3, 4, 5])
    kept = [b.block_id for b in bm.tables["a"].blocks[:2]]
    bm.free("a", retain=[(4, 10.0), (3, 20.0)])  # [1,2] until 20, [3,4] until 10; the tail [5] is not full
    assert bm.pool.num_retained == 2 and bm.pool.num_free == 6
    assert bm.pool.free_block_ids()[-2:] == [kept[1], kept[0]]  # the one released first is handed out first
    bm.allocate("b", [7, 8, 9])
    bm.free("b")  # [7,8] cached, ordinary
    clock.now = 1
    bm.allocate("c", [6, 6, 6, 6, 6, 6, 6])  # 4 blocks: the unhashed ones, then [7,8], not [1,2] or [3,4]
    assert bm.cached_prefix([7, 8, 0]) == [] and len(bm.cached_prefix([1, 2, 3, 4, 0])) == 2
    assert bm.pool.stats.retained_evictions == 0
    bm.check_invariants()
    bm.free("c")
    bm.allocate("d", [1, 2, 3, 4, 0, 0])  # a hit takes the retained blocks back...
    assert bm.pool.num_retained == 0 and bm.tables["d"].num_cached_tokens == 4
    bm.free("d")  # ...and freed without a retention of its own, they are retained as before
    assert bm.pool.num_retained == 2
    bm.allocate("e", [9] * 11)  # every block: the queue's, then [3,4] (ends first), then [1,2]
    assert bm.pool.num_free == 0 and bm.pool.stats.retained_evictions == 2 and bm.cached_prefix([1, 2, 3, 4, 0]) == []
    bm.free("e")
    bm.check_invariants()

    bm.allocate("f", [1, 2, 3, 4, 5])
    first, second = (b.block_id for b in bm.tables["f"].blocks[:2])
    bm.free("f", retain=[(4, clock.now + 5)])
    clock.now += 6  # its time ended: ordinary cached blocks again, the most recently used
    assert set(bm.pool.free_block_ids()[-2:]) == {first, second} and bm.pool.num_retained == 0
    bm.pool.drop_expired(ttl_seconds=10)  # used as its retention ended, not before
    assert len(bm.cached_prefix([1, 2, 3, 4, 0])) == 2
    clock.now += 11
    bm.pool.drop_expired(ttl_seconds=10)
    assert bm.cached_prefix([1, 2, 3, 4, 0]) == []
    bm.check_invariants()
    assert bm.is_idle()


def test_at_most_half_the_pool_waits_retained():
    """One client's marks cannot rank every other prefix below theirs: past half the pool,
    the retained block whose time ends first becomes an ordinary cached one."""
    clock = FakeClock()
    bm = make_bm(num_blocks=4, block_size=2, cpu=0, clock=clock)
    bm.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8])
    head = {b.block_id for b in bm.tables["a"].blocks[:2]}
    bm.free("a", retain=[(8, 50.0), (4, 60.0)])  # the first two blocks longer
    assert bm.pool.num_retained == 2 and bm.pool.stats.retained_evictions == 2
    assert set(bm.pool.free_block_ids()[-2:]) == head  # still retained: handed out last
    bm.allocate("b", [9, 9, 9])  # two blocks: the two ordinary ones go first
    assert len(bm.cached_prefix([1, 2, 3, 4, 0])) == 2 and bm.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8])[2:] == []
    bm.free("b")
    bm.check_invariants()


def test_a_lost_cache_forgets_retained_blocks_too():
    clock = FakeClock()
    bm = make_bm(num_blocks=4, block_size=2, cpu=0, clock=clock)
    bm.allocate("a", [1, 2, 3, 4])
    bm.free("a", retain=[(4, 100.0)])
    assert bm.pool.num_retained == 2
    bm.pool.reset_cache()
    assert bm.pool.num_retained == 0 and bm.pool.num_cached == 0 and bm.cached_prefix([1, 2, 3, 4, 5]) == []
    bm.check_invariants()


def test_collision_guard_compares_tokens():
    bm = make_bm(block_size=2)
    bm.allocate("a", [1, 2, 3])
    block = bm.tables["a"].blocks[0]
    # Forge a collision: the same hash for other tokens must not be served.
    assert bm.pool.lookup(block.block_hash, (9, 9)) is None
    assert bm.pool.lookup(block.block_hash, (1, 2)) is block


def test_fork_then_append_copies_the_shared_partial_block():
    bm = make_bm()
    bm.allocate("p", [1, 2, 3, 4, 5, 6])
    bm.fork("p", "c")
    last = bm.tables["p"].blocks[-1]
    assert last.ref_cnt == 2
    copy = bm.append_token("c", 7)
    assert copy is not None and copy[0] == last.block_id
    assert bm.tables["c"].blocks[-1].block_id == copy[1]
    assert last.ref_cnt == 1  # the parent keeps the original
    assert bm.append_token("p", 8) is None  # no longer shared: write in place
    bm.check_invariants()
    bm.free("p")
    bm.free("c")
    assert bm.is_idle()


def test_allocation_is_all_or_nothing():
    bm = make_bm(num_blocks=3, block_size=2)
    bm.allocate("a", [1, 2, 3])
    with pytest.raises(NoFreeBlocks):
        bm.allocate("b", [7, 8, 9, 10, 11])  # needs 3
    assert "b" not in bm.tables
    bm.check_invariants()


def test_append_without_free_block_changes_nothing():
    bm = make_bm(num_blocks=1, block_size=2)
    bm.allocate("a", [1, 2])
    with pytest.raises(NoFreeBlocks):
        bm.append_token("a", 3)
    assert bm.tables["a"].token_ids == [1, 2]
    bm.check_invariants()


def test_swap_round_trip_keeps_shared_blocks_shared():
    bm = make_bm(num_blocks=8, block_size=2, cpu=4)
    bm.allocate("a", [1, 2, 3, 4, 5])  # 3 blocks
    bm.allocate("b", [1, 2, 3, 4, 9])  # shares 2
    shared = [b.block_id for b in bm.tables["b"].blocks[:2]]
    copies = bm.swap_out("b")
    assert len(copies) == 1  # only the block b held alone moved to the host
    assert [bm.pool.blocks[i].ref_cnt for i in shared] == [2, 2]  # still shared, still held
    bm.check_invariants()
    back = bm.swap_in("b")
    assert len(back) == 1 and bm.tables["b"].token_ids == [1, 2, 3, 4, 9]
    assert [b.block_id for b in bm.tables["b"].blocks[:2]] == shared
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.is_idle()


def test_swap_out_is_all_or_nothing_when_host_pool_is_short():
    bm = make_bm(num_blocks=8, block_size=2, cpu=1)
    bm.allocate("a", [1, 2, 3, 4, 5])
    with pytest.raises(NoFreeBlocks):
        bm.swap_out("a")
    assert "a" in bm.tables and "a" not in bm.swapped and bm.num_free_cpu_blocks == 1
    bm.check_invariants()


def test_swap_in_reuses_blocks_still_in_the_prefix_cache():
    bm = make_bm(num_blocks=8, block_size=2, cpu=4)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.swap_out("a")
    copies = bm.swap_in("a")  # the freed hashed blocks were never reallocated
    assert len(copies) == 1  # only the unhashed partial block needs bytes moved
    bm.check_invariants()


def test_unknown_tokens_are_counted_but_never_hashed():
    bm = make_bm(block_size=2)
    bm.allocate("a", [1, 2, 3])
    bm.append_token("a", UNKNOWN_TOKEN)
    assert len(bm.tables["a"].hashes) == 1
    assert len(bm.tables["a"].blocks) == 2
    bm.check_invariants()


def test_free_of_unknown_sequence_is_a_no_op():
    bm = make_bm()
    bm.free("nobody")
    assert bm.is_idle()


def test_eviction_takes_the_least_recently_used_cached_block():
    clock = FakeClock()
    bm = make_bm(num_blocks=2, block_size=2, cpu=0, clock=clock)
    bm.allocate("old", [1, 2, 3])
    bm.free("old")  # the unhashed [3] block goes first, [1,2] stays cached
    clock.now = 1
    bm.allocate("new", [4, 5, 6])  # takes the [3] block, then must evict [1,2]
    bm.free("new")
    clock.now = 2
    assert bm.cached_prefix([1, 2, 0]) == []
    bm.allocate("x", [4, 5, 9])  # [4,5] is a hit; the other block is new
    assert bm.tables["x"].num_cached_tokens == 2
    assert [b.block_id for b in bm.tables["x"].blocks] == [1, 0]
    bm.check_invariants()


def test_a_chain_root_keeps_tenants_prefixes_apart():
    """Issue 18, item 7: blocks cached under one tenant's root match only that root."""
    from kvstream.kv.hashing import tenant_root

    bm = BlockManager(16, 4, model_identity="m")
    alice, bob = tenant_root("alice"), tenant_root("bob")
    prompt = list(range(13))
    assert bm.allocate("a1", prompt, alice) == 0
    bm.free("a1")
    assert bm.allocate("b1", prompt, bob) == 0  # Bob cannot match (or confirm) Alice's prompt
    assert bm.allocate("shared", prompt) == 0  # nor can an untagged request
    assert bm.allocate("a2", prompt, alice) == 12  # Alice hits her own
    bm.check_invariants()


def test_a_hit_on_a_retained_prefix_keeps_it_for_its_whole_retention_again():
    """Each read refreshes a retention (Anthropic's cache is kept its TTL from its last use):
    a prefix retained for 10 s and hit at 8 s is retained until 10 s after that request ends,
    by a request with no retention of its own; one not hit lapses at its time."""
    clock = FakeClock()
    bm = make_bm(num_blocks=8, block_size=2, cpu=0, clock=clock)
    bm.allocate("a", [1, 2, 3, 4])
    bm.free("a", retain=[(4, clock.now + 10)])
    bm.allocate("b", [5, 6, 7, 8])
    bm.free("b", retain=[(4, clock.now + 10)])
    clock.now = 8
    bm.allocate("c", [1, 2, 3, 4, 9])  # a hit on [1,2,3,4], no retention asked
    assert bm.tables["c"].num_cached_tokens == 4
    clock.now = 9
    bm.free("c")
    assert bm.pool.num_retained == 4
    clock.now = 12  # [5..8] lapsed at 10; [1..4] runs until 19
    assert bm.pool.num_retained == 2
    assert {b.block_id for b in bm.pool.blocks if b.retain_until == 19} == {
        b.block_id for b in bm.cached_prefix([1, 2, 3, 4, 0])}
    clock.now = 19.5
    assert bm.pool.num_retained == 0 and len(bm.cached_prefix([1, 2, 3, 4, 0])) == 2  # ordinary cached blocks now
    bm.check_invariants()
