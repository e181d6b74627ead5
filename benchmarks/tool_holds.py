"""What holding a model's own tool calls costs before its first token, for a request
offering many tools: the expression of every tool's call read into the incremental machine
(today's path, call_grammar.py, the expression written included) against the same expression
compiled by the ``regex`` module and the empty answer judged by it (``compile_pattern``: what
the hold did before, after writing it), and the first held step (the candidate mask of the first
token of a call), same run, same expression.

    python benchmarks/tool_holds.py [--tools 10 50] [--syntaxes hermes qwen3_xml deepseek mistral pythonic] [--rounds 2]

The tools are of the kind agents send: six parameters each (strings, an enum, integers,
numbers, booleans, arrays, nested objects with a bound). Both sides start cold: the caches
of the expression's machine and compiled form are cleared before each round. The backend
does this work on a worker thread before a request is queued (never on the event loop);
it is cached by the tools, so a client that sends the same tools again pays it once.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import regex  # noqa: E402

from kvstream.hf import call_grammar  # noqa: E402
from kvstream.hf.pattern_constraint import PatternConstraint, compile_pattern  # noqa: E402
from kvstream.hf.pattern_machine import machine_for  # noqa: E402
from kvstream.hf.tool_call_syntax import OPEN, CallReading  # noqa: E402

KINDS = ("string", "integer", "boolean", "array", "object", "number")
OPENINGS = {"hermes": OPEN, "qwen3_xml": OPEN, "deepseek": "<｜tool▁calls▁begin｜>", "mistral": "[TOOL_CALLS]",
            "granite": "<|tool_call|>", "llama3_json": '{"name": "', "pythonic": "[to"}


def tools(n: int) -> list[dict]:
    rng = random.Random(n)
    out = []
    for i in range(n):
        properties = {}
        for j in range(6):
            kind = rng.choice(KINDS)
            schema: dict = {"type": kind, "description": "what this parameter is for, in a sentence"}
            if kind == "array":
                schema["items"] = {"type": "string"}
            if kind == "object":
                schema["properties"] = {"name": {"type": "string"}, "count": {"type": "integer", "minimum": 0}}
            if kind == "string" and j == 0:
                schema["enum"] = ["alpha", "beta", "gamma"]
            properties[f"param_{j}"] = schema
        out.append({"type": "function", "function": {"name": f"tool_number_{i}", "description": "A tool.", "parameters": {
            "type": "object", "properties": properties, "required": list(properties)[:3]}}})
    return out


def cold() -> None:
    call_grammar._cached_hold.cache_clear()
    machine_for.cache_clear()
    compile_pattern.cache_clear()
    regex.purge()  # (the regex module caches what it compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--syntaxes", nargs="+", default=["hermes", "qwen3_xml", "deepseek", "mistral", "pythonic"],
                        choices=list(OPENINGS))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"{'tools':>5} {'syntax':>11} {'expression':>11} {'machine s':>10} {'regex s':>9} {'regex/machine':>14} "
          f"{'first step ms':>14}")
    for n in args.tools:
        offered = tools(n)
        for syntax in args.syntaxes:
            machine_s = regex_s = step_s = float("inf")
            for _ in range(args.rounds):
                cold()
                start = time.perf_counter()
                hold = call_grammar.call_hold(CallReading(syntax), offered, None, {})
                machine_s = min(machine_s, time.perf_counter() - start)
                assert hold is not None, syntax
                constraint = PatternConstraint(call_grammar.expression(hold.pattern), lambda i: OPENINGS[syntax].encode(), ())
                start = time.perf_counter()
                assert constraint.accepts(0)  # the opening tag: the first step of a held call
                step_s = min(step_s, time.perf_counter() - start)
                start = time.perf_counter()
                compile_pattern.__wrapped__(hold.pattern)  # uncached: compiled, then the empty answer judged
                regex_s = min(regex_s, time.perf_counter() - start)
            print(f"{n:>5} {syntax:>11} {len(hold.pattern):>11,} {machine_s:>10.2f} {regex_s:>9.2f} {regex_s / machine_s:>14.1f} "
                  f"{step_s * 1000:>14.2f}")


if __name__ == "__main__":
    main()
