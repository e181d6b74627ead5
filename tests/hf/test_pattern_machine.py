"""The incremental machine that follows an expression one character at a time
(pattern_machine.py): the same verdicts as the ``regex`` module on every prefix, characters
split across tokens, what it does not read left to the ``regex`` module, and a long answer
followed to its end within a client's matching budget."""

from __future__ import annotations

import json
import random

import pytest
import regex

from tests.conftest import require_import

require_import("torch")

from kvstream.hf.grammar import gbnf_pattern, read_gbnf  # noqa: E402
from kvstream.hf.json_schema import schema_pattern  # noqa: E402
from kvstream.hf.pattern_constraint import CLIENT_BUDGET_S, PatternConstraint, compile_pattern  # noqa: E402
from kvstream.hf.pattern_machine import Machine, machine_for, partial_span  # noqa: E402
from kvstream.types import BackendRejected  # noqa: E402
from tests.hf.test_grammar import JSON_GBNF  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "kind": {"enum": ["a", "b\u00e9"]},
    "items": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
    "extra": {"anyOf": [{"type": "null"}, {"type": "integer"}, {}]}}}

# (expression, texts to cut into prefixes: matches and near misses)
CASES = [
    (gbnf_pattern(JSON_GBNF), ['{"a": [1, -2.5e+3, true, null], "b": {"c": "x\\"y\\u00e9"}}', '{ "k" : "v" }\n',
                               '{"a": 01}', '{"a" 1}', '{"deep": [[[[{"x": []}]]]]}']),
    (schema_pattern(SCHEMA), ['{"name": "caf\u00e9", "kind": "b\u00e9", "items": [1, 2], "extra": {"x": [1]}}',
                              '{"name":"abcdefg","kind":"a","items":[],"extra":null}',
                              '{"name": "", "kind": "a", "items": [0.5, 1e3, -0], "extra": 12}']),
    (gbnf_pattern('root ::= "(" root* ")" | [a-z]{2,3}'), ["((ab)(abc)())", "(()", "abcd", "(a)"]),
    (r"\d{3}-\d{4}", ["555-1234", "55-51234", "555-12345"]),
    (r"[A-Z][a-z]+( [A-Z][a-z]+)*", ["John Smith", "John smith", "Jo  Sm"]),
    (r"\w+@\w+\.com", ["me@here.com", "me@@here.com", "\u00e9t\u00e9@x.com"]),
    (r"(a|ab)*c", ["abababc", "aac", "abbc"]),
    (r".{2,5}x", ["a\u00e9cdx", "ab\nx", "abcdefx"]),
    (r"(?:yes|no|maybe)!?", ["maybe!", "mayb!", "no!!"]),
    (r"\p{Lu}\p{Ll}*", ["\u00c9cole", "Ecole", "eCole"]),
    (r"[\d\s]+|[^\d\s]{2}", ["1 2\t3", "ab", "a1"]),
    (r"a{0,3}b{2,}c{,2}", ["aaabbbcc", "aaaab", "bbccc"]),
    (r"a+?b(?:cd)??e", ["aabcde", "abe", "abcce", "az"]),
    (r"(?P<x>ab)(?&x)(?P>x)", ["ababab", "abab", "abba"]),
    (r"\{\}\[\]\.\-\ [\]a][-a][a-]\x41\u00e9\U0001F600", ["{}[]. ]-aA\u00e9\U0001f600", "{}[]. a-aA\u00e9\U0001f600"]),
    (r"(?!)|z", ["z", "y"]),
    # Plain runs read at once (a quantifier takes the run's last character only), lone "]" and "}"
    # themselves, one character's set shared by every place it is read.
    (r"abc+d?e{2}f*", ["abccdeeff", "abcabcee", "abee", "abcee"]),
    (r"x]y}z(?:xy]){1,2}", ["x]y}zxy]xy]", "x]y}zxy]xy]xy]", "x]y}z"]),
    (r'"key_1"|"key_2"|"key_10"', ['"key_10"', '"key_1"', '"key_12"', '"key"']),
    # Literal options merged into a trie (with the empty word, a word that is another's
    # beginning, options that are not literal beside them, a class of one character).
    (r"(?:ab|abc|a||b[c]|x+|abd)d", ["abcd", "abdd", "ad", "d", "bcd", "xxd", "abd", "abxd", "bd"]),
    (r"(?:cat|car|cart|ca\.t)s?", ["carts", "cars", "ca.ts", "cas", "cart", "c"]),
]


# The regex module's partial matching takes "az" for the beginning of a match of "a+?b": a lazy
# quantifier is judged against its greedy form, the same language.
REFERENCE = {r"a+?b(?:cd)??e": r"a+b(?:cd)?e"}


def _verdicts(machine: Machine, text: str) -> tuple[bool, bool]:
    state = machine.start()
    for ch in text:
        state = machine.step(state, ch)
        if not state:
            return False, False
    return True, Machine.whole(state)


@pytest.mark.parametrize("expression,texts", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_the_machine_says_what_the_regex_module_says_on_every_prefix(expression, texts):
    machine = machine_for(expression)
    assert machine is not None, expression
    reference = regex.compile(REFERENCE.get(expression, expression))
    rng = random.Random(7)
    alphabet = '{}[]":, 01e.-abxyzABé😀\n\t\\'
    for text in texts:
        for cut in range(len(text) + 1):
            for probe in (text[:cut], text[:cut] + rng.choice(alphabet), text[:cut] + "".join(rng.choices(alphabet, k=3))):
                expected = (reference.fullmatch(probe, partial=True) is not None, reference.fullmatch(probe) is not None)
                assert _verdicts(machine, probe) == expected, (expression[:60], probe)


@pytest.mark.parametrize("expression", [r"^ab$", r"(?=a)a", r"(?i)ab", r"(a)\1", r"a++", r"(?>a)b", r"\bword",
                                        r"a{2", "[[a]]", r"\N{DIGIT ONE}"])
def test_what_the_machine_does_not_read_is_left_to_the_regex_module(expression):
    assert machine_for(expression) is None
    spelled = {0: b"a", 1: b"b", 2: b"z"}
    constraint = PatternConstraint(compile_pattern(expression), spelled.__getitem__, ())
    assert constraint.machine is None
    reference = regex.compile(expression)
    for token, text in spelled.items():
        assert constraint.accepts(token) == (reference.fullmatch(text.decode(), partial=True) is not None), expression


def test_a_character_split_across_tokens_is_judged_by_what_it_can_still_become():
    """é (C3 A9) and 😀 (F0 9F 98 80) in pieces: a lead byte is taken where the class holds a
    character it can begin, a continuation only if it keeps to one; while a character is
    unfinished the mask offers the continuation bytes that keep to one only. (The regex module's way has a
    stand-in for an unfinished character, é, and so refuses the emoji's first bytes.)"""
    spelled = {0: b"\xc3", 1: b"\xa9", 2: b"\xa8", 3: b"\xf0\x9f", 4: b"\x98\x80", 5: b"x", 6: b"\x98", 7: b"\x80"}
    constraint = PatternConstraint(compile_pattern("(?:\u00e9|\U0001f600)+x"), spelled.__getitem__, ())
    assert [constraint.accepts(t) for t in range(8)] == [True, False, False, True, False, False, False, False]
    constraint.advance(0)
    assert [constraint.accepts(t) for t in range(8)] == [False, True, False, False, False, False, False, False]
    assert constraint.candidates(8).tolist() == [False, True, False, False, False, False, False, False]  # é's only
    constraint.advance(1)
    assert [constraint.accepts(t) for t in range(8)] == [True, False, False, True, False, True, False, False]
    constraint.advance(3)
    assert constraint.accepts(4) and constraint.accepts(6) and not constraint.accepts(1) and not constraint.complete
    constraint.advance(6)
    assert constraint.accepts(7) and not constraint.accepts(4)
    constraint.advance(7)
    constraint.advance(5)
    assert constraint.text.decode() == "\u00e9\U0001f600x" and constraint.complete and constraint.done
    assert partial_span(b"\xc3") == (0xC0, 0xFF) and partial_span(b"\xf0\x9f\x98") == (0x1F600, 0x1F63F)
    assert partial_span(b"\x80") is None and partial_span(b"\xc3\xa9") is None
    # E0 begins U+0800 to U+0FFF only (E0 81 AD would spell "m" overlong): not the start of "m".
    assert partial_span(b"\xe0") == (0x800, 0xFFF) and partial_span(b"\xf0") == (0x10000, 0x3FFFF)
    lead = {0: b"\xe0", 1: b"\xf0", 2: b"\xc2", 3: b"m"}
    assert [PatternConstraint(compile_pattern("[a-z\u00e0]"), lead.__getitem__, ()).accepts(t) for t in range(4)] == \
        [False, False, False, True]
    # A class the regex module judges (\d): the lead byte of a fullwidth digit (EF BC 90) may
    # begin one, a CJK lead byte (E4: U+4000-U+4FFF, no digits) may not.
    digits = {0: b"\xef", 1: b"\xe4", 2: b"\xbc", 3: b"\x90", 4: b"7"}
    number = PatternConstraint(compile_pattern(r"\d+"), digits.__getitem__, ())
    assert [number.accepts(t) for t in range(5)] == [True, False, False, False, True]
    assert number.candidates(5).tolist() == [True, False, False, False, True]
    for token in (0, 2, 3):
        number.advance(token)
    assert number.text.decode() == "\uff10" and number.complete
    assert not PatternConstraint(compile_pattern("\U0001f600"), spelled.__getitem__, (), incremental=False).accepts(3)


def test_a_closure_past_its_bound_goes_on_in_the_regex_module():
    spelled = {0: b"a", 1: b"b", 2: b"c"}
    at_start = PatternConstraint(compile_pattern("(?:a?){0,50000}b"), spelled.__getitem__, ())
    assert at_start.machine is None and at_start.accepts(0) and at_start.accepts(1) and not at_start.accepts(2)
    midway = PatternConstraint(compile_pattern("(?:a(?:b?){0,30000})*c"), spelled.__getitem__, ())
    assert midway.machine is not None and midway.accepts(2)
    assert midway.accepts(0) and midway.machine is None  # the closure after "a" ran past the bound
    midway.advance(0)
    assert midway.accepts(1) and midway.accepts(2) and not midway.failed


def test_what_the_machine_holds_is_compiled_by_the_regex_module_only_when_it_gives_up(monkeypatch):
    """A schema's or a grammar's expression the machine holds from its start is not compiled
    by the regex module up front (seconds for a large one, in C with the interpreter's lock
    held: every stream paused); when the machine gives up midway it is compiled then, outside
    the matching budget. One the machine cannot start on is compiled at once, as one it
    cannot read; a bound the regex module refuses stays the schema's error."""
    import time

    from kvstream.hf.guided import guide
    from kvstream.hf.json_schema import SchemaError, compile_schema
    from kvstream.hf.pattern_machine import LazyExpression, machine_holds

    compiled = []
    original = regex.compile
    monkeypatch.setattr(regex, "compile", lambda text, *a, **k: compiled.append(text) or original(text, *a, **k))
    held = compile_schema({"type": "object", "properties": {"lazy_city": {"type": "string"}, "lazy_days": {"type": "integer"}}})
    assert isinstance(held, LazyExpression) and not compiled
    assert held.fullmatch('{"lazy_city": "Paris", "lazy_days": 3}') and compiled == [held.pattern]  # asked: compiled once
    with pytest.raises(SchemaError):
        compile_schema({"type": "object", "properties": {"s": {"type": "string", "maxLength": 10**12}}})
    grammar = guide({"grammar": 'root ::= "yes" | "no"'})
    assert machine_holds(grammar.pattern)
    # Its first places past MAX_PLACES (words would be merged into a trie: a class keeps them
    # apart): compiled at once, which takes the regex module 2 s and 72 MB here, past what one
    # request's expression may (bounded_compile.py): a 400, where it paused every stream as long.
    wide = 'root ::= ' + " | ".join(f'"w{i}" [ab]' for i in range(20_500))
    assert not machine_holds(read_gbnf(wide).pattern)
    with pytest.raises(BackendRejected, match="to compile"):
        guide({"grammar": wide})
    assert not machine_holds("(?:a?){0,50000}")  # (too many places at once) compiled at once, cheaply
    assert guide({"guided_regex": "(?:a?){0,50000}"}) and compiled[-1] == "(?:a?){0,50000}"

    def slow_compile(text):
        time.sleep(0.3)  # longer than the whole budget below
        return compile_pattern(text)

    spelled = {0: b"a", 1: b"b", 2: b"c"}
    midway = PatternConstraint(LazyExpression("(?:a(?:b?){0,30000})*c", slow_compile), spelled.__getitem__, (),
                               budget_s=0.1)
    assert midway.machine is not None and midway.accepts(0) and midway.machine is None  # gave up after "a"
    midway.advance(0)
    assert midway.accepts(1) and midway.accepts(2) and not midway.failed

    def refused(text):
        raise regex.error("too large")

    broken = PatternConstraint(LazyExpression("(?:a(?:b?){0,30000})*c", refused), spelled.__getitem__, ())
    assert not broken.accepts(0) and broken.failed  # that answer ends; nothing raised into the engine's step


def test_a_list_of_20000_words_is_held_by_the_machine_from_its_first_character():
    """Literal options are merged into a trie: the grammar of 20,500 words, whose first places
    ran past MAX_PLACES (one a word) and were compiled by the regex module up front instead
    (seconds with the interpreter's lock held), starts with one place; its verdicts are the
    regex module's."""
    from kvstream.hf.guided import guide
    from kvstream.hf.pattern_machine import machine_holds

    pattern = guide({"grammar": 'root ::= ' + " | ".join(f'"w{i}"' for i in range(20_500))}).pattern
    assert machine_holds(pattern)
    machine, reference = machine_for(pattern), regex.compile(pattern)
    assert len(machine.start()) == 1
    for probe in ("w0", "w20499", "w20500", "w1234", "w12345", "w", "x1", "w01", "w204999"):
        for cut in range(len(probe) + 1):
            text = probe[:cut]
            assert _verdicts(machine, text) == (reference.fullmatch(text, partial=True) is not None,
                                                reference.fullmatch(text) is not None), text


def test_words_nested_past_the_tries_depth_stay_apart_and_the_machine_holds_them():
    """An enum of 999 values, each the one before and one more character, branches at every
    character: merged whole, the reading recursed past Python's limit and the regex module
    compiled the schema instead; past MAX_TRIE_DEPTH its words stay apart, and the machine
    holds them as before, with the regex module's verdicts."""
    from kvstream.hf.json_schema import compile_schema, schema_pattern
    from kvstream.hf.pattern_machine import LazyExpression

    schema = {"enum": ["a" * i for i in range(1, 1000)]}
    assert isinstance(compile_schema(schema), LazyExpression)
    machine, reference = machine_for(schema_pattern(schema)), regex.compile(schema_pattern(schema))
    assert machine is not None and machine.matches_something()
    for probe in ('"a"', '"' + "a" * 999 + '"', '"' + "a" * 1000 + '"', '""', '"aab"'):
        assert _verdicts(machine, probe) == (reference.fullmatch(probe, partial=True) is not None,
                                             reference.fullmatch(probe) is not None), probe


def test_a_long_answer_under_a_grammar_is_followed_to_its_end_within_a_clients_budget():
    """An 8 KB JSON answer under llama.cpp's JSON grammar, three bytes a token, with the
    budget a client's grammar gets, the candidate mask asked every token: the machine
    follows it whole (asking the regex module about the whole text, the way before it, the
    answer ran out of its 10 s at token 112, 340 bytes in)."""
    text = json.dumps([{"name": f"item {i}", "tags": ["a", "b"], "price": i * 1.5, "ok": i % 2 == 0} for i in range(120)])
    data = text.encode()
    pieces = [data[i : i + 3] for i in range(0, len(data), 3)]
    spelled = dict(enumerate(pieces))
    pattern = compile_pattern(gbnf_pattern(JSON_GBNF.replace("root   ::= object", "root   ::= value")))
    constraint = PatternConstraint(pattern, spelled.__getitem__, (), budget_s=CLIENT_BUDGET_S)
    assert constraint.machine is not None and len(data) > 8000
    for token in range(len(pieces)):
        assert constraint.accepts(token), (token, constraint.text[-40:])
        constraint.advance(token)
        assert constraint.candidates(len(pieces)).any() or constraint.done
    assert constraint.complete and not constraint.failed and constraint.text == data


def test_on_a_real_vocabulary_both_ways_accept_the_same_tokens_at_every_step(smollm2):
    """Along an answer tokenized by SmolLM2's tokenizer, the machine and the regex module's
    way accept the same tokens among 1,500 drawn each step (tokens of whole characters: the
    regex module's way has a stand-in for a partial one), agree on whole and done, and the
    machine's mask holds every token the other's does."""
    from kvstream.hf.token_bytes import TokenBytes

    tokenizer = smollm2[2]
    spell = TokenBytes(tokenizer)
    vocab = len(tokenizer)

    def whole_characters(raw: bytes) -> bool:
        try:
            return bool(raw.decode())
        except UnicodeDecodeError:
            return False

    pool = [t for t in range(vocab) if whole_characters(spell(t))]
    rng = random.Random(3)
    forced_call = schema_pattern({"type": "object", "properties": {
        "name": {"enum": ["get_weather", "get_time"]}, "arguments": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    for expression, text in ((gbnf_pattern(JSON_GBNF), '{"a": [1, -2.5e+3, true, null], "b": {"c": "x\\"y caf\u00e9 \U0001f600"}}'),
                             (forced_call, '{"name": "get_time", "arguments": {"city": "Z\u00fcrich"}}'),
                             (r"\d{3}-\d{4} [A-Z]\w+", "555-1234 Hello")):
        machine_way = PatternConstraint(compile_pattern(expression), spell, ())
        regex_way = PatternConstraint(compile_pattern(expression), spell, (), incremental=False)
        assert machine_way.machine is not None
        for token in tokenizer(text, add_special_tokens=False).input_ids:
            for candidate in rng.sample(pool, 1500) + [token]:
                assert machine_way.accepts(candidate) == regex_way.accepts(candidate), (machine_way.text, spell(candidate))
            assert bool((machine_way.candidates(vocab) >= regex_way.candidates(vocab)).all())
            machine_way.advance(token)
            regex_way.advance(token)
            assert (machine_way.complete, machine_way.done) == (regex_way.complete, regex_way.done), machine_way.text
        assert machine_way.complete and machine_way.text.decode() == text


def test_continuations_are_interned_so_a_deeply_nested_answer_hashes_in_constant_time(monkeypatch):
    """Equal continuations are one object: states hash and compare by identity, not by
    walking frames as deep as the answer nests (as nested tuples, JSON mode 3,000 brackets
    deep spent 27 ms a character hashing). Two walks of the same text reach the same objects;
    the deep answer still closes exactly."""
    from kvstream.hf.json_schema import JSON_OBJECT

    machine = machine_for(schema_pattern(JSON_OBJECT))
    text = '{"a": ' + "[" * 3000

    def walk(state, chars):
        for ch in chars:
            state = machine.step(state, ch)
            assert state, ch
        return state

    first = walk(machine.start(), text)
    machine._steps.clear()  # the second walk computes its steps again (its frames come from the table)
    second = walk(machine.start(), text)
    assert {id(place) for place in first} == {id(place) for place in second}
    node = next(iter(first)).node
    assert machine.frame(node, 0, None) is machine.frame(node, 0, None)
    assert walk(first, "]" * 3000 + "}") == {None}
    # The tables start afresh (as at MAX_FRAMES): a state made before goes on with frames made
    # after, equal in meaning though not the same objects, and judges the text the same way.
    machine.forget()
    assert not machine.step(first, "}") and not machine.step(first, "x")
    assert walk(walk(first, "]" * 2999), "]}") == {None}
    assert walk(walk(machine.start(), text), "]" * 3000 + "}") == {None}
    # Emptied again and again mid-answer (a bound of 50 frames): still exact.
    from kvstream.hf import pattern_machine

    monkeypatch.setattr(pattern_machine, "MAX_FRAMES", 50)
    machine.forget()
    deep = walk(machine.start(), text)
    assert len(machine._frames) < 60 and not machine.step(deep, "}")
    assert walk(deep, "]" * 3000 + "}") == {None}
