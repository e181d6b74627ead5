"""llama-server's lazy grammars: an answer free until a trigger, held to its grammar from there.

A client that wants a tool call's shape only if the model starts one (``grammar_lazy`` with
``grammar_triggers``) lets the model write freely and holds the grammar from the trigger on,
the trigger's own text included. llama.cpp's four kinds of trigger (``common_grammar_trigger``):

- a token (type 0): that token drawn;
- a word (1): the text, anywhere in what was generated (a word that is one token of the
  vocabulary is that token, and llama-server asks for it in ``preserved_tokens``);
- a pattern (2): a regular expression found anywhere in it;
- a whole pattern (3): an expression that matches all of it (anchored at both ends).

The grammar begins where the trigger's first capturing group that matched something begins
(else where the match does), and the tokens from there are replayed into it as they were
generated: the first one only from that point. All of the generation so far is searched at
each token (llama.cpp's behaviour; a client's expression may backtrack, so the searches
share the matching budget constraints have, pattern_constraint.py). A trigger's text the
grammar cannot begin with ends the request with an error, as llama-server's 500 does.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import regex

from kvstream.hf.pattern_constraint import ANSWER_BUDGETS, CLIENT_BUDGET_S, PatternConstraint

TOKEN, WORD, PATTERN, PATTERN_FULL = range(4)  # llama.cpp's trigger types, by their JSON numbers


@dataclass(frozen=True)
class Triggers:
    """What starts a lazy grammar: any of ``tokens`` drawn, or one of ``patterns`` (regular
    expressions: a word escaped, a whole pattern anchored ``^...$``) found in the text."""

    tokens: frozenset[int] = frozenset()
    patterns: tuple[str, ...] = ()


@functools.lru_cache(maxsize=64)
def compile_trigger(pattern: str) -> Any:
    """A trigger's expression compiled (ValueError for one that does not)."""
    try:
        return regex.compile(pattern)
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
        self.text = b""  # what was generated, special tokens' text included (llama.cpp's trigger buffer)
        self.spans: list[tuple[int, int, int]] = []  # (token, where its bytes begin and end in text)
        self.failed: str | None = None
        self.budget_s = budget_s
        self._left_s = budget_s * ANSWER_BUDGETS

    def copy(self) -> LazyGrammar:
        other = LazyGrammar.__new__(LazyGrammar)
        other.__dict__.update(self.__dict__)
        other.constraint, other.spans = self.constraint.copy(), list(self.spans)
        return other

    def advance(self, token_id: int) -> PatternConstraint | None:
        """Note ``token_id`` drawn: the constraint, from here on, where a trigger was found
        (None: still waiting, or ``failed``)."""
        if token_id in self.triggers.tokens:
            return self._held([(token_id, None)])
        raw = self.spelling(token_id)
        self.spans.append((token_id, len(self.text), len(self.text) + len(raw)))
        self.text += raw
        at = self._found()
        if at is None:
            return None
        # The tokens from the trigger on, the first one only from there where it begins inside it.
        return self._held([(token, None if begin >= at else self.text[at:end])
                           for token, begin, end in self.spans if end > at])

    def _found(self) -> int | None:
        """Where in ``text`` (bytes) the first trigger found begins, or None."""
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
                self.failed = "matching the grammar's trigger patterns took too long"
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
                    self.failed = "matching the grammar took too long"
                else:
                    text = b"".join(self.spelling(t) if b is None else b for t, b in replay).decode(errors="replace")
                    self.failed = f"the grammar cannot begin with the text its trigger found ({text!r})"
                return None
        return self.constraint
