"""A cap on how long a reasoning model thinks: ``thinking_token_budget`` (vLLM's request
field; Anthropic's ``thinking.budget_tokens``).

Nothing in a reasoning model stops its ``<think>`` block before the context ends, and every
thinking token is taken from ``max_tokens``: a model that thinks too long answers nothing.
The budget counts the tokens generated inside the block; when they reach it, the block's
closing text (``\\n</think>\\n\\n``) is forced, token by token, and the model answers from
there. A block the model closes itself ends the count. This is llama.cpp's reasoning-budget
sampler as a small state machine the model runner feeds each generated token:

- ``idle``: the answer may still open a block (the prompt did not); it opens when the
  answer starts with ``<think>``'s tokens, else the budget has nothing to count;
- ``counting``: inside the block, the budget going down;
- ``waiting``: spent, but the last token left a UTF-8 character unfinished: it is finished
  first, so that no text is cut inside a character;
- ``forcing``: the closing tokens, one a step;
- ``done``: nothing more to do.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

START, END, FORCED = "<think>", "</think>", "\n</think>\n\n"
OPEN, CLOSE = START.encode(), END.encode()


@dataclass(frozen=True)
class ThinkTokens:
    """A tokenizer's token ids of the closing text forced."""

    forced: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Any) -> ThinkTokens:
        return cls(tuple(tokenizer.encode(FORCED, add_special_tokens=False)))


@dataclass
class ThinkingBudget:
    """One choice's count (see the module docstring). ``opened``: the prompt left the block
    open, so the answer starts inside it. The tags are read in the answer's bytes, as
    reasoning.py reads them (an answer opening with whitespace then ``<think>`` opens one),
    whichever tokens spell them."""

    budget: int
    tokens: ThinkTokens
    token_bytes: Callable[[int], bytes]
    opened: bool
    state: str = field(init=False)
    _left: int = field(init=False)
    _text: bytes = b""  # idle: the answer so far; counting: the last bytes, to find the end tag
    _forced_at: int = 0

    def __post_init__(self) -> None:
        self.state = "idle"
        self._left = self.budget
        if self.opened:
            self._open()

    def copy(self) -> ThinkingBudget:
        """The same count for another choice (a fork, before either generated a token)."""
        return copy.copy(self)  # every field is immutable

    def forced(self) -> int | None:
        """The token the next step must take, or None."""
        return self.tokens.forced[self._forced_at] if self.state == "forcing" else None

    def advance(self, token: int) -> None:
        """Count a generated token."""
        if self.state == "forcing":
            self._forced_at += 1
            if self._forced_at == len(self.tokens.forced):
                self.state = "done"
            return
        if self.state == "done":
            return
        self._text += self.token_bytes(token)
        if self.state == "idle":
            start = self._text.lstrip()
            if start.startswith(OPEN):
                self._text = start[len(OPEN):]
                self._open()
                self._look_for_end()
            elif not OPEN.startswith(start):
                self.state = "done"  # the answer did not open a block
            else:
                self._text = start  # (whitespace before the tag is not kept)
            return
        if self._look_for_end():
            return
        self._text = self._text[-len(CLOSE):]  # enough to find a tag split across tokens
        self._left -= 1
        self._check()

    def _open(self) -> None:
        self.state = "counting"
        self._check()

    def _look_for_end(self) -> bool:
        if CLOSE in self._text:
            self.state = "done"  # the model closed the block itself
            return True
        return False

    def _check(self) -> None:
        """Spent: force the closing text, once the text so far ends on a whole character."""
        if self._left > 0:
            return
        if _unfinished_utf8(self._text):
            self.state = "waiting"
        else:
            self.state = "forcing" if self.tokens.forced else "done"


def _unfinished_utf8(tail: bytes) -> bytes:
    """The bytes at the end of ``tail`` that begin a UTF-8 character not yet finished (b""
    when the text ends on a whole character)."""
    for back in range(1, min(4, len(tail)) + 1):
        byte = tail[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for the lead
            continue
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return tail[-back:] if back < need else b""
    return b""
