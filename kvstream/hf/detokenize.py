"""Token ids to streamed text: incremental decoding and stop strings.

Decoding one id at a time breaks multi-byte characters and tokenizers that merge spaces, so
each new text piece is the difference between decoding a short window with and without the
newest tokens (the window slides forward as text is emitted). Text that might be the start
of a stop string is held back until it is clearly not one.
"""

from __future__ import annotations

from typing import Any

# Tokens decoded before the newest ones, so that spacing and merges come out right.
_WINDOW = 6


class IncrementalDetokenizer:
    """Feeds on generated ids; returns the text each one adds, honouring stop strings."""

    def __init__(self, tokenizer: Any, stop: list[str], keep: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        # Special tokens written into the text (llama-server's preserved_tokens): every other
        # special token is left out, as decoding skips them all otherwise.
        self.keep = keep
        self._left_out = frozenset(tokenizer.all_special_ids) - keep if keep else frozenset()
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.pending = ""  # decoded but not yet emitted (could begin a stop string)
        self.stopped = False
        self.matched_stop: str | None = None  # the stop string that ended the text

    def _decode(self, ids: list[int]) -> str:
        if self.keep:
            return self.tokenizer.decode([t for t in ids if t not in self._left_out], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Record one token; the text that may be sent now (possibly empty)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return self._release("")  # an incomplete character: wait for its other bytes
        piece = after[len(before) :]
        self.prefix_offset = max(self.read_offset, len(self.ids) - _WINDOW)
        self.read_offset = len(self.ids)
        return self._release(piece)

    def _release(self, piece: str) -> str:
        text = self.pending + piece
        if not self.stop:
            self.pending = ""
            return text
        # The stop string that begins first ends the text, whatever the order they were given in.
        found = [(at, stop) for stop in self.stop if (at := text.find(stop)) != -1]
        if found:
            at, self.matched_stop = min(found, key=lambda hit: hit[0])
            self.stopped = True
            self.pending = ""
            return text[:at]
        hold = held_back(text, self.stop)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """What was held back, at the end of the generation (no stop string followed)."""
        text, self.pending = self.pending, ""
        return "" if self.stopped else text


def held_back(text: str, stops: list[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``stops`` (shorter than
    it: a whole one is found before), which must wait for the next tokens. Each stop's
    candidates are where its first character occurs in the text's last ``len(stop) - 1``
    characters, the earliest that begins it the longest; trying every length instead, each a
    new slice of the stop, was quadratic in a long stop string, at every token."""
    hold = 0
    for stop in stops:
        at = text.find(stop[0], max(0, len(text) - len(stop) + 1))
        while at != -1 and len(text) - at > hold:
            if stop.startswith(text[at:]):
                hold = len(text) - at
                break
            at = text.find(stop[0], at + 1)
    return hold
