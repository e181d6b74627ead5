"""A pool of fixed-size KV blocks: reference counts, an LRU free queue and the prefix-cache map.

Every block is in exactly one of three states:

* in use: ``ref_cnt >= 1``, held by one or more block tables, not in the free queue;
* free and cached: ``ref_cnt == 0`` with a hash, in the free queue and in the cache map, so a
  later request with the same prefix can take it back (vLLM v1 semantics);
* free: ``ref_cnt == 0``, no hash, in the free queue.

The free queue is ordered for eviction: blocks without a hash are handed out first, then
cached blocks from least to most recently used.

A free cached block may also be *retained* until a time (a client asked for its prefix to
be kept: Anthropic's ``cache_control``, OpenAI's ``prompt_cache_retention``): it then waits
apart from the free queue and is handed out only when the queue is empty, the one whose
retention ends first. Retention orders eviction; it never refuses an allocation, so no
client can hold the pool, and at most half the pool's blocks wait retained (past that, the
one whose retention ends first becomes an ordinary cached block), so that one client's marks
cannot push every other prefix out first. When it ends, the block joins the free queue as
used then. A retained block used again (a prefix hit) is kept for its whole retention again
from when that use frees it: each read refreshes it, as Anthropic's cache is refreshed.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvstream.kv.hashing import BlockHash


class NoFreeBlocks(Exception):
    """Raised when the pool has no block to hand out (callers preempt or wait)."""


@dataclass(slots=True, eq=False)
class Block:
    """One KV block: ``block_size`` token slots in the runtime's (or our own) KV memory."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # The tokens the hash covers, kept to rule out a hash collision on lookup.
    token_ids: tuple[int, ...] | None = None
    last_used: float = 0.0
    # Position of the block's first token in the sequence that computed it (for moving its
    # KV elsewhere: RoPE keys carry their position).
    start: int = 0
    # Kept past ordinary cached blocks until this clock time once free (0: not retained),
    # and for how long (seconds): a use while retained keeps it that long again.
    retain_until: float = 0.0
    retain_s: float = 0.0


@dataclass(slots=True)
class PoolStats:
    """Counters the metrics and /status read."""

    cache_queries: int = 0  # blocks looked up
    cache_hits: int = 0  # blocks found
    evictions: int = 0  # cached blocks whose hash was dropped to reuse the block
    expired: int = 0  # cached blocks dropped by the TTL
    retained_evictions: int = 0  # retained blocks made ordinary before their retention ended


@dataclass
class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens with O(1) allocate, free and lookup."""

    num_blocks: int
    block_size: int
    clock: object = time.monotonic
    blocks: list[Block] = field(init=False)
    stats: PoolStats = field(init=False, default_factory=PoolStats)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # Insertion order is eviction order: the first entry is handed out next.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        # Free cached blocks whose retention has not ended (handed out after the queue).
        self._retained: dict[int, Block] = {}
        # (retain_until, block_id), earliest first; entries of blocks taken back or retained
        # again since are skipped when they come up (_first_retained).
        self._lapses: list[tuple[float, int]] = []

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks with no holder, cached, retained or not (all of them can be handed out)."""
        return len(self._free) + len(self._retained)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one block table (ref_cnt >= 1)."""
        return self.num_blocks - self.num_free

    @property
    def num_retained(self) -> int:
        """Free cached blocks kept past the others (their retention not yet ended)."""
        self._release_lapsed()
        return len(self._retained)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a hash and are findable by a prefix lookup."""
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Ids of the free blocks in eviction order: the first is handed out next (retained
        blocks last, whose retention ends first first: where they go when it ends)."""
        self._release_lapsed()
        retained = sorted(self._retained.values(), key=lambda b: b.retain_until)
        return [*self._free, *(b.block_id for b in retained)]

    def usage(self) -> float:
        """Fraction of blocks held by live sequences, 0..1."""
        return self.num_used / self.num_blocks

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block for ``block_hash``, if its stored tokens match too."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    # ---------------------------------------------------------------- mutation
    def allocate(self) -> Block:
        """Take the next block off the free queue (ref_cnt 1); it loses any cached hash.
        Raises NoFreeBlocks when none is free."""
        self._end_retention()
        if not self._free:
            raise NoFreeBlocks
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            self._uncache(block)
            self.stats.evictions += 1
        block.ref_cnt = 1
        block.last_used = self.clock()
        return block

    def touch(self, block: Block) -> None:
        """Add a holder to ``block`` (a prefix hit or a fork); a free block leaves the free
        queue, so in-use blocks are never handed out."""
        if block.ref_cnt == 0:
            if self._retained.pop(block.block_id, None) is None:
                del self._free[block.block_id]
        block.ref_cnt += 1
        block.last_used = self.clock()

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one holder from each block; blocks nobody holds return to the free queue
        (cached ones keep their hash and stay findable; unhashed ones go to its head). Raises
        AssertionError on a double free, so ref_cnt never goes below zero.

        Pass a sequence's blocks tail first: among cached blocks freed together the tail of
        a chain is then evicted before its head, which more requests share.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                now = block.last_used = self.clock()
                if block.block_hash is not None and block.retain_s:  # used while retained: kept anew
                    block.retain_until = max(block.retain_until, now + block.retain_s)
                    self._keep_retained(block)
                    continue
                block.retain_until = block.retain_s = 0.0
                self._free[block.block_id] = block
                if block.block_hash is None:
                    # Nothing worth keeping: hand it out before any cached block.
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: Block, block_hash: BlockHash, token_ids: tuple[int, ...], start: int = 0) -> Block:
        """Register a full, computed block under ``block_hash``.

        If another block already carries the hash (two sequences computed the same prefix at
        once) the existing one stays canonical and ``block`` stays unhashed, so block tables
        never change under a running sequence. Returns the canonical block.
        """
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise AssertionError(f"block {block.block_id} re-hashed with a different hash")
            return block
        existing = self._cached.get(block_hash)
        if existing is not None:
            return existing
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.start = start
        self._cached[block_hash] = block
        return block

    def retain(self, block: Block, until: float) -> None:
        """Keep ``block`` (held, and in the prefix cache) past ordinary cached blocks until
        clock time ``until`` once it is free; a later ``until`` extends it."""
        assert block.ref_cnt > 0 and block.block_hash is not None, f"block {block.block_id} is not held and cached"
        block.retain_until = max(block.retain_until, until)
        block.retain_s = max(block.retain_s, until - self.clock())

    def _keep_retained(self, block: Block) -> None:
        """A free block whose retention runs: apart from the queue, within half the pool."""
        self._retained[block.block_id] = block
        heapq.heappush(self._lapses, (block.retain_until, block.block_id))
        if len(self._lapses) > 2 * len(self._retained) + 64:  # mostly skipped entries: rebuild
            self._lapses = [(b.retain_until, b.block_id) for b in self._retained.values()]
            heapq.heapify(self._lapses)
        if len(self._retained) > self.num_blocks // 2:
            self._unretain(self._first_retained(), early=True)  # type: ignore[arg-type]

    def _first_retained(self) -> Block | None:
        """The retained block whose retention ends first, or None."""
        while self._lapses:
            until, block_id = self._lapses[0]
            block = self._retained.get(block_id)
            if block is not None and block.retain_until == until:
                return block
            heapq.heappop(self._lapses)  # taken back (or retained again) since
        return None

    def _unretain(self, block: Block, early: bool) -> None:
        """``block``'s retention ends: it joins the free queue as used now."""
        del self._retained[block.block_id]
        block.retain_until, block.retain_s, block.last_used = 0.0, 0.0, self.clock()
        self._free[block.block_id] = block
        self.stats.retained_evictions += early

    def _release_lapsed(self) -> None:
        """Blocks whose retention ended join the free queue (lazily: whenever the pool is
        asked about them)."""
        if not self._lapses:  # (none retained: no clock read on the hot path)
            return
        now = self.clock()
        while (block := self._first_retained()) is not None and block.retain_until <= now:
            self._unretain(block, early=False)

    def _end_retention(self) -> None:
        """Before handing a block out: lapsed retention ended; with the queue empty, the
        retained block whose retention ends first joins it early."""
        self._release_lapsed()
        if not self._free and self._retained:
            self._unretain(self._first_retained(), early=True)  # type: ignore[arg-type]

    def drop_expired(self, ttl_seconds: float) -> int:
        """Forget cached blocks nobody holds that were last used over ``ttl_seconds`` ago;
        they move to the head of the free queue (handed out first). Returns how many."""
        self._release_lapsed()
        deadline = self.clock() - ttl_seconds
        stale = [b for b in self._free.values() if b.block_hash is not None and b.last_used < deadline]
        for block in stale:
            self._uncache(block)
            self._free.move_to_end(block.block_id, last=False)
        self.stats.expired += len(stale)
        return len(stale)

    def reset_cache(self) -> None:
        """Forget every cached hash held by no one (the runtime lost its KV); in-use blocks
        keep theirs."""
        for block in self._retained.values():
            block.retain_until = block.retain_s = 0.0
            self._free[block.block_id] = block
        self._retained.clear()
        self._lapses.clear()
        for block in list(self._free.values()):
            if block.block_hash is not None:
                self._uncache(block)
                self._free.move_to_end(block.block_id, last=False)

    def _uncache(self, block: Block) -> None:
        """Drop ``block``'s hash and tokens (subclasses with more indexes drop it there too)."""
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    # -------------------------------------------------------------- invariants
    def _check_hashed(self, block: Block) -> None:
        """A hashed block is full and is the one its hash finds."""
        assert block.token_ids is not None and len(block.token_ids) == self.block_size, (
            f"block {block.block_id} is hashed but not full"
        )
        assert block.block_hash is not None and self._cached.get(block.block_hash) is block, (
            f"block {block.block_id} is hashed but not findable"
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's own state is inconsistent."""
        for block in self.blocks:
            in_free = block.block_id in self._free or block.block_id in self._retained
            assert not (block.block_id in self._free and block.block_id in self._retained), f"block {block.block_id} is free twice"
            if block.block_id in self._retained:
                assert block.block_hash is not None and block.retain_until > 0 < block.retain_s, \
                    f"retained block {block.block_id} is not cached"
                assert (block.retain_until, block.block_id) in self._lapses, f"retained block {block.block_id} never lapses"
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert in_free == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue={in_free}"
            )
            if block.block_hash is not None:
                self._check_hashed(block)
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"cache map entry for block {block.block_id} is stale"
        assert self.num_free + sum(1 for b in self.blocks if b.ref_cnt > 0) == self.num_blocks
