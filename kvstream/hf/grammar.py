"""GBNF grammars (llama.cpp's ``grammar``, vLLM's ``guided_grammar``) as regular expressions
of the ``regex`` module, whose recursive groups take what a context-free grammar says.

Each rule becomes a named group in a ``(?(DEFINE)...)`` block and each reference a call to it
(``(?&name)``), so a grammar may be recursive (nested parentheses, JSON); the answer is what
``root`` matches whole (followed token by token by pattern_machine.py, which reads these
groups and calls as recursive rules). Read as llama.cpp reads it (its grammars/README.md): ``name ::= ...``
rules, ``"literals"`` and ``[character classes]`` with its escapes (``\\n``, ``\\t``, ``\\r``,
``\\\\``, ``\\"``, ``\\]``, ``\\[``, ``\\xHH``, ``\\uHHHH``, ``\\UHHHHHHHH``), ``[^...]``, ``.`` (any
character), ``( ... )`` groups, ``|`` alternatives, ``*``, ``+``, ``?`` and ``{m}``, ``{m,}``,
``{m,n}``, ``{,n}`` repetitions, ``#`` comments. A rule may go on over several lines. Left
recursion (a rule that can reach itself before reading a character) is refused, as llama.cpp
refuses it: a matcher would recurse forever.

Token references match one token of the model's vocabulary, not text: ``<[id]>`` by its id,
``<text>`` (``<think>``, ``<|im_end|>``) the one token whose text that is, and ``!<...>`` any
token but that one. The expression is over characters, so each referenced token stands in it
as a character of its own, a *sentinel* from a private-use range no model's text uses
(``read_gbnf`` lists them; the engine feeds that character for that token and resolves the
texts against its tokenizer, pattern_constraint.py). Characters of the text (``.``, ``[^...]``)
never match a sentinel. A negation, ``!<x>``, stands for a run of text and other referenced
tokens without that token: exactly llama.cpp's meaning under ``*`` (``(!<|end|>)* <|end|>``,
how it is written), looser than one token when counted (``!<x>{2}`` takes a longer run).
"""

from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass
from typing import Any

import regex

from kvstream.hf.engine_turns import give_turn

MAX_REPEAT = 100_000  # the largest {m,n} bound taken (the regex module's own limit is far higher)
# Token references' sentinels: private-use characters (plane 15), one per distinct token.
TOKEN_SENTINELS = 0xF0000
MAX_TOKEN_REFERENCES = 4096
_SENTINEL_RANGE = f"\\U{TOKEN_SENTINELS:08x}-\\U{TOKEN_SENTINELS + MAX_TOKEN_REFERENCES - 1:08x}"
# Placeholders the reader writes where a text character is matched, replaced once the whole
# grammar is read (by nothing, or by the sentinels excluded where it references tokens).
_ANY_TEXT = "\x00"  # ``.`` and ``[^]``
_NOT_TOKENS = "\x01"  # at the end of a negated class
TOKEN_ID = regex.compile(r"\[([0-9]+)\]")


class GrammarError(ValueError):
    """A grammar that cannot be read, or that the engine cannot follow; says where."""


ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "[": "[", "]": "]", "-": "-", "^": "^", "/": "/"}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
NAME = regex.compile(r"[A-Za-z0-9_-]+")
# (The stdlib's: the regex module looks for the required "::=" in all the text left before
# matching, at each of a rule's elements: a grammar of 20,500 words took 0.65 s in it.)
RULE_START = re.compile(r"[A-Za-z0-9_-]+[ \t]*::=")
REPETITION = regex.compile(r"\{\s*([0-9]*)\s*(,?)\s*([0-9]*)\s*\}")


def _char(text: str) -> str:
    """One character as a pattern of the regex module, inside a class or out: an ASCII
    letter, digit or underscore as itself (a word list then reads as runs of plain text:
    each character escaped, 20,500 words took the machine 0.69 s to read), any other escaped."""
    if text in _PLAIN:
        return text
    return f"\\U{ord(text):08x}"


_PLAIN = frozenset(string.ascii_letters + string.digits + "_")


class _Reader:
    """A recursive-descent reader of one grammar, writing each rule's pattern as it goes."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.rules: dict[str, str] = {}
        self.groups: dict[str, str] = {}  # rule name -> its group's name
        self.referenced: dict[str, int] = {}  # rule name -> where it is first used
        self.tokens: dict[str, str] = {}  # a token reference ("[id]" or its "<text>") -> its sentinel
        # Each rule's shape, for the left-recursion check: nested tuples ("seq", parts),
        # ("alt", options), ("rep", node, least), ("call", name), ("text", may be empty).
        self.shapes: dict[str, Any] = {}

    # ---------------------------------------------------------------- reading
    def error(self, message: str) -> GrammarError:
        line = self.text.count("\n", 0, self.pos) + 1
        column = self.pos - (self.text.rfind("\n", 0, self.pos) + 1) + 1
        return GrammarError(f"{message} (line {line}, column {column})")

    def space(self) -> None:
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            elif c.isspace():
                self.pos += 1
            else:
                return

    def name(self) -> str:
        match = NAME.match(self.text, self.pos)
        if match is None:
            raise self.error("expected a rule name")
        self.pos = match.end()
        return match.group()

    def at_rule_start(self) -> bool:
        """Whether a new rule (``name ::=``) begins here."""
        return RULE_START.match(self.text, self.pos) is not None

    def group(self, name: str) -> str:
        return self.groups.setdefault(name, f"r{len(self.groups)}")

    def read(self) -> str:
        self.space()
        if self.pos >= len(self.text):
            raise GrammarError("the grammar is empty")
        while self.pos < len(self.text):
            start = self.pos
            name = self.name()
            self.space()
            if not self.text.startswith("::=", self.pos):
                raise self.error("expected '::=' after the rule name")
            self.pos += 3
            self.space()
            if name in self.rules:
                self.pos = start
                raise self.error(f"rule '{name}' is defined twice")
            self.rules[name], self.shapes[name] = self.alternatives()
            self.space()
        if "root" not in self.rules:
            raise GrammarError("the grammar has no 'root' rule")
        for name, where in self.referenced.items():
            if name not in self.rules:
                self.pos = where
                raise self.error(f"rule '{name}' is used but not defined")
        self.check_left_recursion()
        defined = "".join(f"(?P<{self.group(name)}>{pattern})" for name, pattern in self.rules.items())
        pattern = f"(?(DEFINE){defined})(?&{self.group('root')})"
        if self.tokens:  # text characters never match a token's sentinel
            return pattern.replace(_ANY_TEXT, f"[^{_SENTINEL_RANGE}]").replace(_NOT_TOKENS, _SENTINEL_RANGE)
        return pattern.replace(_ANY_TEXT, r"[\s\S]").replace(_NOT_TOKENS, "")

    def alternatives(self) -> tuple[str, Any]:
        """``a | b | ...``: (pattern, shape)."""
        options, shapes = [], []
        while True:
            pattern, shape = self.sequence()
            options.append(pattern)
            shapes.append(shape)
            self.space()
            if self.pos < len(self.text) and self.text[self.pos] == "|":
                self.pos += 1
                self.space()
                continue
            return "(?:" + "|".join(options) + ")", ("alt", shapes)

    def sequence(self) -> tuple[str, Any]:
        parts, shapes = [], []
        while True:
            give_turn()  # (read on a request's worker thread: engine_turns.py)
            self.space()
            if self.pos >= len(self.text) or self.text[self.pos] in "|)" or self.at_rule_start():
                return "".join(parts), ("seq", shapes)
            pattern, shape = self.repeated(*self.element())
            parts.append(pattern)
            shapes.append(shape)

    def element(self) -> tuple[str, Any]:
        c = self.text[self.pos]
        if c == '"':
            self.pos += 1
            chars = []
            while not self.closes('"', "a literal"):
                chars.append(self.character())
            return "".join(_char(ch) for ch in chars), ("text", not chars)
        if c == "[":
            return self.char_class(), ("text", False)
        if c == ".":
            self.pos += 1
            return _ANY_TEXT, ("text", False)
        if c == "(":
            self.pos += 1
            self.space()
            pattern, shape = self.alternatives()
            self.space()
            if self.pos >= len(self.text) or self.text[self.pos] != ")":
                raise self.error("expected ')'")
            self.pos += 1
            return pattern, shape
        if c in "<!":
            return self.token_reference(), ("text", False)
        where = self.pos
        name = self.name()
        self.referenced.setdefault(name, where)
        return f"(?&{self.group(name)})", ("call", name)

    def token_reference(self) -> str:
        """``<[id]>``, ``<text>`` or either negated with ``!``: its sentinel, or for a negation
        a run of anything but it."""
        negated = self.text[self.pos] == "!"
        if negated:
            self.pos += 1
            if not self.text.startswith("<", self.pos):
                raise self.error("'!' negates a token reference: expected '<' after it")
        end = self.text.find(">", self.pos + 1)
        newline = self.text.find("\n", self.pos)
        if end < 0 or 0 <= newline < end:
            raise self.error("a token reference is not closed with '>'")
        inside = self.text[self.pos + 1 : end]
        if inside.startswith("["):
            match = TOKEN_ID.fullmatch(inside)
            if match is None:
                raise self.error("a token id reference is <[id]>, the id in digits")
            spelling = f"[{int(match.group(1))}]"
        elif inside:
            spelling = self.text[self.pos : end + 1]  # the token's text, its brackets included
        else:
            raise self.error("a token reference names a token: <[id]> or <its text>")
        sentinel = self.tokens.get(spelling)
        if sentinel is None:
            if len(self.tokens) >= MAX_TOKEN_REFERENCES:
                raise self.error(f"a grammar references at most {MAX_TOKEN_REFERENCES} distinct tokens")
            sentinel = self.tokens[spelling] = chr(TOKEN_SENTINELS + len(self.tokens))
        self.pos = end + 1
        return f"[^{_char(sentinel)}]+" if negated else _char(sentinel)

    def closes(self, end: str, what: str) -> bool:
        """Whether ``end`` closes ``what`` here (then read past it); an error at the text's end."""
        if self.pos >= len(self.text):
            raise self.error(f"{what} is not closed")
        if self.text[self.pos] == end:
            self.pos += 1
            return True
        return False

    def character(self) -> str:
        """One character of a literal or class, its escape read."""
        c = self.text[self.pos]
        if c != "\\":
            self.pos += 1
            return c
        if self.pos + 1 >= len(self.text):
            raise self.error("an escape is not finished")
        kind = self.text[self.pos + 1]
        if kind in HEX_ESCAPES:
            digits = self.text[self.pos + 2 : self.pos + 2 + HEX_ESCAPES[kind]]
            if len(digits) != HEX_ESCAPES[kind] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"'\\{kind}' takes {HEX_ESCAPES[kind]} hexadecimal digits")
            self.pos += 2 + HEX_ESCAPES[kind]
            try:
                return chr(int(digits, 16))
            except ValueError:
                raise self.error(f"'\\{kind}{digits}' is not a character") from None
        if kind not in ESCAPES:
            raise self.error(f"unknown escape '\\{kind}'")
        self.pos += 2
        return ESCAPES[kind]

    def char_class(self) -> str:
        self.pos += 1
        negated = self.text.startswith("^", self.pos)
        if negated:
            self.pos += 1
        parts = []
        while not self.closes("]", "a character class"):
            low = self.character()
            if self.text.startswith("-", self.pos) and not self.text.startswith("-]", self.pos):
                self.pos += 1
                high = self.character()
                if ord(high) < ord(low):
                    raise self.error("a character range runs backwards")
                parts.append(f"{_char(low)}-{_char(high)}")
            else:
                parts.append(_char(low))
        if not parts:
            return _ANY_TEXT if negated else "(?!)"  # [^] is any character; [] none
        return "[^" + "".join(parts) + _NOT_TOKENS + "]" if negated else "[" + "".join(parts) + "]"

    def repeated(self, pattern: str, shape: Any) -> tuple[str, Any]:
        """The element with its repetition suffix, if any."""
        atom = f"(?:{pattern})"
        self.space_inline()
        if self.pos >= len(self.text):
            return atom, shape
        c = self.text[self.pos]
        if c in "*+?":
            self.pos += 1
            return atom + c, ("rep", shape, 1 if c == "+" else 0)
        if c != "{":
            return atom, shape
        match = REPETITION.match(self.text, self.pos)
        if match is None or (not match.group(1) and not match.group(2)):
            raise self.error("a repetition is {m}, {m,}, {m,n} or {,n}")
        self.pos = match.end()
        low = int(match.group(1) or 0)
        high = None if match.group(2) and not match.group(3) else int(match.group(3) or low)
        if max(low, high or 0) > MAX_REPEAT or (high is not None and high < low):
            raise self.error(f"a repetition's bounds are 0 <= m <= n <= {MAX_REPEAT}")
        return atom + "{" + str(low) + ("," + ("" if high is None else str(high)) if match.group(2) else "") + "}", \
            ("rep", shape, low)

    def space_inline(self) -> None:
        """Spaces before a repetition suffix on the same line (llama.cpp allows none across lines)."""
        while self.pos < len(self.text) and self.text[self.pos] in " \t":
            self.pos += 1

    # ---------------------------------------------------------------- checks
    def check_left_recursion(self) -> None:
        """Refuse a rule that can call itself before reading a character (through calls at
        the start of its alternatives, past any that may match nothing)."""
        nullable = dict.fromkeys(self.shapes, False)
        changed = True
        while changed:  # which rules may match nothing: a fixed point
            changed = False
            for name, shape in self.shapes.items():
                if not nullable[name] and _may_be_empty(shape, nullable):
                    nullable[name] = changed = True
        leading = {name: _leading_calls(shape, nullable) for name, shape in self.shapes.items()}
        for start in self.shapes:
            seen, todo = set(), list(leading[start])
            while todo:
                name = todo.pop()
                if name == start:
                    raise GrammarError(f"rule '{start}' is left-recursive (it can reach itself before reading a "
                                       "character): write it with a repetition instead")
                if name not in seen:
                    seen.add(name)
                    todo += leading[name]


def _may_be_empty(shape: Any, nullable: dict[str, bool]) -> bool:
    kind = shape[0]
    if kind == "text":
        return shape[1]
    if kind == "call":
        return nullable[shape[1]]
    if kind == "rep":
        return shape[2] == 0 or _may_be_empty(shape[1], nullable)
    if kind == "alt":
        return any(_may_be_empty(option, nullable) for option in shape[1])
    return all(_may_be_empty(part, nullable) for part in shape[1])  # seq


def _leading_calls(shape: Any, nullable: dict[str, bool]) -> set[str]:
    """The rules ``shape`` may call before it reads a character."""
    kind = shape[0]
    if kind == "text":
        return set()
    if kind == "call":
        return {shape[1]}
    if kind == "rep":
        return _leading_calls(shape[1], nullable)
    if kind == "alt":
        return set().union(*(_leading_calls(option, nullable) for option in shape[1]))
    calls: set[str] = set()
    for part in shape[1]:  # seq: each part leads while all before it may be empty
        calls |= _leading_calls(part, nullable)
        if not _may_be_empty(part, nullable):
            break
    return calls


@dataclass(frozen=True)
class Gbnf:
    """A grammar read: the regular expression (``regex`` module syntax) of what its root rule
    admits, and its token references, each as it was written (``"[id]"`` or ``"<text>"``) with
    the sentinel character standing for it in ``pattern``."""

    pattern: str
    tokens: tuple[tuple[str, str], ...] = ()


def read_gbnf(text: str) -> Gbnf:
    """``text`` read; GrammarError, saying where, for what cannot be read or followed.
    Cached by the text: a request's grammar is read when it is checked and again when it is
    queued, and clients resend theirs."""
    if not isinstance(text, str):
        raise GrammarError("a grammar is a string")
    return _read_gbnf(text)


@functools.lru_cache(maxsize=64)
def _read_gbnf(text: str) -> Gbnf:
    reader = _Reader(text)
    try:
        pattern = reader.read()
    except RecursionError:
        raise GrammarError("the grammar nests its groups too deep") from None
    return Gbnf(pattern, tuple(reader.tokens.items()))


def gbnf_pattern(text: str) -> str:
    """The regular expression of what ``text``'s root rule admits (``read_gbnf``'s, for a
    grammar whose token references, if any, the caller does not need to resolve)."""
    return read_gbnf(text).pattern
