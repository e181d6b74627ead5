"""llama-server's lazy grammars: an answer free until a trigger, held to its grammar from there.

A client that wants a tool call's shape only if the model starts one (``grammar_lazy`` with
``grammar_triggers``) lets the model write freely and holds the grammar from the trigger on,
the trigger's own text included. llama.cpp's four kinds of trigger (``common_grammar_trigger``):

- a token (type 0): that token drawn;
- a word (1): the text, anywhere in what was generated (a word that is one token of the
  vocabulary is that token, and llama-server asks for it in ``preserved_tokens``);
- a pattern (2): a regular expression found anywhere in it;
- a whole pattern (3): an expression that matches all of it (anchored at both ends).

The grammar begins where the word does, or where a pattern's first capturing group that
matched something begins (else where the match does), and the tokens from there are replayed
into it as they were generated: the first one only from that point. A pattern is searched in
all of the generation so far at each token (llama.cpp's behaviour; a client's expression may
backtrack, so the searches share the matching budget constraints have,
pattern_constraint.py, and are made beside the engine's steps, side_decisions.py); a word
only in the text that could end in it now. A trigger's text
the grammar cannot begin with ends the request with an error, as llama-server's 500 does.

Words may be looked for outside ``<think>`` blocks only (``Triggers.thinking``): a tool call
the model drafts while thinking is not one (llama.cpp feeds its grammar nothing while a
reasoning model thinks).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import regex

from kvstream.hf.bounded_compile import CompileTooCostly, bounded_compile
from kvstream.hf.pattern_constraint import ANSWER_BUDGETS, CLIENT_BUDGET_S, PatternConstraint
from kvstream.hf.reasoning import END_THINK, THINK

TOKEN, WORD, PATTERN, PATTERN_FULL = range(4)  # llama.cpp's trigger types, by their JSON numbers


@dataclass(frozen=True)
class Triggers:
    """What starts a lazy grammar: any of ``tokens`` drawn, or one of ``words`` or
    ``patterns`` (regular expressions; a whole pattern anchored ``^...$``) found in the text.
    ``thinking``: words and tokens count only outside ``<think>`` blocks (None: blocks are
    not looked for; True: the prompt opened one, and the answer begins inside it)."""

    tokens: frozenset[int] = frozenset()
    words: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    thinking: bool | None = None
    # A trigger's text the grammar cannot begin with fails the answer (llama-server's 500);
    # False: the answer goes on unheld (a hold KVStream adds itself, call_grammar.py).
    strict: bool = True


@functools.lru_cache(maxsize=64)
def compile_trigger(pattern: str) -> Any:
    """A trigger's expression compiled (ValueError for one that does not)."""
    try:
        return bounded_compile(pattern)
    except CompileTooCostly as exc:
        raise ValueError(f"the expression {pattern!r} cannot be used: {exc}") from None
    except (regex.error, ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise ValueError(f"the expression {pattern!r} does not compile ({exc})") from None


def _start(match: Any) -> int:
    """Where the held text begins: the first capturing group that matched something, else
    the whole match (llama.cpp's ``find_start_pos``)."""
    for group in range(1, len(match.groups()) + 1):
        if match.end(group) > match.start(group) >= 0:
            return match.start(group)
    return match.start()


class LazyGrammar:
    """One answer's wait for its trigger: ``advance`` each token drawn; once a trigger is
    found it returns the grammar's constraint with the trigger's text taken, held from the
    next token on. ``failed``: why the answer cannot go on (the grammar refused the trigger's
    text, or searching ran past the budget)."""

    def __init__(self, constraint: PatternConstraint, triggers: Triggers, token_bytes: Callable[[int], bytes],
                 budget_s: float = CLIENT_BUDGET_S) -> None:
        self.constraint = constraint
        self.triggers = triggers
        self.spelling = token_bytes
        self.patterns = [compile_trigger(p) for p in triggers.patterns]
        self.words = [w.encode() for w in triggers.words]
        self.text = bytearray()  # what was generated, special tokens' text included (llama.cpp's trigger buffer)
        # Words: where a word may begin (outside thinking, not yet searched), and whether the
        # text is inside a <think> block now.
        self._floor = 0
        self._thinking = triggers.thinking is True
        self.spans: list[tuple[int, int, int]] = []  # (token, where its bytes begin and end in text)
        self.failed: str | None = None
        self.costly = False  # ... because matching ran past the budget (the client's expression's cost)
        self.abandoned = False  # not strict, and the grammar refused a trigger's text: no hold
        self.budget_s = budget_s
        self._left_s = budget_s * ANSWER_BUDGETS

    @property
    def slow_to_search(self) -> bool:
        """Whether noting a token may take long: a client's trigger patterns, searched by the
        ``regex`` module in all of the text at each token (KVStream's own holds, not strict,
        search expressions it wrote). The engine notes such a row's tokens beside its steps
        (side_decisions.py)."""
        return bool(self.patterns) and self.triggers.strict and self.failed is None and not self.abandoned

    def copy(self) -> LazyGrammar:
        other = LazyGrammar.__new__(LazyGrammar)
        other.__dict__.update(self.__dict__)
        other.constraint, other.spans, other.text = self.constraint.copy(), list(self.spans), bytearray(self.text)
        return other

    def advance(self, token_id: int) -> PatternConstraint | None:
        """Note ``token_id`` drawn: the constraint, from here on, where a trigger was found
        (None: still waiting, ``failed``, or ``abandoned``)."""
        if self.abandoned:
            return None
        if token_id in self.triggers.tokens and not self._thinking:
            return self._held([(token_id, None)])
        raw = self.spelling(token_id)
        self.spans.append((token_id, len(self.text), len(self.text) + len(raw)))
        self.text += raw
        at = self._found(len(self.text) - len(raw))
        if at is None:
            return None
        # The tokens from the trigger on, the first one only from there where it begins inside it.
        return self._held([(token, None if begin >= at else bytes(self.text[at:end]))
                           for token, begin, end in self.spans if end > at])

    def _found(self, added: int) -> int | None:
        """Where in ``text`` (bytes) a trigger found begins, the earliest of a word's and a
        pattern's, or None. ``added``: where the newest token's bytes begin."""
        found = [at for at in (self._word(added), self._pattern()) if at is not None]
        return min(found) if found else None

    def _word(self, added: int) -> int | None:
        """Where a word begins in text that could not have held it before ``added``, outside
        thinking where that is tracked (and whether the text ends inside a block, for the
        token triggers)."""
        if not self.words and self.triggers.thinking is None:
            return None
        # How far back a word or a tag ending in the new bytes may begin.
        reach = max([*map(len, self.words), len(END_THINK) if self.triggers.thinking is not None else 0])
        text, at = self.text, max(self._floor, added - reach + 1)
        while True:
            if self._thinking:
                end = text.find(END_THINK.encode(), at)
                if end < 0:  # (a tag's start may come with this token, its end with the next)
                    self._floor = max(at, len(text) - len(END_THINK) + 1)
                    return None
                self._thinking, at = False, end + len(END_THINK)
                continue
            opened = text.find(THINK.encode(), at) if self.triggers.thinking is not None else -1
            limit = len(text) if opened < 0 else opened
            hits = [hit for word in self.words if (hit := text.find(word, at, limit)) >= 0]
            if hits:
                return min(hits)
            if opened < 0:
                self._floor = max(at, len(text) - reach + 1)
                return None
            self._thinking, at = True, opened + len(THINK)

    def _pattern(self) -> int | None:
        """Where the first pattern found in the whole text begins (llama.cpp's search)."""
        if not self.patterns:
            return None
        text = self.text.decode("utf-8", "surrogateescape")  # one character per stray byte: offsets map back
        token_left = self.budget_s
        for pattern in self.patterns:
            whole = pattern.pattern.startswith("^") and pattern.pattern.endswith("$")
            now = time.perf_counter()
            try:
                timeout = min(token_left, self._left_s)
                if timeout <= 0:
                    raise TimeoutError
                match = (pattern.fullmatch if whole else pattern.search)(text, timeout=timeout)
            except TimeoutError:
                self.failed, self.costly = "matching the grammar's trigger patterns took too long", True
                return None
            finally:
                spent = time.perf_counter() - now
                token_left -= spent
                self._left_s -= spent
            if match is not None:
                return len(text[: _start(match)].encode("utf-8", "surrogateescape"))
        return None

    def _held(self, replay: list[tuple[int, bytes | None]]) -> PatternConstraint | None:
        """The constraint with ``replay`` taken (each token whole, or its last bytes)."""
        for token, tail in replay:
            if not self.constraint.take(token, tail):
                if self.constraint.failed:
                    self.failed, self.costly = "matching the grammar took too long", True
                elif not self.triggers.strict:
                    self.abandoned = True
                else:
                    text = b"".join(self.spelling(t) if b is None else b for t, b in replay).decode(errors="replace")
                    self.failed = f"the grammar cannot begin with the text its trigger found ({text!r})"
                return None
        return self.constraint
