"""A regular expression followed one character at a time, for ``PatternConstraint``: the
expressions KVStream writes (a JSON schema's, a GBNF grammar's) and most a client writes.

The ``regex`` module answers "is this text the beginning of a match?" by reading the whole
text again: under llama.cpp's JSON grammar, a 2 KB answer costs about 5 ms a question and a
constrained step may ask 256 of them (``benchmarks/pattern_matching.py``), so that a long
answer slows down quadratically and, past a few KB, runs out of a client's matching budget.

Here the expression is read once into a tree, and the constraint keeps, between tokens, the
set of places the text so far may have reached. Each place is a continuation, what is left
to match as a linked list of ``Frame``s (node, index, rest): a sequence's frame holds the
index of its next part, a repetition's the copies matched so far. Frames are interned per
machine (equal continuations are one object), so a place hashes and compares in constant
time however deep the answer nests (as nested tuples, a JSON answer 3,000 brackets deep
cost 27 ms a character in hashing alone). A candidate then costs its
own characters, whatever the answer's length, and "nothing can follow" is read off the set.
Recursive groups (``(?(DEFINE)...)`` and ``(?&name)``: how grammars recurse) are frames like
any other.

An alternation's literal options (an enum's values, a choice list, a grammar's words) are
merged into a trie as they are read (``_factored``): the same language, and the places after
a character are the words it can still begin, not every word.

Read: literals and escapes, ``.``, classes (ranges, negation, ``\\d \\w \\s`` and their
negations, ``\\p{...}``: the ``regex`` module judges those per character), groups (capturing,
named, ``(?:``), ``|``, ``* + ? {m} {m,} {m,n} {,n}`` and their lazy forms (the same language),
``(?!)`` (nothing), DEFINE blocks and calls. Anything else (anchors, lookarounds,
backreferences, inline flags, possessive quantifiers, atomic groups) is ``Unsupported``: the
constraint asks the ``regex`` module instead. An expression whose places multiply past
``MAX_PLACES`` at one character (``(a?){0,50000}``, left recursion through calls) raises
``TooComplex`` there, and the constraint goes on with the ``regex`` module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import regex

from kvstream.hf.bounded_compile import bounded_compile
from kvstream.hf.engine_turns import give_turn

MAX_PLACES = 20_000  # continuations one character's closure may visit
# The regex module refuses a repetition count from this on ("repeat count too big"): an
# expression the machine reads is one it could fall back on (LazyExpression).
REGEX_MAX_REPEAT = 2**32 - 1
MAX_STEPS_CACHED = 8_192  # (state, character) -> state entries a machine remembers (a few MB)
MAX_FRAMES = 200_000  # interned continuations a machine keeps before starting afresh (~30 MB)


# The tree's node kinds (a class attribute: one comparison of ints in the hot loop).
CHARS, SEQ, ALT, REPEAT, CALL = range(5)


class Unsupported(ValueError):
    """An expression using something this reader does not follow."""


class TooComplex(RuntimeError):
    """One character's closure visited more than ``MAX_PLACES`` continuations."""


# --------------------------------------------------------------------------- the tree
class CharSet:
    """One character from a set: code point ranges, and tests the ``regex`` module judges
    (``\\d``, ``\\p{L}``...), the whole possibly negated."""

    kind = CHARS
    __slots__ = ("ranges", "tests", "negated", "whole", "_spans", "_first_bytes")

    def __init__(self, ranges: tuple[tuple[int, int], ...] = (), tests: tuple[Any, ...] = (), negated: bool = False,
                 whole: Any = None) -> None:
        self.ranges, self.tests, self.negated = ranges, tests, negated
        self.whole = whole  # with tests: the set as one compiled expression, to search a span with
        self._spans: dict[tuple[int, int], bool] = {}
        self._first_bytes: frozenset[int] | None = None

    @property
    def empty(self) -> bool:
        return not self.negated and not self.ranges and not self.tests

    def contains(self, ch: str) -> bool:
        c = ord(ch)
        hit = any(lo <= c <= hi for lo, hi in self.ranges) or any(t.fullmatch(ch) for t in self.tests)
        return hit != self.negated

    def may_contain(self, low: int, high: int) -> bool:
        """Whether some code point in ``[low, high]`` is in the set (a test's set is searched
        for one, in the ``regex`` module, once per span)."""
        if self.tests:
            found = self._spans.get((low, high))
            if found is None:
                found = self._spans[(low, high)] = self.whole.search(_span_text(low, high)) is not None
            return found
        if not self.negated:
            return any(lo <= high and low <= hi for lo, hi in self.ranges)
        for lo, hi in sorted(self.ranges):  # negated: some point of [low, high] left uncovered
            if lo > low:
                return True
            low = max(low, hi + 1)
            if low > high:
                return False
        return True

    def first_bytes(self) -> frozenset[int]:
        """The bytes a character of the set may begin with in UTF-8."""
        if self._first_bytes is None:
            self._first_bytes = frozenset(b for b in range(256) if (span := _lead_span(b)) and self.may_contain(*span))
        return self._first_bytes


@functools.lru_cache(maxsize=64)
def _span_text(low: int, high: int) -> str:
    """Every code point from ``low`` to ``high``, as one string to search."""
    return "".join(map(chr, range(low, high + 1)))


class Seq:
    kind = SEQ
    __slots__ = ("parts",)

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts


class Alt:
    kind = ALT
    __slots__ = ("options",)

    def __init__(self, options: list[Any]) -> None:
        self.options = options


class Repeat:
    kind = REPEAT
    __slots__ = ("node", "low", "high")

    def __init__(self, node: Any, low: int, high: int | None) -> None:
        self.node, self.low, self.high = node, low, high


class Call:
    kind = CALL
    __slots__ = ("name", "target")

    def __init__(self, name: str) -> None:
        self.name, self.target = name, None


def _lead_span(byte: int) -> tuple[int, int] | None:
    """The code points a UTF-8 character beginning with ``byte`` may be (None: no character
    begins with it)."""
    if byte < 0x80:
        return byte, byte
    # (lead bytes from, to, payload bits, continuation bytes, the least code point so long:
    # E0 80 80 would spell U+0000, which UTF-8 spells in one byte)
    for first, last, bits, tail, least in ((0xC2, 0xDF, 0x1F, 1, 0x80), (0xE0, 0xEF, 0x0F, 2, 0x800),
                                           (0xF0, 0xF4, 0x07, 3, 0x10000)):
        if first <= byte <= last:
            low = (byte & bits) << (6 * tail)
            return max(low, least), min(low + (1 << (6 * tail)) - 1, 0x10FFFF)
    return None


def partial_span(data: bytes) -> tuple[int, int] | None:
    """The code points an incomplete UTF-8 character ``data`` (its first 1-3 bytes) may
    finish as; None where no character begins so."""
    span = _lead_span(data[0])
    if span is None or data[0] < 0x80:
        return None
    tail = _utf8_len(data[0]) - 1  # the continuation bytes it takes
    if len(data) - 1 >= tail:
        return None
    value = data[0] & (0x3F >> tail)
    for byte in data[1:]:
        if byte & 0xC0 != 0x80:
            return None
        value = (value << 6) | (byte & 0x3F)
    shift = 6 * (tail - (len(data) - 1))
    low, high = max(span[0], value << shift), min(span[1], ((value + 1) << shift) - 1)
    return (low, high) if low <= high else None


def _utf8_len(lead: int) -> int:
    return 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4


# --------------------------------------------------------------------------- reading
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
_CLASS_ESCAPES = "dDwWsS"
_HEX = {"x": 2, "u": 4, "U": 8}
_QUANTIFIER = regex.compile(r"\{([0-9]*)(,?)([0-9]*)\}")
_GROUP_NAME = regex.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# Characters that stand for themselves outside a class: everything but the syntax (a lone
# "]" or "}" is itself in the regex module too). A run of them is read in one match.
_PLAIN_RUN = regex.compile(r"[^\\()\[.|*+?{^$]+")
_QUANTIFIER_OPENERS = frozenset("*+?{")


@functools.lru_cache(maxsize=4096)
def _literal(ch: str) -> CharSet:
    """The set of the one character ``ch``, shared by every place it is read: a set is never
    changed once made (what it caches, its spans and first bytes, depends on the set alone),
    and a place is its node with its continuation, so two places sharing the node stay two."""
    code = ord(ch)
    return CharSet(((code, code),))


def _spelled(node: Any) -> str | None:
    """The one text ``node`` matches, if it is a literal (a character, or a sequence of them:
    "" for the empty one); else None."""
    parts = node.parts if node.kind == SEQ else (node,)
    codes = []
    for part in parts:
        if part.kind != CHARS:
            return None
        ranges = part.ranges
        if len(ranges) != 1 or ranges[0][0] != ranges[0][1] or part.tests or part.negated:
            return None
        codes.append(ranges[0][0])
    return "".join(map(chr, codes))


_END = ""  # a trie's key for "a word ends here" (no character is empty)


def _factored(options: list[Any]) -> Any:
    """``options`` as one alternation, its literal options (an enum's values, a grammar's word
    list) merged into a trie: the language is the same (which option a match takes does not
    matter here), and the places after a character are the words it can still begin, not
    every word: 20,000 words were 20,000 places from the first character on, past
    ``MAX_PLACES``, and the regex module compiled them instead (seconds, holding the lock).
    Words that branch more than ``MAX_TRIE_DEPTH`` times one inside another ("a", "aa",
    "aaa"... 999 of them ran past Python's recursion limit) stay apart."""
    trie: dict[str, Any] = {}
    others = []
    for option in options:
        word = _spelled(option)
        if word is None:
            others.append(option)
            continue
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[_END] = True
    if len(options) - len(others) < 2:
        return Alt(options)
    try:
        merged = _trie_node(trie, 0)
    except _TooDeep:
        return Alt(options)
    return Alt([merged, *others]) if others else merged


MAX_TRIE_DEPTH = 100  # branchings one inside another merged (each a level of recursion, here and in walks)


class _TooDeep(Exception):
    """The words branch more than ``MAX_TRIE_DEPTH`` times one inside another."""


def _trie_node(trie: dict[str, Any], depth: int) -> Any:
    if depth > MAX_TRIE_DEPTH:
        raise _TooDeep
    options = []
    for ch, rest in trie.items():
        if ch == _END:
            continue
        parts = [_literal(ch)]
        while len(rest) == 1 and _END not in rest:  # one way on: a run of characters
            ((ch, rest),) = rest.items()
            parts.append(_literal(ch))
        if len(rest) > 1:
            parts.append(_trie_node(rest, depth + 1))
        options.append(parts[0] if len(parts) == 1 else Seq(parts))
    if _END in trie:
        options.append(Seq([]))
    return options[0] if len(options) == 1 else Alt(options)


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0
        self.rules: dict[str, Any] = {}
        self.calls: list[Call] = []

    def peek(self, ahead: int = 0) -> str:
        i = self.pos + ahead
        return self.text[i] if i < len(self.text) else ""

    def read(self) -> tuple[Any, dict[str, Any]]:
        root = self.alternatives()
        if self.pos != len(self.text):
            raise Unsupported(f"unexpected {self.peek()!r} at {self.pos}")
        for call in self.calls:
            if call.name not in self.rules:
                raise Unsupported(f"a call to an undefined group {call.name!r}")
            call.target = self.rules[call.name]
        return root, self.rules

    def alternatives(self) -> Any:
        options = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            give_turn()  # (read on a request's worker thread: engine_turns.py)
            options.append(self.sequence())
        return options[0] if len(options) == 1 else _factored(options)

    def sequence(self) -> Any:
        parts: list[Any] = []
        text = self.text
        while True:
            # A run of plain characters at once (a schema's expression is mostly its names
            # and values spelled out: read one character a call, a 300-property schema took
            # a quarter of a second, all of it holding the interpreter's lock every stream's
            # step needs), less its last character where a quantifier follows: that one is
            # the quantifier's.
            run = _PLAIN_RUN.match(text, self.pos)
            if run is not None:
                end = run.end()
                if end < len(text) and text[end] in _QUANTIFIER_OPENERS:
                    end -= 1
                parts.extend(map(_literal, text[self.pos : end]))
                self.pos = end
            if self.peek() in ("", "|", ")"):
                break
            parts.append(self.quantified(self.atom()))
        return parts[0] if len(parts) == 1 else Seq(parts)

    def quantified(self, node: Any) -> Any:
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.pos += 1
                low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{":
                match = _QUANTIFIER.match(self.text, self.pos)
                if match is None or not (match.group(1) or match.group(3)):
                    raise Unsupported("a '{' that is not a repetition")
                self.pos = match.end()
                low = int(match.group(1) or 0)
                high = None if match.group(2) and not match.group(3) else int(match.group(3) or low)
                if high is not None and high < low:
                    raise Unsupported("a repetition whose bounds run backwards")
                if max(low, high or 0) >= REGEX_MAX_REPEAT:  # read only what the regex module compiles too
                    raise Unsupported("a repetition count the regex module refuses")
            else:
                return node
            if self.peek() == "?":  # lazy: the same language
                self.pos += 1
            elif self.peek() == "+":
                raise Unsupported("possessive quantifiers")
            node = Repeat(node, low, high)

    def atom(self) -> Any:
        c = self.peek()
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_class()
        if c == ".":
            self.pos += 1
            return CharSet(((10, 10),), negated=True)
        if c == "\\":
            return self.escape()
        if c in "*+?{^$":
            raise Unsupported(f"{c!r} where a character or group belongs")
        self.pos += 1
        return _literal(c)

    def group(self) -> Any:
        text, start = self.text, self.pos
        if text.startswith("(?!)", start):
            self.pos += 4
            return CharSet()
        if text.startswith("(?(DEFINE)", start):
            self.pos += len("(?(DEFINE)")
            while self.peek() == "(":
                self.group()
            self.expect(")")
            return Seq([])
        for opener in ("(?&", "(?P>"):
            if text.startswith(opener, start):
                self.pos += len(opener)
                call = Call(self.group_name())
                self.expect(")")
                self.calls.append(call)
                return call
        name = None
        if text.startswith("(?P<", start) or (text.startswith("(?<", start) and self.peek(3) not in ("=", "!")):
            self.pos += 4 if text.startswith("(?P<", start) else 3
            name = self.group_name()
            self.expect(">")
        elif text.startswith("(?:", start):
            self.pos += 3
        elif text.startswith("(?", start):
            raise Unsupported(f"the group {text[start:start + 4]!r}...")
        else:
            self.pos += 1
        give_turn()
        node = self.alternatives()
        self.expect(")")
        if name is not None:
            if name in self.rules:
                raise Unsupported(f"the group name {name!r} is used twice")
            self.rules[name] = node
        return node

    def group_name(self) -> str:
        match = _GROUP_NAME.match(self.text, self.pos)
        if match is None:
            raise Unsupported("a group name that is not a name")
        self.pos = match.end()
        return match.group()

    def expect(self, c: str) -> None:
        if self.peek() != c:
            raise Unsupported(f"expected {c!r} at {self.pos}")
        self.pos += 1

    def escape(self) -> CharSet:
        """An escape: one character, or a class the ``regex`` module judges."""
        kind = self.peek(1)
        if kind == "":
            raise Unsupported("an unfinished escape")
        if kind in _CLASS_ESCAPES or kind in "pP":
            end = self.pos + 2
            if kind in "pP":
                end = self.text.find("}", self.pos) + 1 if self.peek(2) == "{" else self.pos + 3
                if end <= self.pos + 2:
                    raise Unsupported("an unfinished \\p{...}")
            piece, self.pos = self.text[self.pos:end], end
            try:
                test = regex.compile(piece)
                return CharSet(tests=(test,), whole=test)
            except regex.error as exc:
                raise Unsupported(f"{piece!r} ({exc})") from None
        if kind in _HEX:
            digits = self.text[self.pos + 2 : self.pos + 2 + _HEX[kind]]
            if len(digits) != _HEX[kind] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise Unsupported(f"a \\{kind} escape without its digits")
            self.pos += 2 + _HEX[kind]
            code = int(digits, 16)
            if code > 0x10FFFF:
                raise Unsupported("a character past U+10FFFF")
            return CharSet(((code, code),))
        if kind in _SIMPLE_ESCAPES:
            self.pos += 2
            code = ord(_SIMPLE_ESCAPES[kind])
            return CharSet(((code, code),))
        if kind.isalnum() or kind == "_":  # \b, \A, \1, \0, \N{...}...: not a plain character
            raise Unsupported(f"the escape \\{kind}")
        self.pos += 2
        return CharSet(((ord(kind), ord(kind)),))

    def char_class(self) -> CharSet:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        tests: list[Any] = []
        first = True
        while True:
            c = self.peek()
            if c == "":
                raise Unsupported("an unclosed class")
            if c == "]" and not first:
                self.pos += 1
                whole = regex.compile(self.text[start : self.pos]) if tests else None
                return CharSet(tuple(ranges), tuple(tests), negated, whole)
            if c == "[":
                raise Unsupported("a '[' inside a class (a nested set in the regex module's V1)")
            first = False
            low = self.class_item()
            if isinstance(low, CharSet):
                tests.extend(low.tests)
                ranges.extend(low.ranges)
                continue
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                high = self.class_item()
                if isinstance(high, CharSet) or high < low:
                    raise Unsupported("a class range that is not a range")
                ranges.append((low, high))
            else:
                ranges.append((low, low))

    def class_item(self) -> int | CharSet:
        """One character of a class (its code point), or an escape that is a class."""
        c = self.peek()
        if c != "\\":
            self.pos += 1
            return ord(c)
        item = self.escape()
        if item.tests:
            return item
        return item.ranges[0][0]


@functools.lru_cache(maxsize=32)
def machine_for(pattern_text: str) -> Machine | None:
    """The machine following ``pattern_text`` (cached by the text), or None where the
    expression uses what this module does not read."""
    try:
        root, _ = _Reader(pattern_text).read()
    except (Unsupported, RecursionError):
        return None
    return Machine(root)


def machine_holds(pattern_text: str) -> bool:
    """Whether the machine reads ``pattern_text`` and can start on it (its first places within
    ``MAX_PLACES``): then the machine holds the answer, and the regex module is needed only if
    it gives up later on (LazyExpression)."""
    machine = machine_for(pattern_text)
    if machine is None:
        return False
    try:
        machine.start()
    except TooComplex:
        return False
    return True


class LazyExpression:
    """An expression the machine reads, compiled by ``compile`` (the regex module's, after its
    helper process: bounded_compile.py) only if an answer needs it (the machine gives up on
    a text past its ``MAX_PLACES``): the regex module takes long to compile a large one,
    holding the interpreter's lock in C meanwhile (the calls of 50 tools: up to 1.5 s here,
    3-10x what the machine takes to read it; benchmarks/tool_holds.py), which pauses the
    event loop and the engine's thread alike. One past the helper's limits (1 s, 64 MiB) is
    not compiled: that answer ends as past its matching budget."""

    def __init__(self, text: str, compile: Callable[[str], Any] | None = None) -> None:
        self.pattern = text
        self._compile = compile
        self._compiled: Any = None

    def compiled(self) -> Any:
        """The regex module's expression, compiled now if not yet (PatternConstraint asks
        before a budgeted match: compiling is not matching time)."""
        if self._compiled is None:
            self._compiled = (self._compile or bounded_compile)(self.pattern)
        return self._compiled

    def fullmatch(self, text: str, partial: bool = False, timeout: float | None = None) -> Any:
        return self.compiled().fullmatch(text, partial=partial, timeout=timeout)


# --------------------------------------------------------------------------- following
class Frame:
    """A continuation: ``node`` from ``index`` on, then ``rest`` (a Frame, or None: the
    expression is whole). Made by ``Machine.frame`` only, which interns them: equal
    continuations are the same object, hashed and compared by identity."""

    __slots__ = ("node", "index", "rest")

    def __init__(self, node: Any, index: int, rest: Frame | None) -> None:
        self.node, self.index, self.rest = node, index, rest


State = frozenset  # of places: None (the expression is whole) or a Frame


class Machine:
    """An expression's tree and the steps between states (remembered: one schema is asked
    about the same places again and again)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self._steps: dict[tuple[State, str], State] = {}
        # (node, index, rest) by identity -> the one Frame for it. Emptied with the remembered
        # steps: a state made before then and an equal one made after are two objects, which
        # costs a recomputed step, never a wrong one.
        self._frames: dict[tuple[int, int, int], Frame] = {}

    def frame(self, node: Any, index: int, rest: Frame | None) -> Frame:
        """The interned continuation ``node`` from ``index``, then ``rest``."""
        key = (id(node), index, id(rest))  # rest is interned (or None), and held by the frame
        frame = self._frames.get(key)
        if frame is None:
            frame = self._frames[key] = Frame(node, index, rest)
        return frame

    def matches_something(self) -> bool:
        """Whether some finite text matches (not so where a rule must always call itself
        again: an object whose property is that object)."""
        targets, seen, todo = [], set(), [self.root]
        while todo:  # every rule a call reaches
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if not len(seen) % 1024:
                give_turn()
            kind = node.kind
            if kind == SEQ:
                todo.extend(node.parts)
            elif kind == ALT:
                todo.extend(node.options)
            elif kind == REPEAT:
                todo.append(node.node)
            elif kind == CALL:
                targets.append(node.target)
                todo.append(node.target)
        ending: set[int] = set()  # rules known to match some finite text: a fixed point
        changed = True
        while changed:
            changed = False
            for target in targets:
                if id(target) not in ending and _ends(target, ending):
                    ending.add(id(target))
                    changed = True
        return _ends(self.root, ending)

    def forget(self) -> None:
        """Drop the remembered steps (to time the machine cold)."""
        self._steps.clear()
        self._frames.clear()

    def start(self) -> State:
        return self.close([self.frame(self.root, 0, None)])

    def step(self, state: State, ch: str) -> State:
        """The state after ``ch`` (empty: the text cannot go on so)."""
        key = (state, ch)
        after = self._steps.get(key)
        if after is None:
            after = self.close([place.rest for place in state if place is not None and place.node.contains(ch)])
            if len(self._steps) >= MAX_STEPS_CACHED or len(self._frames) >= MAX_FRAMES:
                self._steps.clear()
                self._frames.clear()
            self._steps[key] = after
        return after

    @staticmethod
    def whole(state: State) -> bool:
        """The text so far is a whole match."""
        return None in state

    @staticmethod
    def heads(state: State) -> list[CharSet]:
        """The character sets the next character must come from."""
        return [place.node for place in state if place is not None]

    def close(self, places: list[Any]) -> State:
        """The continuations ``places`` stand for, expanded until each begins with a
        character set (or is the end): the states the text may be in."""
        out: set[Any] = set()
        seen: set[Any] = set()
        todo = list(places)
        while todo:
            place = todo.pop()
            if place in seen:
                continue
            seen.add(place)
            if len(seen) > MAX_PLACES:
                raise TooComplex(f"more than {MAX_PLACES} places after one character")
            if place is None:
                out.add(None)
                continue
            node, index, rest = place.node, place.index, place.rest
            kind = node.kind
            if kind == CHARS:
                if not node.empty:
                    out.add(place)
            elif kind == SEQ:  # its part at index, then the parts after it
                parts = node.parts
                if index == len(parts):
                    todo.append(rest)
                elif index == len(parts) - 1:  # the last part: nothing of this sequence after it
                    todo.append(self.frame(parts[index], 0, rest))
                else:
                    todo.append(self.frame(parts[index], 0, self.frame(node, index + 1, rest)))
            elif kind == ALT:
                todo.extend(self.frame(option, 0, rest) for option in node.options)
            elif kind == REPEAT:  # index copies matched
                if node.high is None or index < node.high:
                    # Past the least count, more copies are one state (an unbounded loop stays finite).
                    more = index + 1 if node.high is not None or index < node.low else index
                    todo.append(self.frame(node.node, 0, self.frame(node, more, rest)))
                if index >= node.low:
                    todo.append(rest)
            else:  # CALL
                todo.append(self.frame(node.target, 0, rest))
        return frozenset(out)


def _ends(node: Any, ending: set[int]) -> bool:
    """Whether ``node`` matches some finite text, the rules in ``ending`` known to."""
    kind = node.kind
    if kind == CHARS:
        return not node.empty
    if kind == SEQ:
        give_turn()  # (the whole tree is walked once more: engine_turns.py)
        return all(_ends(part, ending) for part in node.parts)
    if kind == ALT:
        return any(_ends(option, ending) for option in node.options)
    if kind == REPEAT:
        return node.low == 0 or _ends(node.node, ending)
    return id(node.target) in ending
