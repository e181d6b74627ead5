"""Prompt scores kept by block, so that a scored prompt (echo with logprobs) can take its
prefix from the prefix cache like any other.

A scored position needs the logits at the position before it, which a prefix taken from
the cache never computes; so the scores themselves are kept, per full block of a prompt
that was scored, under the block's chain hash (the prefix cache's own key: the same tokens
after the same prefix, the same model, the same tenant). A token's score depends only on
the tokens up to it, all inside its block's chain, so a kept block's scores hold for every
prompt that shares the chain.

A later scored prompt whose first ``s`` blocks are kept may reuse the KV of ``s - 1`` of
them: the token just after the reused prefix is the first token of block ``s - 1``, whose
score is kept too; the positions from there on are computed and scored as usual. Kept
scores carry the ``STORED_TOP`` best alternatives (the legacy completions API asks for at
most 5); a request asking for fewer gets them cut.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvstream.hf.sampling import TokenLogprobs
from kvstream.kv.hashing import block_hashes

STORED_TOP = 5  # alternatives kept per scored token
KEPT_BLOCKS = 4096  # blocks of scores kept (least recently used first out): ~0.5 KB per token


class PromptScores:
    """Scores of prompt tokens, by the chain hash of the block holding them."""

    def __init__(self, block_size: int, salt: bytes, max_blocks: int = KEPT_BLOCKS) -> None:
        self.block_size = block_size
        self.salt = salt
        self.max_blocks = max_blocks
        # chain hash -> the block's tokens' scores (None for a prompt's first token)
        self._blocks: OrderedDict[bytes, list[TokenLogprobs | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def _hashes(self, token_ids: Sequence[int], root: bytes | None) -> list[bytes]:
        return block_hashes(token_ids, self.block_size, self.salt, root)

    def known_prefix(self, token_ids: Sequence[int], root: bytes | None) -> list[TokenLogprobs]:
        """The kept scores of the prompt's tokens 1..r*B, where r + 1 leading blocks are
        kept (r*B below the prompt's last token): entry i scores token i + 1. Reusing r
        blocks of KV, scoring resumes at token r*B + 1."""
        size = self.block_size
        kept: list[list[TokenLogprobs | None]] = []
        for block_hash in self._hashes(token_ids, root):
            scores = self._blocks.get(block_hash)
            if scores is None:
                break
            self._blocks.move_to_end(block_hash)
            kept.append(scores)
        reused = min(len(kept) - 1, (len(token_ids) - 1) // size)
        if reused <= 0:
            return []
        entries = [entry for scores in kept[:reused] for entry in scores][1:]  # token 0 has none
        entries.append(kept[reused][0])  # type: ignore[arg-type]
        return entries  # type: ignore[return-value]

    def keep(self, token_ids: Sequence[int], root: bytes | None, scores: list[TokenLogprobs]) -> None:
        """Keep the scores (entry i for token i + 1) of each full block of the prompt."""
        size = self.block_size
        for index, block_hash in enumerate(self._hashes(token_ids, root)):
            start = index * size
            if start + size - 1 > len(scores):
                break
            self._blocks[block_hash] = [scores[t - 1] if t else None for t in range(start, start + size)]
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
