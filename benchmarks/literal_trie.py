"""What merging an alternation's literal options into a trie (pattern_machine._factored) does
to the incremental machine, against the same reader with every option kept apart, same run.

Expressions: a 300-property schema whose properties are enums of 50 values (the places after
each opening quote are every value, kept apart), a `guided_choice` of 1,000 choices, and a
GBNF grammar of 20,500 words (kept apart, its first places run past MAX_PLACES and the
regex module compiles it instead: that compile is timed). Each: the time to read it into a
machine, the places after each character of an answer (mean), and the time to follow that
answer cold, with each state's first bytes (what the candidate mask asks), in both ways.
Then the word grammar from its GBNF text to its machine, as read now and as before (every
character escaped in the expression, the regex module finding each rule's start).

    python benchmarks/literal_trie.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import regex  # noqa: E402

from kvstream.hf import pattern_machine  # noqa: E402
from kvstream.hf.guided import guide  # noqa: E402
from kvstream.hf.json_schema import schema_pattern  # noqa: E402
from kvstream.hf.pattern_machine import Alt, Machine, TooComplex, _Reader  # noqa: E402


def cases() -> list[tuple[str, str, str]]:
    schema = {"type": "object", "properties": {f"key_{k}": {"enum": [f"value_{v}" for v in range(50)]}
                                               for k in range(300)}}
    answer = "{" + ", ".join(f'"key_{k}": "value_{(k * 7) % 50}"' for k in range(300)) + "}"
    choices = [f"option number {i}" for i in range(1000)]
    words = 'root ::= ' + " | ".join(f'"w{i}"' for i in range(20_500))
    return [("schema, 300 enums of 50", schema_pattern(schema), answer),
            ("guided_choice of 1,000", guide({"guided_choice": choices}).pattern, "option number 777"),
            ("grammar of 20,500 words", guide({"grammar": words}).pattern, "w12345")]


def measure(pattern: str, answer: str) -> dict:
    start = time.perf_counter()
    machine = Machine(_Reader(pattern).read()[0])
    read_s = time.perf_counter() - start
    try:
        state = machine.start()
    except TooComplex:
        start = time.perf_counter()
        regex.compile(pattern)
        return {"read_s": read_s, "places": None, "follow_s": None, "regex_s": time.perf_counter() - start}
    places = 0
    start = time.perf_counter()
    for ch in answer:
        state = machine.step(state, ch)
        places += len(state)
        for head in Machine.heads(state):
            head.first_bytes()
    assert Machine.whole(state), "the answer must match"
    return {"read_s": read_s, "places": places / len(answer), "follow_s": time.perf_counter() - start, "regex_s": None}


def main() -> None:
    factored = pattern_machine._factored
    print(f"{'expression':<26} {'way':<10} {'read ms':>8} {'places/char':>12} {'follow ms':>10} {'regex compile s':>16}")
    for name, pattern, answer in cases():
        rows = {}
        for way in ("apart", "trie"):
            pattern_machine._factored = factored if way == "trie" else Alt
            try:
                rows[way] = measure(pattern, answer)
            finally:
                pattern_machine._factored = factored
            r = rows[way]
            places = "-" if r["places"] is None else f"{r['places']:.1f}"
            follow = "-" if r["follow_s"] is None else f"{r['follow_s'] * 1e3:.1f}"
            compiled = "-" if r["regex_s"] is None else f"{r['regex_s']:.2f}"
            print(f"{name:<26} {way:<10} {r['read_s'] * 1e3:>8.1f} {places:>12} {follow:>10} {compiled:>16}")
        apart, trie = rows["apart"], rows["trie"]
        if apart["follow_s"] and trie["follow_s"]:
            print(f"{'':<26} following: trie {apart['follow_s'] / trie['follow_s']:.1f}x faster; "
                  f"reading {trie['read_s'] / apart['read_s']:.2f}x as long")
    grammar_reading()


def grammar_reading() -> None:
    """The 20,500-word grammar from its GBNF text to its machine, as read now (plain letters
    and digits written plainly, rules found with the stdlib's re) and with every character
    escaped and the regex module finding the rules (as before), same run."""
    from kvstream.hf import grammar

    words = 'root ::= ' + " | ".join(f'"w{i}"' for i in range(20_500))
    timings = {}
    for way in ("before", "now"):
        saved = grammar._char, grammar.RULE_START
        if way == "before":
            grammar._char = lambda ch: f"\\U{ord(ch):08x}"
            grammar.RULE_START = regex.compile(saved[1].pattern)
        try:
            grammar._read_gbnf.cache_clear()
            start = time.perf_counter()
            pattern = grammar.read_gbnf(words).pattern
            written = time.perf_counter() - start
            Machine(_Reader(pattern).read()[0])
            timings[way] = (written, time.perf_counter() - start - written, len(pattern))
        finally:
            grammar._char, grammar.RULE_START = saved
    print(f"\nthe 20,500-word GBNF read into its machine: {'way':<7} {'GBNF s':>7} {'machine s':>10} {'expression':>11}")
    for way, (written, read, size) in timings.items():
        print(f"{'':<43} {way:<7} {written:>7.2f} {read:>10.2f} {size:>11,}")
    before, now = sum(timings["before"][:2]), sum(timings["now"][:2])
    print(f"{'':<43} now {before / now:.1f}x faster")


if __name__ == "__main__":
    main()
