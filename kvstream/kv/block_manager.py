"""Per-sequence block tables over a BlockPool: prefix sharing, streaming growth, copy-on-write
forks and an all-or-nothing CPU swap pool.

The manager decides *which* blocks hold a sequence's KV; moving bytes is the backend's job.
Every mutation that needs bytes moved returns the copies to perform as ``(src, dst)`` block-id
pairs: a copy-on-write on append, a swap out (device -> host) or a swap in (host -> device).
A backend that only accounts for a remote runtime's memory ignores them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvstream.kv.block_pool import Block, BlockPool, NoFreeBlocks
from kvstream.kv.hashing import BlockHash, hash_block, model_key

SeqId = Hashable

# Token id for a token whose id the backend does not report (remote runtimes that stream
# text). Blocks holding one are counted but never hashed.
UNKNOWN_TOKEN = -1


@dataclass(slots=True)
class BlockTable:
    """The blocks holding one sequence's KV, in order, and the tokens they hold."""

    blocks: list[Block] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # Hashes of the leading full blocks, chained; len(hashes) <= len(blocks).
    hashes: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at allocation
    # Tokens whose KV is written (reported by commit(); in-process engines only).
    computed: int = 0
    # The chain's start: a tenant's cache salt, so that its blocks match only its own.
    root: BlockHash | None = None


@dataclass(slots=True)
class SwappedTable:
    """A swapped-out sequence: host blocks for what it held alone, device refs for the rest."""

    # One entry per logical block: a Block still shared on the device, or a host block id.
    entries: list[Block | int]
    token_ids: list[int]
    hashes: list[BlockHash]
    num_cached_tokens: int
    computed: int = 0
    root: BlockHash | None = None


class BlockManager:
    """Allocates, grows, forks, swaps and frees block tables over one device pool.

    Subclasses that add reuse of their own (the in-process engine's partial blocks and spill
    tiers, kvstream/hf/block_manager.py) set ``pool_class`` and extend ``allocate``,
    ``commit``, ``fork`` and ``free``; the invariants below hold for them too.
    """

    pool_class: type[BlockPool] = BlockPool

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        *,
        enable_prefix_cache: bool = True,
        max_prefix_length: int | None = None,
        model_identity: str = "",
        clock: object | None = None,
        hash_on_append: bool = True,
    ) -> None:
        kwargs = {"clock": clock} if clock is not None else {}
        self.pool = self.pool_class(num_gpu_blocks, block_size, **kwargs)
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_free: list[int] = list(range(num_cpu_blocks - 1, -1, -1))
        self.enable_prefix_cache = enable_prefix_cache
        self.max_prefix_length = max_prefix_length
        self.salt = model_key(model_identity)
        # Remote runtimes compute a token's KV as soon as it streams, so a block is shared
        # the moment it fills. An in-process engine appends a prompt before computing it and
        # calls commit() after the forward pass, so no sequence ever shares unwritten KV.
        self.hash_on_append = hash_on_append
        self.tables: dict[SeqId, BlockTable] = {}
        self.swapped: dict[SeqId, SwappedTable] = {}

    # ------------------------------------------------------------------ sizing
    @property
    def num_free_blocks(self) -> int:
        """Device blocks that can be handed out (free, cached or not)."""
        return self.pool.num_free

    @property
    def num_free_cpu_blocks(self) -> int:
        """Host blocks not holding a swapped sequence."""
        return len(self._cpu_free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, token_ids: Sequence[int], root: BlockHash | None = None, max_reused: int | None = None) -> list[Block]:
        """The cached blocks that a sequence with these prompt tokens (and chain ``root``)
        would share.

        At least one prompt token is always left to compute (a runtime needs a forward pass
        to produce the next token's logits), and the hit is capped at max_prefix_length and
        at ``max_reused`` tokens (None: no cap of its own).
        """
        if not self.enable_prefix_cache:
            return []
        limit = self.reuse_limit(len(token_ids))
        if max_reused is not None:
            limit = min(limit, max_reused)
        hits: list[Block] = []
        parent = root
        for start in range(0, limit - self.block_size + 1, self.block_size):
            chunk = tuple(token_ids[start : start + self.block_size])
            if UNKNOWN_TOKEN in chunk:
                break
            parent = hash_block(parent, chunk, self.salt)
            block = self.pool.lookup(parent, chunk)
            if block is None:
                break
            hits.append(block)
        return hits

    def prefix_in_flight(self, token_ids: Sequence[int], root: BlockHash | None = None) -> int:
        """Prompt tokens past the cached prefix that a live sequence of the same chain holds
        in full blocks but has not computed yet (in-process engines: they become cached as
        that sequence commits them). 0 where blocks are hashed on append (remote runtimes:
        no computed count) or prefix caching is off."""
        if not self.enable_prefix_cache or self.hash_on_append:
            return 0
        size = self.block_size
        limit = self.reuse_limit(len(token_ids)) // size * size
        # Only tables still prefilling (their own tokens not all computed) and behind the
        # tokens in question: few at a time, so this stays cheap with hundreds running.
        prefilling = [
            t for t in self.tables.values() if t.root == root and t.computed < min(limit, len(t.token_ids) - 1)
        ]
        if not prefilling:
            return 0
        cached = len(self.cached_prefix(token_ids, root)) * size
        best = cached
        for table in prefilling:
            shared = 0  # full blocks this table holds with the same tokens, from the start
            while shared < limit and table.token_ids[shared : shared + size] == token_ids[shared : shared + size]:
                shared += size
            shared = min(shared, len(table.token_ids) // size * size)
            if shared > max(best, table.computed):
                best = shared
        return best - cached

    def reuse_limit(self, num_tokens: int) -> int:
        """Most prompt tokens any reuse may cover: all but the last (its logits are needed),
        capped at max_prefix_length."""
        limit = num_tokens - 1
        return limit if self.max_prefix_length is None else min(limit, self.max_prefix_length)

    def blocks_needed(self, token_ids: Sequence[int], root: BlockHash | None = None, *, max_reused: int | None = None) -> int:
        """Free blocks that allocate(token_ids) would consume, counting cached hits that are
        idle (they leave the free queue when taken)."""
        return self._blocks_needed(len(token_ids), self.cached_prefix(token_ids, root, max_reused))

    def _blocks_needed(self, num_tokens: int, hits: list[Block]) -> int:
        idle_hits = sum(1 for b in hits if b.ref_cnt == 0)
        return self.blocks_for(num_tokens) - len(hits) + idle_hits

    # -------------------------------------------------------------- lifecycle
    def allocate(
        self, seq_id: SeqId, token_ids: Sequence[int], root: BlockHash | None = None, *, max_reused: int | None = None
    ) -> int:
        """Give a new sequence blocks for its prompt, sharing cached prefix blocks of the
        same chain ``root`` (a tenant's salt; None: the shared chain), at most ``max_reused``
        tokens of them (0: every position computed; its full blocks are still cached once
        computed).

        Returns the number of prompt tokens whose KV is already cached. All or nothing: on
        NoFreeBlocks nothing is held.
        """
        if seq_id in self.tables or seq_id in self.swapped:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if not token_ids:
            raise ValueError("a sequence needs at least one token")
        hits = self.cached_prefix(token_ids, root, max_reused)
        if self._blocks_needed(len(token_ids), hits) > self.pool.num_free:
            raise NoFreeBlocks
        table = BlockTable(root=root)
        for block in hits:
            self.pool.touch(block)
            table.blocks.append(block)
        table.hashes = [b.block_hash for b in hits if b.block_hash is not None]  # every hit is hashed
        table.num_cached_tokens = len(hits) * self.block_size
        table.token_ids = list(token_ids[: table.num_cached_tokens])
        self.tables[seq_id] = table
        self.pool.stats.cache_queries += self.blocks_for(len(token_ids))
        self.pool.stats.cache_hits += len(hits)
        for token in token_ids[table.num_cached_tokens :]:
            self._append(table, token)
        return table.num_cached_tokens

    def append_token(self, seq_id: SeqId, token_id: int = UNKNOWN_TOKEN) -> tuple[int, int] | None:
        """Append one token, taking a new block when the last one is full.

        Returns a ``(src, dst)`` copy when the last block was shared and had to be copied
        first (copy-on-write), else None. Raises NoFreeBlocks, changing nothing, when a block
        is needed and none is free.
        """
        return self._append(self.tables[seq_id], token_id)

    def _append(self, table: BlockTable, token_id: int) -> tuple[int, int] | None:
        copy = None
        pos = len(table.token_ids)
        if pos % self.block_size == 0:
            table.blocks.append(self.pool.allocate())
        elif table.blocks[-1].ref_cnt > 1:
            # A fork shares its parent's partial last block: copy before writing into it.
            fresh = self.pool.allocate()
            shared = table.blocks[-1]
            self.pool.free([shared])
            table.blocks[-1] = fresh
            copy = (shared.block_id, fresh.block_id)
        table.token_ids.append(token_id)
        if self.hash_on_append and (pos + 1) % self.block_size == 0:
            self._seal(table, len(table.blocks) - 1)
        return copy

    def commit(self, seq_id: SeqId, num_computed_tokens: int) -> None:
        """Make the full blocks among the first ``num_computed_tokens`` tokens shareable:
        their KV has been written (in-process engines, ``hash_on_append=False``), so no block
        is ever shared before its KV exists. Returns nothing."""
        table = self.tables[seq_id]
        table.computed = num_computed_tokens
        for index in range(len(table.hashes), num_computed_tokens // self.block_size):
            if not self._seal(table, index):
                break

    def _seal(self, table: BlockTable, index: int) -> bool:
        """Hash full block ``index`` so later requests can share it; False when the chain is
        broken (prefix caching off, an earlier block unhashable, or an unknown token)."""
        if not self.enable_prefix_cache or len(table.hashes) != index:
            return False
        chunk = tuple(table.token_ids[index * self.block_size : (index + 1) * self.block_size])
        if UNKNOWN_TOKEN in chunk:
            return False
        parent = table.hashes[-1] if table.hashes else table.root
        block_hash = hash_block(parent, chunk, self.salt)
        self.pool.cache(table.blocks[index], block_hash, chunk, index * self.block_size)
        table.hashes.append(block_hash)
        return True

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Give ``child_id`` a table sharing every block of ``parent_id`` (each block's ref_cnt
        goes up by one; the first write into a shared partial block copies it first). Returns
        nothing; raises ValueError if ``child_id`` already holds blocks."""
        if child_id in self.tables or child_id in self.swapped:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        parent = self.tables[parent_id]
        for block in parent.blocks:
            self.pool.touch(block)
        self.tables[child_id] = BlockTable(
            list(parent.blocks), list(parent.token_ids), list(parent.hashes), parent.num_cached_tokens, parent.computed,
            parent.root,
        )

    def free(self, seq_id: SeqId, retain: Sequence[tuple[int, float]] = ()) -> None:
        """Release everything a sequence holds, running or swapped: device blocks lose one
        holder each (tail first, so a chain's tail is evicted before its head), host blocks go
        back to the host pool. Unknown ids are ignored, so every exit path may call it.

        ``retain``: ``(tokens, until)`` pairs: the cached blocks that hold the first
        ``tokens`` tokens are kept past ordinary cached blocks until clock time ``until``
        (BlockPool.retain; only a running sequence's, whose blocks are on the device)."""
        table = self.tables.pop(seq_id, None)
        if table is not None:
            for tokens, until in retain:
                for block in table.blocks[: min(tokens // self.block_size, len(table.hashes))]:
                    if block.block_hash is not None:
                        self.pool.retain(block, until)
            self.pool.free(reversed(table.blocks))
        swapped = self.swapped.pop(seq_id, None)
        if swapped is not None:
            for entry in reversed(swapped.entries):
                if isinstance(entry, Block):
                    self.pool.free([entry])
                else:
                    self._cpu_free.append(entry)

    # ------------------------------------------------------------------- swap
    def can_swap_out(self, seq_id: SeqId) -> bool:
        """Whether the host pool can take every block the sequence holds alone."""
        table = self.tables[seq_id]
        return sum(1 for b in table.blocks if b.ref_cnt == 1) <= len(self._cpu_free)

    def swap_out(self, seq_id: SeqId) -> list[tuple[int, int]]:
        """Move a sequence's blocks to the host pool; returns (gpu_id, cpu_id) copies.

        Blocks shared with other sequences stay on the device, still shared. All or nothing:
        raises NoFreeBlocks, changing nothing, when the host pool is short. The caller must
        perform the copies before the freed device blocks are allocated again.
        """
        if not self.can_swap_out(seq_id):
            raise NoFreeBlocks
        table = self.tables.pop(seq_id)
        entries: list[Block | int] = []
        copies: list[tuple[int, int]] = []
        for block in table.blocks:
            if block.ref_cnt > 1:
                entries.append(block)
            else:
                cpu_id = self._cpu_free.pop()
                copies.append((block.block_id, cpu_id))
                entries.append(cpu_id)
        # Freed last-to-first: cached tail blocks are evicted before the head of the chain.
        self.pool.free(reversed([b for b in table.blocks if b.ref_cnt == 1]))
        self.swapped[seq_id] = SwappedTable(
            entries, table.token_ids, table.hashes, table.num_cached_tokens, table.computed, table.root
        )
        return copies

    def can_swap_in(self, seq_id: SeqId) -> bool:
        """Whether the device pool has a block for every host block of the sequence."""
        swapped = self.swapped[seq_id]
        return sum(1 for entry in swapped.entries if not isinstance(entry, Block)) <= self.pool.num_free

    def blocks_to_resume(self, seq_id: SeqId) -> int:
        """Free device blocks a swapped sequence needs to come back and append one token: one
        per host block, and one more when that token opens a block (the last is full) or
        copies one (the last is still shared on the device: copy-on-write)."""
        swapped = self.swapped[seq_id]
        last = swapped.entries[-1] if swapped.entries else None
        full = len(swapped.token_ids) % self.block_size == 0
        shared = isinstance(last, Block) and last.ref_cnt > 1
        return sum(1 for entry in swapped.entries if not isinstance(entry, Block)) + int(full or shared)

    def swap_in(self, seq_id: SeqId) -> list[tuple[int, int]]:
        """Bring a swapped sequence back to the device; returns (cpu_id, gpu_id) copies.

        All or nothing: raises NoFreeBlocks, changing nothing, when the device is short.
        """
        if not self.can_swap_in(seq_id):
            raise NoFreeBlocks
        swapped = self.swapped.pop(seq_id)
        table = BlockTable(
            token_ids=swapped.token_ids, hashes=swapped.hashes, num_cached_tokens=swapped.num_cached_tokens,
            computed=swapped.computed, root=swapped.root,
        )
        copies: list[tuple[int, int]] = []
        for index, entry in enumerate(swapped.entries):
            if isinstance(entry, Block):
                table.blocks.append(entry)
                continue
            self._cpu_free.append(entry)
            chunk = tuple(swapped.token_ids[index * self.block_size : (index + 1) * self.block_size])
            if index < len(swapped.hashes):
                cached = self.pool.lookup(swapped.hashes[index], chunk)
                if cached is not None:
                    # The device copy is still in the prefix cache: no bytes to move.
                    self.pool.touch(cached)
                    table.blocks.append(cached)
                    continue
            block = self.pool.allocate()
            copies.append((entry, block.block_id))
            if index < len(swapped.hashes):
                self.pool.cache(block, swapped.hashes[index], chunk, index * self.block_size)
            table.blocks.append(block)
        self.tables[seq_id] = table
        return copies

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Raise AssertionError if any invariant of DESIGN.md section 3 is broken."""
        self.pool.check_invariants()
        holders: dict[int, int] = {}
        for table in self.tables.values():
            assert len(table.blocks) == self.blocks_for(len(table.token_ids)), "table/token count mismatch"
            for block in table.blocks:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        cpu_held: list[int] = []
        for swapped in self.swapped.values():
            for entry in swapped.entries:
                if isinstance(entry, Block):
                    holders[entry.block_id] = holders.get(entry.block_id, 0) + 1
                else:
                    cpu_held.append(entry)
        for block in self.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders.get(block.block_id, 0)} holders"
            )
        assert len(set(cpu_held)) == len(cpu_held), "a host block is held twice"
        assert not set(cpu_held) & set(self._cpu_free), "a held host block is also free"
        assert len(cpu_held) + len(self._cpu_free) == self.num_cpu_blocks, "host blocks leaked"
        for table in self.tables.values():
            for index, block_hash in enumerate(table.hashes):
                block = table.blocks[index]
                # A block whose hash went to a twin computed at the same time stays unhashed.
                assert block.block_hash in (None, block_hash), f"block {block.block_id} carries a foreign hash"

    def is_idle(self) -> bool:
        """True when no sequence holds anything: the pool is back to all-free."""
        return (
            not self.tables
            and not self.swapped
            and self.pool.num_free == self.pool.num_blocks
            and len(self._cpu_free) == self.num_cpu_blocks
        )
