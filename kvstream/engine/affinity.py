"""What a remote runtime's slots hold, inferred from what KVStream sent them.

llama-server, Ollama's runner and LM Studio's llama.cpp engine keep one prompt cache per
slot and put a new request in the idle slot whose cached prompt shares the longest prefix
with it (llama-server: above ``--slot-prompt-similarity``, else the least recently used
idle slot). None of them chooses *which* waiting request runs next: KVStream holds the
queue, so it can (``scheduler.policy: lpm``). This model tells the scheduler, for a waiting
request, how many of its prompt tokens some idle slot already holds.

The model is an inference, not a readout: a request KVStream did not send (another client
of the runtime) or a runtime restart makes it wrong until the slots are rewritten. The
runtime's own report of what it reused (``cached_tokens``) is the verified figure.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvstream.kv.hashing import BlockHash, block_hashes, model_key
from kvstream.scheduler import Sequence


def common_blocks(a: Seq[BlockHash], b: Seq[BlockHash]) -> int:
    """Leading blocks two chains share (equal chained hashes mean equal prefixes)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class SlotModel:
    """``slots`` runtime slots: each idle one holds the block chain of the last prompt that
    ran in it (most recently used last); busy ones the prompt running there."""

    def __init__(self, slots: int, block_size: int, identity: str) -> None:
        self.slots = slots
        self.block_size = block_size
        self.salt = model_key(identity)
        self.idle: list[list[BlockHash]] = [[] for _ in range(slots)]
        self.busy: dict[str, list[BlockHash]] = {}
        self._chains: dict[str, list[BlockHash]] = {}

    def chain(self, seq: Sequence) -> list[BlockHash]:
        """The block chain of ``seq``'s prompt (computed once per sequence)."""
        chain = self._chains.get(seq.seq_id)
        if chain is None:
            chain = block_hashes(seq.prompt_token_ids, self.block_size, self.salt, seq.cache_root)
            self._chains[seq.seq_id] = chain
        return chain

    def held_tokens(self, seq: Sequence) -> int:
        """Prompt tokens of ``seq`` that the best idle slot already holds."""
        chain = self.chain(seq)
        if not chain:
            return 0
        return max((common_blocks(chain, held) for held in self.idle), default=0) * self.block_size

    def start(self, seq: Sequence) -> None:
        """``seq`` was sent to the runtime: it lands in the idle slot sharing the longest
        prefix with it, else the least recently used one (as llama-server chooses)."""
        chain = self.chain(seq)
        if self.idle:
            best = max(range(len(self.idle)), key=lambda i: (common_blocks(chain, self.idle[i]), -i))
            if common_blocks(chain, self.idle[best]) == 0:
                best = 0  # no match: the least recently used slot
            self.idle.pop(best)
        self.busy[seq.seq_id] = chain

    def finish(self, seq: Sequence) -> None:
        """``seq`` left its slot (finished, failed or paused); the slot keeps its prompt."""
        chain = self.busy.pop(seq.seq_id, None)
        self._chains.pop(seq.seq_id, None)
        if chain is not None:
            self.idle.append(chain)
            if len(self.idle) + len(self.busy) > self.slots:
                self.idle.pop(0)  # more in flight than modelled slots: forget the oldest
