"""What compiling an expression first in a helper process costs (kvstream/hf/bounded_compile.py).

Every expression the ``regex`` module compiles for a request is compiled first in a helper
process under a memory and a time limit, then in the server's own (the regex module crashes or
takes gigabytes on nested counts); a client's expression the incremental machine holds is
checked in the helper alone (compiled here only if an answer needs it). For each expression
below, the same run times the baseline, ``regex.compile`` alone, against ``bounded_compile``
with its helper already running (the steady state: the helper is kept) and against the
helper's check alone (the server's own thread waiting, not compiling), all with the regex
module's cache purged before each compile, the median of the rounds; and the first check's
cost, the helper's start; and how long refusing the costly ones takes (the helper compiling
until its limit, then replaced).

    python benchmarks/bounded_compile.py [--rounds 15]

Needs the ``regex`` module (part of `pip install -e '.[hf]'`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _util  # noqa: F401  (the repository on sys.path)
import regex

from kvstream.hf.bounded_compile import CompileProbe, CompileTooCostly

EXPRESSIONS = {
    "date": r"\d{4}-\d{2}-\d{2}",
    "e-mail": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}",
    "lookahead password": r"(?=.*[A-Z])(?=.*\d)[A-Za-z\d]{8,64}",
    "200 words": "|".join(f"word{i}" for i in range(200)),
    "16 KiB of alternatives": "(?:x|y)" * 2300,
    "a{100000} (26 MB)": "a{100000}",
}
COSTLY = {"(?:ab|c){1000000} (crashes)": "(?:ab|c){1000000}", "(?=a)(?:(?:a{1000}){1000}){16} (5 GB)":
          "(?=a)(?:(?:a{1000}){1000}){16}"}


def timed(fn) -> float:
    regex.purge()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    probe = CompileProbe()
    first = timed(lambda: probe.check("a"))
    print(f"first check (starts the helper): {first * 1e3:.1f} ms")
    print(f"{'expression':28} {'regex.compile':>14} {'bounded':>10} {'ratio':>7} {'helper only':>12} {'ratio':>7}")
    for name, text in EXPRESSIONS.items():
        plain, bounded, helper = [], [], []
        for _ in range(args.rounds):  # alternating, so that the machine's noise falls on all three
            plain.append(timed(lambda: regex.compile(text)))
            bounded.append(timed(lambda: (probe.check(text), regex.compile(text))))
            helper.append(timed(lambda: probe.check(text)))
        p, b, h = (statistics.median(times) for times in (plain, bounded, helper))
        print(f"{name:28} {p * 1e3:11.2f} ms {b * 1e3:7.2f} ms {b / p:6.2f}x {h * 1e3:9.2f} ms {h / p:6.2f}x")
    for name, text in COSTLY.items():
        started = time.perf_counter()
        try:
            probe.check(text)
            verdict = "compiled?!"
        except CompileTooCostly as exc:
            verdict = str(exc)
        refused = time.perf_counter() - started
        restart = timed(lambda: probe.check("a"))
        print(f"{name}: refused in {refused * 1e3:.0f} ms ({verdict}); the next check, a new helper: {restart * 1e3:.0f} ms")
    probe.close()


if __name__ == "__main__":
    main()
