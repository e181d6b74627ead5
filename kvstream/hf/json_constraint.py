"""JSON mode (``response_format: {"type": "json_object"}``, Ollama's ``format: "json"``):
the in-process engine only samples tokens that keep the output a prefix of one JSON object,
and ends the answer when the object closes.

``JsonPrefix`` is a byte-level pushdown recognizer of RFC 8259 JSON whose top-level value
is an object: containers on a stack, what may come next, and the lexer's place inside a
string (escapes, ``\\u`` digits), number or literal. Bytes >= 0x80 are taken inside strings
only, so a token holding part of a UTF-8 character is fine there and nowhere else.
``JsonObjectConstraint`` asks it, token by token, whether a token's bytes (``TokenBytes``)
may come next; special tokens never may. The sampler tries tokens in the order the model
ranks them (sampling.py), so a check costs a few copies of a small state per step, not one
per vocabulary entry. Whitespace outside strings takes the shapes llama.cpp's JSON grammars
allow: none, one space, or a newline and an indent of up to ``MAX_INDENT`` spaces or tabs.
That is all compact or pretty-printed JSON needs, and a small model otherwise pads with
runs of blank lines and spaces, each of them valid JSON (and could forever).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from kvstream.hf.token_bytes import first_byte_mask

# What the recognizer expects next, outside a lexeme.
VALUE, FIRST_KEY, KEY, COLON, AFTER_VALUE, FIRST_VALUE, DONE = range(7)
# Lexer states inside a lexeme.
NONE, STRING, ESCAPE, UNICODE, NUMBER, LITERAL = range(6)
WHITESPACE = frozenset(b" \t\n\r")
ESCAPES = frozenset(b'"\\/bfnrt')
HEX = frozenset(b"0123456789abcdefABCDEF")
DIGITS = frozenset(b"0123456789")
MAX_INDENT = 20  # spaces or tabs after a newline outside strings
SPACE, NEWLINE = ord(" "), ord("\n")
INDENT = frozenset(b" \t")
ONE_SPACE = -1  # JsonPrefix.spaces after a single space: nothing more may follow
# Number sub-states: where in -?(0|[1-9]d*)(.d+)?([eE][+-]?d+)? the lexer is, and whether
# the number could end here.
N_SIGN, N_ZERO, N_INT, N_DOT, N_FRAC, N_EXP, N_EXP_SIGN, N_EXP_DIGITS = range(8)
NUMBER_CAN_END = frozenset({N_ZERO, N_INT, N_FRAC, N_EXP_DIGITS})


class JsonPrefix:
    """Whether the bytes fed so far begin a JSON object (``feed`` returns False at the
    first byte that cannot), and whether that object is complete (``done``)."""

    __slots__ = ("stack", "expect", "lexer", "sub", "is_key", "spaces", "literal")

    def __init__(self) -> None:
        self.stack: list[int] = []  # b"{" or b"[" per open container
        self.expect = VALUE
        self.lexer = NONE
        self.sub = 0  # UNICODE: hex digits left; NUMBER: its sub-state (N_*)
        self.is_key = False  # the string being lexed is an object key
        self.spaces = 0  # outside strings: 0 none yet, ONE_SPACE, or 1 + the indent after a newline
        self.literal = b""  # LITERAL: the bytes of true / false / null still to come

    def copy(self) -> JsonPrefix:
        other = JsonPrefix.__new__(JsonPrefix)
        other.stack, other.expect, other.lexer = list(self.stack), self.expect, self.lexer
        other.sub, other.is_key, other.spaces, other.literal = self.sub, self.is_key, self.spaces, self.literal
        return other

    @property
    def done(self) -> bool:
        return self.expect == DONE

    def feed(self, data: bytes) -> bool:
        """Take ``data``; False (and a state no longer meaningful) if it cannot continue a
        JSON object, or continues past its end."""
        for byte in data:
            if not self._byte(byte):
                return False
        return True

    # The literal being lexed, by its first byte: what must follow.
    _LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}

    def _byte(self, b: int) -> bool:  # noqa: C901 - one branch per lexer state, in order
        lexer = self.lexer
        if lexer == STRING:
            if b == 0x22:  # closing quote
                self.lexer = NONE
                self.expect = COLON if self.is_key else AFTER_VALUE
            elif b == 0x5C:
                self.lexer = ESCAPE
            elif b < 0x20:
                return False  # control characters must be escaped
            return True
        if lexer == ESCAPE:
            if b == ord("u"):
                self.lexer, self.sub = UNICODE, 4
                return True
            self.lexer = STRING
            return b in ESCAPES
        if lexer == UNICODE:
            if b not in HEX:
                return False
            self.sub -= 1
            if not self.sub:
                self.lexer = STRING
            return True
        if lexer == LITERAL:
            if b != self.literal[0]:
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self.lexer, self.expect = NONE, AFTER_VALUE
            return True
        if lexer == NUMBER:
            state = self._number(self.sub, b)
            if state is not None:
                self.sub = state
                return True
            if self.sub not in NUMBER_CAN_END:
                return False
            self.lexer, self.expect = NONE, AFTER_VALUE  # the number ended; b is read below
        return self._structural(b)

    def _structural(self, b: int) -> bool:
        if b in WHITESPACE:
            if self.expect == DONE:
                return False  # the object is complete: nothing more
            spaces = self.spaces
            if spaces == 0 and b in (SPACE, NEWLINE):
                self.spaces = ONE_SPACE if b == SPACE else 1
                return True
            if spaces > 0 and b in INDENT and spaces <= MAX_INDENT:
                self.spaces += 1
                return True
            return False
        self.spaces = 0
        expect = self.expect
        if expect in (VALUE, FIRST_VALUE):
            if expect == FIRST_VALUE and b == ord("]"):
                return self._close(ord("["))
            if not self.stack and b != ord("{"):
                return False  # the top-level value is an object
            return self._value(b)
        if expect in (FIRST_KEY, KEY):
            if b == 0x22:
                self.lexer, self.is_key = STRING, True
                return True
            return expect == FIRST_KEY and b == ord("}") and self._close(ord("{"))
        if expect == COLON:
            if b != ord(":"):
                return False
            self.expect = VALUE
            return True
        if expect == AFTER_VALUE:
            top = self.stack[-1]
            if b == ord(","):
                self.expect = KEY if top == ord("{") else VALUE
                return True
            return b in (ord("}"), ord("]")) and self._close(ord("{") if b == ord("}") else ord("["))
        return False  # DONE

    def _value(self, b: int) -> bool:
        if b in (ord("{"), ord("[")):
            self.stack.append(b)
            self.expect = FIRST_KEY if b == ord("{") else FIRST_VALUE
            return True
        if b == 0x22:
            self.lexer, self.is_key = STRING, False
            return True
        if b == ord("-") or b in DIGITS:
            self.lexer = NUMBER
            self.sub = N_SIGN if b == ord("-") else N_ZERO if b == ord("0") else N_INT
            return True
        rest = self._LITERALS.get(b)
        if rest is None:
            return False
        self.lexer, self.literal = LITERAL, rest
        return True

    def _close(self, opener: int) -> bool:
        if not self.stack or self.stack[-1] != opener:
            return False
        self.stack.pop()
        self.expect = AFTER_VALUE if self.stack else DONE
        return True

    @staticmethod
    def _number(state: int, b: int) -> int | None:
        """The number's next sub-state after byte ``b``, or None if ``b`` is not part of it."""
        digit = b in DIGITS
        if state == N_SIGN:
            return (N_ZERO if b == ord("0") else N_INT) if digit else None
        if state in (N_ZERO, N_INT):
            if digit:
                return N_INT if state == N_INT else None  # no leading zeros
            return N_DOT if b == ord(".") else N_EXP if b in b"eE" else None
        if state == N_DOT:
            return N_FRAC if digit else None
        if state == N_FRAC:
            return N_FRAC if digit else N_EXP if b in b"eE" else None
        if state == N_EXP:
            return N_EXP_DIGITS if digit else N_EXP_SIGN if b in b"+-" else None
        if state == N_EXP_SIGN:
            return N_EXP_DIGITS if digit else None
        return N_EXP_DIGITS if digit else None  # N_EXP_DIGITS


class JsonObjectConstraint:
    """One request's JSON mode: which token may come next, and whether the object is done."""

    failed = False  # (never: its recognizer costs the same on any text; pattern_constraint.py's may fail)

    def __init__(self, token_bytes: Callable[[int], bytes], banned: Iterable[int]) -> None:
        self.token_bytes = token_bytes
        self.banned = frozenset(banned)  # special tokens: never part of the JSON text
        self.state = JsonPrefix()

    def copy(self) -> JsonObjectConstraint:
        """An independent constraint in the same state (a request's other choices)."""
        other = JsonObjectConstraint.__new__(JsonObjectConstraint)
        other.token_bytes, other.banned, other.state = self.token_bytes, self.banned, self.state.copy()
        return other

    def accepts(self, token_id: int) -> bool:
        if token_id in self.banned:
            return False
        raw = self.token_bytes(token_id)
        return bool(raw) and self.state.copy().feed(raw)

    def candidates(self, vocab: int) -> torch.Tensor:
        """A ``[vocab]`` mask of the tokens whose first byte the object can continue with."""
        return first_byte_mask(self.token_bytes, [b for b in range(256) if self.state.copy().feed(bytes([b]))], vocab)

    def advance(self, token_id: int) -> None:
        """Take the token chosen (one ``accepts`` said yes to)."""
        self.state.feed(self.token_bytes(token_id))

    @property
    def done(self) -> bool:
        return self.state.done
