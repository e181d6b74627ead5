"""The in-process engine's reuse on top of the mechanism (kvstream/hf/block_manager.py):
partial blocks, the content index, spill restores and approximate KV, with exact block ids.
Pure Python: no torch needed."""

from __future__ import annotations

from kvstream.hf.block_manager import ReuseBlockManager
from kvstream.kv import BlockManager, hash_block
from kvstream.scheduler import Scheduler, SchedulerConfig, Sequence


class FakeSpill:
    """A spill tier holding records by (hash, tokens), like kv_store.HostBlockStore."""

    def __init__(self) -> None:
        self.records: dict[tuple[bytes, tuple[int, ...]], object] = {}
        self.lost: set[bytes] = set()  # dropped between contains() and get()

    def contains(self, block_hash, token_ids):
        return (block_hash, token_ids) in self.records

    def get(self, block_hash, token_ids):
        if block_hash in self.lost:
            return None
        return self.records.get((block_hash, token_ids))


def test_a_finished_sequences_partial_last_block_is_reused_token_for_token():
    """The computed head of a freed table's last, partial block is kept by its parent hash; a
    prompt continuing it copies what matches."""
    bm = ReuseBlockManager(16, 8)
    first = list(range(100, 120))  # 2 full blocks + 4 tokens
    bm.allocate("a", first)
    assert [b.block_id for b in bm.tables["a"].blocks] == [0, 1, 2]
    bm.commit("a", len(first))
    bm.free("a")
    bm.check_invariants()
    assert bm.pool.num_partial == 1
    # The next turn: everything computed so far, then new tokens.
    assert bm.allocate("b", first + [7, 8, 9]) == 20
    assert [b.block_id for b in bm.tables["b"].blocks] == [0, 1, 3]
    assert bm.partial_copies == [(2, 3)]  # the kept head of block 2 is copied into block 3
    bm.partial_copies.clear()
    bm.check_invariants()
    # Diverging inside the partial block reuses up to the divergence.
    assert bm.allocate("c", first[:18] + [1, 2, 3]) == 18
    # Diverging before it falls back to whole blocks; a prompt ending inside it leaves one token.
    assert bm.allocate("d", first[:10] + [5, 5, 5, 5]) == 8
    assert bm.allocate("e", first[:19]) == 18
    bm.check_invariants()


def test_a_partial_block_handed_out_by_the_same_allocation_is_still_copied():
    """A full pool: the kept partial block is the next free block, so allocate() gives it to
    the new table itself; the copy (which runs before any write) still finds its bytes."""
    bm = ReuseBlockManager(3, 4)
    bm.allocate("a", [1, 2, 3, 4, 5, 6])
    bm.commit("a", 6)
    bm.free("a")
    assert bm.pool.free_block_ids() == [2, 0, 1]  # unhashed first, then cached; partial is 1
    assert bm.allocate("b", [1, 2, 3, 4, 5, 6, 7]) == 6
    assert [b.block_id for b in bm.tables["b"].blocks] == [0, 2]
    assert bm.partial_copies == [(1, 2)]
    bm.check_invariants()


def test_partial_blocks_are_never_kept_for_remote_runtimes_or_uncomputed_tokens():
    remote = BlockManager(16, 8)  # hash_on_append: a remote runtime's estimate
    remote.allocate("a", list(range(20)))
    remote.free("a")
    assert remote.allocate("b", list(range(20)) + [1]) == 16
    bm = ReuseBlockManager(16, 8)
    bm.allocate("a", list(range(20)))
    bm.commit("a", 17)  # aborted mid-prefill: only 17 tokens have KV
    bm.free("a")
    assert bm.allocate("b", list(range(20)) + [1]) == 17


def test_spilled_blocks_after_the_hits_are_restored_into_the_fresh_blocks():
    spill = FakeSpill()
    bm = ReuseBlockManager(8, 4, spill=spill, model_identity="m")
    prompt = list(range(13))  # blocks [0-3] [4-7] [8-11] [12]
    h0 = hash_block(None, tuple(prompt[0:4]), bm.salt)
    h1 = hash_block(h0, tuple(prompt[4:8]), bm.salt)
    h2 = hash_block(h1, tuple(prompt[8:12]), bm.salt)
    spill.records[(h0, tuple(prompt[0:4]))] = "r0"
    spill.records[(h1, tuple(prompt[4:8]))] = "r1"
    spill.records[(h2, tuple(prompt[8:12]))] = "r2"
    spill.lost.add(h2)  # listed, but gone when read: computed instead
    assert bm.allocate("a", prompt) == 8
    assert [b.block_id for b in bm.tables["a"].blocks] == [0, 1, 2, 3]
    assert bm.restores == [(0, "r0"), (1, "r1")]
    assert bm.tables["a"].hashes == [h0, h1]
    assert bm.pool.evictions == []  # logging is on because there is a spill tier
    bm.check_invariants()


def test_the_pool_logs_reclaimed_cached_blocks_for_the_spill_tiers():
    bm = ReuseBlockManager(2, 2, spill=FakeSpill())
    bm.allocate("a", [1, 2, 3])
    bm.commit("a", 3)
    bm.free("a")  # block 0 = [1,2] cached; block 1 keeps [3] as a partial block
    bm.allocate("b", [7, 8, 9])  # takes both: the cached one is logged before it is reused
    assert [(block_id, tokens) for block_id, _, tokens in bm.pool.evictions] == [(0, (1, 2))]
    bm.check_invariants()


def test_blended_kv_never_enters_the_prefix_cache():
    bm = ReuseBlockManager(16, 4)
    bm.allocate("a", list(range(12)))
    bm.mark_approximate("a", 5)  # tokens 5.. hold moved KV
    bm.commit("a", 12)
    assert len(bm.tables["a"].hashes) == 1  # only the block before the approximate span
    assert bm.pool.lookup_content((0, 1, 2, 3)) is bm.tables["a"].blocks[0]
    bm.free("a")
    assert bm.pool.num_partial == 1 and bm.exact_until == {}  # the head [4] of block 1 is kept
    assert bm.allocate("b", list(range(12)) + [0]) == 5
    bm.check_invariants()


def test_a_cached_block_older_than_the_ttl_is_not_reused():
    """prefix_cache.ttl_seconds: the scheduler forgets cached blocks idle past the TTL."""
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    bm = BlockManager(16, 4, clock=clock)
    sched = Scheduler(bm, SchedulerConfig(cache_ttl_s=60.0), preemptible=False, clock=clock)
    first = Sequence(list(range(9)), 1, arrival=0.0)
    sched.add(first)
    sched.schedule()
    sched.finish(first)
    now[0] = 30.0  # within the TTL: reused
    again = Sequence(list(range(9)), 1, arrival=30.0)
    sched.add(again)
    sched.schedule()
    assert again.num_cached_tokens == 8
    sched.finish(again)
    now[0] = 91.0  # last used at 30: past the TTL
    late = Sequence(list(range(9)), 1, arrival=91.0)
    sched.add(late)
    sched.schedule()
    assert late.num_cached_tokens == 0
    assert bm.pool.stats.expired == 2
    sched.check_invariants()
