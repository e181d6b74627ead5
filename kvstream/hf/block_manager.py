"""The in-process engine's reuse on top of the mechanism: what only an engine that owns the KV
bytes can do, kept out of kvstream/kv so that the mechanism stays the mechanism.

``ReusePool`` (a BlockPool) adds:

* a content index: full cached blocks by their tokens alone, whatever preceded them, so a
  blend can move a chunk that appears at another position (blend.py);
* partial blocks: the computed head of a finished sequence's last block, findable by its
  parent block's hash, so that a conversation's next turn reuses up to its exact last token;
  they live in the free queue like cached blocks and are evicted like them;
* an eviction log: cached blocks that ``allocate`` reclaims, recorded before their hash is
  dropped, so that spill tiers can save their KV before anyone writes to the block again.

``ReuseBlockManager`` (a BlockManager) adds, on allocation, blocks restored from the spill
tiers after the pool's hits and a partial-block hit after those; and it keeps approximate
(blended) KV out of the prefix cache. The copies these need wait in ``restores`` and
``partial_copies`` for the model runner to carry out before the next forward pass.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from kvstream.kv.block_manager import UNKNOWN_TOKEN, BlockManager, BlockTable, SeqId
from kvstream.kv.block_pool import Block, BlockPool
from kvstream.kv.hashing import BlockHash, hash_block

# Marks the hash of a partial block (never equal to a real 16-byte digest).
PARTIAL = b"partial:"


class SpillLookup(Protocol):
    """Where blocks reclaimed from the pool went (kv_store.HostBlockStore)."""

    def contains(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> bool: ...

    def get(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> object | None: ...


class ReusePool(BlockPool):
    """A BlockPool with a content index, partial blocks and an eviction log (see above)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._by_content: dict[tuple[int, ...], Block] = {}
        self._partial: dict[BlockHash, Block] = {}
        # None: nobody spills, so nothing is recorded.
        self.evictions: list[tuple[int, BlockHash, tuple[int, ...]]] | None = None

    @property
    def num_partial(self) -> int:
        """Partial blocks kept (each findable by its parent's hash)."""
        return len(self._partial)

    def lookup_content(self, token_ids: tuple[int, ...]) -> Block | None:
        """A cached full block holding exactly these tokens, computed after any prefix."""
        return self._by_content.get(token_ids)

    def lookup_partial(self, parent: BlockHash | None) -> Block | None:
        """The kept partial block that followed ``parent`` (None: the first block)."""
        return self._partial.get(parent or b"")

    def allocate(self) -> Block:
        """BlockPool.allocate, logging a reclaimed full cached block first (when logging)."""
        self._end_retention()  # (what allocate hands out is then the queue's first)
        if self.evictions is not None and self._free:
            block = next(iter(self._free.values()))
            if block.block_hash is not None and self._cached.get(block.block_hash) is block:
                self.evictions.append((block.block_id, block.block_hash, block.token_ids or ()))
        return super().allocate()

    def cache(self, block: Block, block_hash: BlockHash, token_ids: tuple[int, ...], start: int = 0) -> Block:
        """BlockPool.cache, also indexing the canonical block by its content."""
        canonical = super().cache(block, block_hash, token_ids, start)
        if canonical is block:
            self._by_content[token_ids] = block
        return canonical

    def cache_partial(self, block: Block, parent: BlockHash | None, token_ids: tuple[int, ...]) -> None:
        """Keep a free block whose first ``len(token_ids)`` slots hold computed KV, for a
        later sequence that continues ``parent``'s chain with the same tokens (it copies
        them). The newest partial block for a parent replaces an older one."""
        key = parent or b""
        old = self._partial.get(key)
        if old is not None and old is not block:
            self._uncache(old)
            if old.ref_cnt == 0:
                self._free.move_to_end(old.block_id, last=False)
        block.block_hash = PARTIAL + key
        block.token_ids = token_ids
        self._partial[key] = block
        if block.ref_cnt == 0:
            self._free.move_to_end(block.block_id)  # most recently used
        block.last_used = self.clock()  # type: ignore[operator]

    def _uncache(self, block: Block) -> None:
        assert block.block_hash is not None
        if block.block_hash.startswith(PARTIAL):
            key = block.block_hash[len(PARTIAL) :]
            if self._partial.get(key) is block:
                del self._partial[key]
            block.block_hash = None
            block.token_ids = None
            return
        if self._by_content.get(block.token_ids) is block:  # type: ignore[arg-type]
            del self._by_content[block.token_ids]  # type: ignore[arg-type]
        super()._uncache(block)

    def _check_hashed(self, block: Block) -> None:
        assert block.block_hash is not None
        if block.block_hash.startswith(PARTIAL):
            key = block.block_hash[len(PARTIAL) :]
            assert self._partial.get(key) is block, f"partial block {block.block_id} is not findable"
            assert block.token_ids and len(block.token_ids) < self.block_size
            return
        super()._check_hashed(block)

    def check_invariants(self) -> None:
        super().check_invariants()
        for token_ids, block in self._by_content.items():
            assert block.token_ids == token_ids and self._cached.get(block.block_hash) is block, (  # type: ignore[arg-type]
                f"content map entry for block {block.block_id} is stale"
            )


class ReuseBlockManager(BlockManager):
    """A BlockManager for an engine that computes the KV itself (``hash_on_append`` off:
    blocks are shared once ``commit`` says their KV is written)."""

    pool_class = ReusePool
    pool: ReusePool

    def __init__(self, *args: object, spill: SpillLookup | None = None, **kwargs: object) -> None:
        """``spill``: the tiers below the pool; the pool then logs what it reclaims for them."""
        kwargs["hash_on_append"] = False
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.spill = spill
        if spill is not None:
            self.pool.evictions = []
        # (block_id, record) restored from the spill tiers, to copy in before the next step.
        self.restores: list[tuple[int, object]] = []
        # (src, dst) copies for partial-block hits, to run before anything writes again.
        self.partial_copies: list[tuple[int, int]] = []
        # Per sequence: tokens from here on hold approximate KV (moved by a blend) and are
        # never entered into the prefix cache.
        self.exact_until: dict[SeqId, int] = {}

    def allocate(
        self, seq_id: SeqId, token_ids: Sequence[int], root: BlockHash | None = None, *, max_reused: int | None = None
    ) -> int:
        """BlockManager.allocate, then reuse past the pool's hits: blocks the spill tiers
        hold, then the head of a kept partial block. Returns the prompt tokens whose KV is
        reused (or will be, once ``restores`` and ``partial_copies`` are carried out).
        ``max_reused`` (a request scoring its prompt): the pool's hits only, that many
        tokens at most."""
        if max_reused is not None:
            return super().allocate(seq_id, token_ids, root, max_reused=max_reused)
        # Found before allocate() runs: it may hand the partial block out (its bytes stay
        # until the copy, which runs before anything writes to the pool).
        partial = self._partial_after_chain(token_ids, root)
        super().allocate(seq_id, token_ids, root)
        table = self.tables[seq_id]
        for index, block_hash, chunk in self._spill_chain(token_ids, len(table.hashes), root):
            record = self.spill.get(block_hash, chunk)  # type: ignore[union-attr]
            if record is None:
                break  # dropped or damaged since the lookup: computed instead
            # The fresh block allocate() gave this position receives the spilled KV.
            block = table.blocks[index]
            self.pool.cache(block, block_hash, chunk, index * self.block_size)
            table.hashes.append(block_hash)
            table.num_cached_tokens += self.block_size
            self.restores.append((block.block_id, record))
        if partial is not None and (table.hashes[-1] if table.hashes else root) == partial[0]:
            self._continue_partial(table, token_ids, *partial[1:])
        return table.num_cached_tokens

    def _spill_chain(
        self, token_ids: Sequence[int], start: int, root: BlockHash | None
    ) -> Iterator[tuple[int, BlockHash, tuple[int, ...]]]:
        """(index, hash, tokens) of the blocks from block ``start`` on that the spill tiers
        hold and the pool does not (a block the pool holds again is left to its lookup)."""
        if self.spill is None or not self.enable_prefix_cache:
            return
        parent = root
        for index in range(self.reuse_limit(len(token_ids)) // self.block_size):
            chunk = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            if UNKNOWN_TOKEN in chunk:
                return
            parent = hash_block(parent, chunk, self.salt)
            if index < start:
                continue
            if self.pool.lookup(parent, chunk) is not None or not self.spill.contains(parent, chunk):
                return
            yield index, parent, chunk

    def _partial_after_chain(
        self, token_ids: Sequence[int], root: BlockHash | None
    ) -> tuple[BlockHash | None, int, tuple[int, ...]] | None:
        """(parent hash, block id, kept tokens) of the partial block that would continue the
        chain of hits and spilled blocks of ``token_ids``, if one is kept."""
        if not self.enable_prefix_cache or not self.pool.num_partial:
            return None
        hits = self.cached_prefix(token_ids, root)
        parent = hits[-1].block_hash if hits else root
        for _, block_hash, _ in self._spill_chain(token_ids, len(hits), root):
            parent = block_hash
        block = self.pool.lookup_partial(parent)
        return None if block is None else (parent, block.block_id, block.token_ids or ())

    def _continue_partial(self, table: BlockTable, token_ids: Sequence[int], block_id: int, kept: tuple[int, ...]) -> None:
        """Copy the head of a kept partial block that the prompt shares (leaving at least
        one token to compute)."""
        start = table.num_cached_tokens
        if start % self.block_size:
            return
        matched = 0
        for old, new in zip(kept, token_ids[start : self.reuse_limit(len(token_ids))]):
            if old != new:
                break
            matched += 1
        if matched:
            self.partial_copies.append((block_id, table.blocks[start // self.block_size].block_id))
            table.num_cached_tokens += matched

    def commit(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        """BlockManager.commit; blocks past the sequence's exact KV are never shared."""
        table = self.tables[seq_id]
        exact = min(num_computed_tokens, self.exact_until.get(seq_id, num_computed_tokens))
        super().commit(seq_id, exact)
        table.computed = num_computed_tokens

    def mark_approximate(self, seq_id: SeqId, position: int) -> None:
        """From ``position`` on, the sequence's KV is approximate (blend reuse): those blocks,
        and every block after them, are never entered into the prefix cache."""
        self.exact_until[seq_id] = min(position, self.exact_until.get(seq_id, position))

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """BlockManager.fork; the child's KV is as approximate as its parent's."""
        super().fork(parent_id, child_id)
        if parent_id in self.exact_until:
            self.exact_until[child_id] = self.exact_until[parent_id]

    def free(self, seq_id: SeqId, retain: Sequence[tuple[int, float]] = ()) -> None:
        """BlockManager.free, keeping the computed head of the table's partial last block."""
        table = self.tables.get(seq_id)
        super().free(seq_id, retain)
        exact = self.exact_until.pop(seq_id, None)
        if table is not None:
            self._keep_partial_tail(table, table.computed if exact is None else min(table.computed, exact))

    def _keep_partial_tail(self, table: BlockTable, computed: int) -> None:
        full, rest = divmod(computed, self.block_size)
        if not rest or not self.enable_prefix_cache or len(table.hashes) != full or full >= len(table.blocks):
            return
        block = table.blocks[full]
        tokens = tuple(table.token_ids[full * self.block_size : computed])
        if block.ref_cnt or block.block_hash is not None or UNKNOWN_TOKEN in tokens:
            return  # shared with a fork, or not ours to keep
        self.pool.cache_partial(block, table.hashes[-1] if table.hashes else table.root, tokens)
