"""An answer held to a regular expression, token by token: structured outputs (a JSON
schema's expression, json_schema.py), grammars (GBNF, grammar.py), vLLM's ``guided_regex``
and ``guided_choice``.

Two ways to follow it. Where pattern_machine.py reads the expression (every schema's and
grammar's, most of clients'), the constraint keeps the set of places the text has reached
and a candidate token costs its own characters. Otherwise the ``regex`` module (a dependency
of transformers) says whether the text so far plus a candidate is a prefix of some match
(``partial=True``), reading the whole text each time. Either way the answer ends where it is a
whole match that no character can continue (a closed object, a closing quote), or, where it
is whole but could go on (a number), with the model's end token.

An expression a client wrote (a grammar, a regex) may backtrack for a long time on some text
in the ``regex`` module: its matches share a budget of time per token (``budget_s``) and, forty
times that, per answer; past either the constraint gives up (``failed``) and the engine ends
that request with an error. Such a row's tokens are decided beside the engine's steps
(``slow_to_judge``, side_decisions.py), so that the matching time is its own, not that of
every request sharing the steps. The machine's questions count against the same budget (one
character's work is bounded, by its ``MAX_PLACES``; an expression past that goes on in the
``regex`` module).

A grammar's token references (grammar.py) stand in the expression as characters of a
private-use range: a referenced token is fed as its character, never as its text, and the
text of every other token may not spell one (a byte-level vocabulary could: four byte
tokens make any character), so only that token is that reference.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import regex
import torch

from kvstream.hf.bounded_compile import CompileTooCostly, bounded_compile, compile_complaint
from kvstream.hf.grammar import MAX_TOKEN_REFERENCES, TOKEN_SENTINELS
from kvstream.hf.pattern_machine import (
    LazyExpression,
    Machine,
    State,
    TooComplex,
    machine_for,
    machine_holds,
    partial_span,
)
from kvstream.hf.token_bytes import first_byte_mask

CLIENT_BUDGET_S = 0.25  # matching time one token of a client's expression may take
ANSWER_BUDGETS = 40  # ... and a whole answer, in those budgets (10 s)


class PatternError(ValueError):
    """An expression that does not compile, or costs too much to follow."""


@functools.lru_cache(maxsize=64)
def compile_pattern(text: str) -> Any:
    """A client's expression compiled (cached by its text); PatternError if it does not
    compile, or if judging the empty answer already runs past the budget."""
    try:
        pattern = bounded_compile(text)
        pattern.fullmatch("", partial=True, timeout=CLIENT_BUDGET_S)
    except TimeoutError:
        raise PatternError("the expression takes too long to match") from None
    except CompileTooCostly as exc:
        raise PatternError(str(exc)) from None
    except (regex.error, ValueError, TypeError, RecursionError, OverflowError) as exc:
        raise PatternError(f"the expression does not compile ({exc})") from None
    return pattern


@functools.lru_cache(maxsize=64)
def check_pattern(text: str) -> None:
    """A client's expression the machine holds, checked without compiling it here (this
    process compiles it only if an answer needs it: LazyExpression): PatternError if the
    regex module does not compile it, or not within bounded_compile's limits. Cached by the
    text, as compile_pattern is (a request's fields are read twice: checked, then run)."""
    try:
        complaint = compile_complaint(text)
    except CompileTooCostly as exc:
        raise PatternError(str(exc)) from None
    if complaint is not None:
        raise PatternError(f"the expression does not compile ({complaint})")


def expression(text: str) -> Any:
    """``text`` ready to hold an answer to: read by the machine (LazyExpression) where it
    can be, else compiled now (PatternError if it does not compile)."""
    return LazyExpression(text, compile_pattern) if machine_holds(text) else compile_pattern(text)


class PatternConstraint:
    """One answer's expression: which token may come next, and whether it is done.

    ``banned`` tokens never belong to the text (special tokens); of them, ``end_ids`` (the
    model's end tokens) may end it where the text is a whole match that could still go on.
    ``budget_s``: the matching time one token may take, either way (None: unbounded, for
    expressions KVStream writes itself); ``answer_budget_s`` the whole answer
    (default: ``ANSWER_BUDGETS`` times ``budget_s``). ``incremental=False`` asks the regex
    module even where the machine could follow the expression (to compare the two).
    ``tokens``: a grammar's referenced tokens, each read as the character standing for it in
    the expression (grammar.py), not as its text."""

    def __init__(self, pattern: Any, token_bytes: Callable[[int], bytes], banned: Iterable[int],
                 end_ids: Iterable[int] = (), budget_s: float | None = None, answer_budget_s: float | None = None,
                 incremental: bool = True, tokens: Mapping[int, bytes] | None = None) -> None:
        self.pattern = pattern
        self.spelling = token_bytes
        self.tokens = dict(tokens or {})  # a referenced token -> its character's bytes
        self.banned = frozenset(banned)
        self.end_ids = frozenset(end_ids)
        self.budget_s = budget_s
        self.text = b""
        self.complete = False  # the text is a whole match
        self.done = False  # ... and nothing can follow it: the answer ends
        self.failed = False  # the budget ran out: the answer cannot be held to the expression
        self._token_left_s = budget_s  # this token's matching time left (the time between questions is not)
        self._left_s = None if budget_s is None else answer_budget_s or budget_s * ANSWER_BUDGETS  # the answer's
        # The incremental way (None: the regex module's): the places the text has reached,
        # and the bytes of a character not yet whole.
        self.machine: Machine | None = machine_for(pattern.pattern) if incremental else None
        self._state: State = frozenset()
        self._pending = b""
        if self.machine is not None:
            try:
                self._state = self.machine.start()
            except TooComplex:
                self.machine = None
            else:
                self.complete = Machine.whole(self._state)
                self.done = self._state == {None}
        # Bytes already judged as the next one in this state: a token that begins with one
        # the text cannot continue with is refused without matching (most candidates a
        # forced key or brace turns down share a few first bytes).
        self._first: dict[int, bool] = {}

    @property
    def slow_to_judge(self) -> bool:
        """Whether judging a candidate may take long: a client's expression (budgeted) that the
        regex module follows, where the machine's work per character is bounded. The engine
        decides such a row's token beside its steps (side_decisions.py)."""
        return self.budget_s is not None and self.machine is None and not self.failed

    def copy(self) -> PatternConstraint:
        other = PatternConstraint.__new__(PatternConstraint)
        other.__dict__.update(self.__dict__)
        other._first, other._token_left_s = {}, self.budget_s
        return other

    # ------------------------------------------------------------ the machine's way
    def _reached(self, data: bytes) -> tuple[State, bytes] | None:
        """The state and unfinished character after ``data`` follows the text (None: the
        text cannot go on so)."""
        assert self.machine is not None
        data = self._pending + data
        try:
            chars, tail = data.decode(), b""
        except UnicodeDecodeError as exc:
            if exc.start < len(data) - 3 or exc.reason != "unexpected end of data":
                return None
            chars, tail = data[: exc.start].decode(), data[exc.start :]
        if self.tokens and any(_is_sentinel(ch) for ch in chars):  # text spelling a reference
            return None
        state = self._state
        for ch in chars:
            state = self.machine.step(state, ch)
            if not state:
                return None
        if tail:
            span = partial_span(tail)
            spans = () if span is None else _outside_sentinels(span) if self.tokens else (span,)
            if not any(head.may_contain(*part) for part in spans for head in Machine.heads(state)):
                return None
        return state, tail

    def _referenced(self, data: bytes) -> tuple[State, bytes] | None:
        """The state after a referenced token (its character ``data``); None where the text
        cannot go on with it (nor in the middle of a character)."""
        assert self.machine is not None
        if self._pending:
            return None
        state = self.machine.step(self._state, data.decode())
        return (state, b"") if state else None

    def _machine_continues(self, data: bytes) -> bool:
        try:
            return self._budgeted(lambda _timeout: self._reached(data) is not None)
        except TooComplex:  # go on in the regex module
            self.machine = None
            return self._regex_continues(data)

    def _machine_first_bytes(self) -> list[int]:
        if self._pending:
            return [b for b in range(0x80, 0xC0) if self._first_ok(b)]
        return sorted(set().union(*(head.first_bytes() for head in Machine.heads(self._state))))

    # ------------------------------------------------------------ the regex module's way
    def _match(self, text: str, partial: bool) -> bool:
        """Whether ``text`` is a match (``partial``: a prefix of one), within the budget."""
        if isinstance(self.pattern, LazyExpression):
            try:
                self.pattern.compiled()  # (once; outside the budget)
            except (regex.error, ValueError, RecursionError, OverflowError):
                # What the machine gave up on, the regex module cannot take either: this answer
                # ends (as past its budget), the others in the batch go on.
                self.failed = True
                return False
        return self._budgeted(lambda timeout: self.pattern.fullmatch(text, partial=partial, timeout=timeout) is not None)

    def _regex_continues(self, data: bytes, reference: bool = False) -> bool:
        try:
            text = self._decoded(self.text + data)
        except UnicodeDecodeError:
            return False
        if self.tokens and not reference and _sentinels(text) > _sentinels(self._decoded(self.text)):
            return False  # text spelling a reference
        return self._match(text, partial=True)

    @staticmethod
    def _decoded(data: bytes) -> str:
        """``data`` as text; an incomplete character at its end stands as one non-ASCII
        character (which a JSON string's inside admits)."""
        try:
            return data.decode()
        except UnicodeDecodeError as exc:
            if exc.start < len(data) - 3 or exc.reason != "unexpected end of data":
                raise
            return data[: exc.start].decode() + "\u00e9"

    # ------------------------------------------------------------ either way
    def _budgeted(self, question: Callable[[float | None], bool]) -> bool:
        """``question(timeout)`` asked within the budget: ``timeout`` is the time left to this
        token and answer (None: unbounded); past either, the constraint gives up (``failed``)."""
        if self.failed:
            return False
        if self.budget_s is None:
            return question(None)
        assert self._left_s is not None and self._token_left_s is not None
        timeout = min(self._token_left_s, self._left_s)
        now = time.perf_counter()
        try:
            if timeout <= 0:
                raise TimeoutError
            return question(timeout)
        except TimeoutError:
            self.failed = True
            return False
        finally:
            spent = time.perf_counter() - now
            self._token_left_s -= spent
            self._left_s -= spent

    def _continues(self, data: bytes) -> bool:
        return self._machine_continues(data) if self.machine is not None else self._regex_continues(data)

    def _continues_with_reference(self, data: bytes) -> bool:
        if self.machine is not None:
            try:
                return self._budgeted(lambda _timeout: self._referenced(data) is not None)
            except TooComplex:
                self.machine = None
        return self._regex_continues(data, reference=True)

    def _first_ok(self, byte: int) -> bool:
        first = self._first.get(byte)
        if first is None:
            first = self._first[byte] = self._continues(bytes([byte]))
        return first

    def token_bytes(self, token_id: int) -> bytes:
        """What ``token_id`` adds to the text: its bytes, or a referenced token's character."""
        raw = self.tokens.get(token_id)
        return self.spelling(token_id) if raw is None else raw

    def accepts(self, token_id: int) -> bool:
        if self.done or self.failed:
            return False
        if token_id in self.end_ids and self.complete:
            return True
        if token_id in self.banned:
            return False
        if token_id in self.tokens:
            return self._continues_with_reference(self.tokens[token_id])
        raw = self.spelling(token_id)
        return bool(raw) and self._first_ok(raw[0]) and (len(raw) == 1 or self._continues(raw))

    def candidates(self, vocab: int) -> torch.Tensor:
        """A ``[vocab]`` mask of the tokens whose first byte the text can continue with: no
        other can be accepted."""
        if self.done or self.failed:
            return torch.zeros(vocab, dtype=torch.bool)
        if self.machine is not None:
            allowed = self._machine_first_bytes()
        else:  # 256 first bytes judged, instead of every token
            allowed = [b for b in range(256) if self._first_ok(b)]
        mask = first_byte_mask(self.spelling, allowed, vocab)
        for token in self.tokens:  # (the mask is by the tokens' own first bytes)
            if token < vocab:
                mask[token] = self.accepts(token)
        if self.complete:
            mask[[t for t in self.end_ids if t < vocab]] = True
        return mask

    def advance(self, token_id: int) -> None:
        self._advance(self.token_bytes(token_id), token_id in self.tokens)

    def take(self, token_id: int, tail: bytes | None = None) -> bool:
        """Take text generated before the constraint held (a lazy grammar's trigger and what
        follows it, lazy_grammar.py) as the answer's start: the token whole, or only its last
        bytes ``tail`` (a trigger that begins inside it). A whole referenced token is its
        reference; any other is its text, a special token's included, as llama.cpp replays
        it. False (and nothing taken) where the expression cannot begin so."""
        reference = tail is None and token_id in self.tokens
        raw = self.token_bytes(token_id) if tail is None else tail
        if not raw:
            return True
        if not (self._continues_with_reference(raw) if reference else self._continues(raw)):
            return False
        self._advance(raw, reference)
        return not self.failed

    def _advance(self, raw: bytes, reference: bool) -> None:
        self.text += raw
        self._first = {}
        self._token_left_s = self.budget_s  # a new token, a new budget
        if self.machine is not None:
            try:
                reached = self._referenced(raw) if reference else self._reached(raw)
            except TooComplex:
                self.machine = None
            else:
                # A token the constraint did not accept (a sampler's last resort): nothing follows.
                self._state, self._pending = reached if reached is not None else (frozenset(), b"")
                self.complete = not self._pending and Machine.whole(self._state)
                self.done = self.complete and self._state == {None}
                return
        try:
            self.complete = self._match(self.text.decode(), partial=False)
        except UnicodeDecodeError:
            self.complete = False
        # Whole, and no byte goes on from here (a closed object, array or string): done.
        # Judged only once whole, where it costs 256 prefix matches.
        self.done = self.complete and not any(self._first_ok(b) for b in range(256))


_SENTINEL_END = TOKEN_SENTINELS + MAX_TOKEN_REFERENCES


def _is_sentinel(ch: str) -> bool:
    return TOKEN_SENTINELS <= ord(ch) < _SENTINEL_END


def _sentinels(text: str) -> int:
    return sum(map(_is_sentinel, text))


def _outside_sentinels(span: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """The parts of a span of code points outside the token references' range."""
    low, high = span
    parts = ((low, min(high, TOKEN_SENTINELS - 1)), (max(low, _SENTINEL_END), high))
    return tuple((a, b) for a, b in parts if a <= b)
