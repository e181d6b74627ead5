"""What a runtime's slots hold, inferred from what KVStream sent them.

llama-server, Ollama's runner and LM Studio's llama.cpp engine keep one prompt cache per
slot and put a new request in the idle slot whose cached prompt shares the longest prefix
with it (llama-server: above ``--slot-prompt-similarity``, else the least recently used
idle slot). None of them chooses *which* waiting request runs next, nor, with several
replicas, *where*: KVStream does both (``scheduler.policy: lpm``, ``routing.policy:
cache_aware``), and this model tells it, for a prompt, how many of its blocks some idle slot
already holds.

Prompts are compared as chains of block hashes (``kv.hashing``: equal hashes, equal
prefixes). The model is an inference, not a readout: a request KVStream did not send
(another client of the runtime) or a runtime restart makes it wrong until the slots are
rewritten. The runtime's own report of what it reused (``cached_tokens``) is the verified
figure.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvstream.kv.hashing import BlockHash, block_hashes, model_key


class SlotModel:
    """``slots`` runtime slots: each idle one holds the block chain of the last prompt that
    ran in it (most recently used last); busy ones the prompt running there, by key.

    Chained hashes name whole prefixes (a block's hash covers every block before it), so a
    chain's longest prefix held by some slot is its longest run of leading hashes that some
    slot's chain contains: each hash is counted over the idle chains (and over all of them)
    and a lookup walks the prompt's own chain, whatever the number of slots. lpm asks it for
    each request of its window every time a slot frees; comparing each with every slot made
    that the scheduler's largest cost in front of a runtime with many slots."""

    def __init__(self, slots: int, block_size: int, identity: str) -> None:
        self.slots = slots
        self.block_size = block_size
        self.salt = model_key(identity)
        self.idle: list[list[BlockHash]] = [[] for _ in range(slots)]
        self.busy: dict[str, list[BlockHash]] = {}
        self._in_idle: Counter[BlockHash] = Counter()  # idle chains holding each hash
        self._in_any: Counter[BlockHash] = Counter()  # idle or busy chains holding it

    def chain(self, token_ids: Sequence[int], root: bytes | None = None) -> list[BlockHash]:
        """The block chain of a prompt (``root``: its tenant's, when tenants are isolated)."""
        return block_hashes(token_ids, self.block_size, self.salt, root)

    def held_blocks(self, chain: Sequence[BlockHash], busy: bool = False) -> int:
        """Leading blocks of ``chain`` that the best idle slot already holds (``busy``: or a
        slot running now, which will hold them when it frees)."""
        held = self._in_any if busy else self._in_idle
        if not held:
            return 0
        n = 0
        for block in chain:
            if block not in held:
                break
            n += 1
        return n

    @property
    def free(self) -> int:
        """Slots with nothing running."""
        return max(0, self.slots - len(self.busy))

    def start(self, key: str, chain: list[BlockHash]) -> None:
        """The prompt ``chain`` was sent: it lands in the idle slot sharing the longest
        prefix with it (the least recently used of those), else the least recently used one
        (as llama-server chooses)."""
        if self.idle:
            n = self.held_blocks(chain)
            # The first idle chain with the prompt's n-th hash shares its first n blocks.
            best = next(i for i, held in enumerate(self.idle) if n == 0 or (len(held) >= n and held[n - 1] == chain[n - 1]))
            taken = self.idle.pop(best)  # the slot's old prompt is overwritten
            self._forget(self._in_idle, taken)
            self._forget(self._in_any, taken)
        previous = self.busy.get(key)
        if previous is not None:  # started again without finishing: one slot, one prompt
            self._forget(self._in_any, previous)
        self.busy[key] = chain
        self._in_any.update(chain)

    def finish(self, key: str) -> None:
        """The request ``key`` left its slot (finished, failed or paused); the slot keeps
        its prompt."""
        chain = self.busy.pop(key, None)
        if chain is not None:
            self.idle.append(chain)
            self._in_idle.update(chain)
            if len(self.idle) + len(self.busy) > self.slots:
                # More in flight than modelled slots: forget the oldest.
                oldest = self.idle.pop(0)
                self._forget(self._in_idle, oldest)
                self._forget(self._in_any, oldest)

    @staticmethod
    def _forget(counts: Counter[BlockHash], chain: list[BlockHash]) -> None:
        for block in chain:
            if counts[block] == 1:
                del counts[block]
            else:
                counts[block] -= 1


class SharedCacheModel:
    """A runtime with one prefix cache over its whole KV pool (vLLM, SGLang): the blocks
    of every prompt KVStream sent it, least recently used first out once more than
    ``capacity_blocks`` are held (the engine's own capacity when it reports it). Like
    SGLang's router's approximate tree per worker, but flat: chained hashes already name
    whole prefixes, so the longest held prefix is the longest run of the chain present."""

    def __init__(self, slots: int, block_size: int, identity: str, capacity_blocks: int = 65536) -> None:
        self.slots = slots  # requests it runs at once, as far as KVStream admits
        self.block_size = block_size
        self.salt = model_key(identity)
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def chain(self, token_ids: Sequence[int], root: bytes | None = None) -> list[BlockHash]:
        return block_hashes(token_ids, self.block_size, self.salt, root)

    def held_blocks(self, chain: Sequence[BlockHash], busy: bool = False) -> int:
        """Leading blocks of ``chain`` the cache holds (running or not: it is one cache)."""
        n = 0
        for block in chain:
            if block not in self.blocks:
                break
            n += 1
        return n

    def start(self, key: str, chain: list[BlockHash]) -> None:
        """The prompt ``chain`` was sent: its blocks are now the most recently used."""
        for block in chain:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)

    def finish(self, key: str) -> None:
        """Nothing to do: the blocks stay cached when the request leaves."""
