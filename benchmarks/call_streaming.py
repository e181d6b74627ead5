"""What reading a model's tool call as it streams costs per token, against reading it once at
the end (what the engine did before calls streamed), same run, same text.

    python benchmarks/call_streaming.py [--sizes 2000 20000 100000] [--chars-per-token 4] [--rounds 3]

For each argument size, one answer writing a file through a call (``path`` and ``content``,
the content that many characters of code) is fed to the scanner a token's worth of characters
at a time, in the Hermes JSON form, Qwen3-Coder's XML form and DeepSeek-V3's fenced form: "streamed" is today's
scanner (each call's arguments go out as they are written); "at the end" is the same text fed
to a scanner that holds the body and reads it whole when its close tag arrives (the pre-stream
reading, kept here as the baseline). Both run on the event loop's thread in the server, once
per generated token, so the number that matters is microseconds per token beside a decode
step (tens of milliseconds on a CPU, ~10 ms on a GPU). Best of --rounds per side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstream.hf import deepseek_calls  # noqa: E402
from kvstream.hf.tool_call_syntax import CLOSE, OPEN, CallReading  # noqa: E402

# Where each syntax's call ends (the baseline reads the body once this arrives).
CLOSES = {"hermes": CLOSE, "qwen3_xml": CLOSE, "deepseek": deepseek_calls.CALL_END}
LINE = 'def handler(event):\n    return {"status": 200, "body": event["path"]}  # </b> & "quotes"\n'


def answer(syntax: str, size: int) -> str:
    content = (LINE * (size // len(LINE) + 1))[:size]
    if syntax == "hermes":
        return OPEN + "\n" + json.dumps({"name": "write_file", "arguments": {"path": "app.py", "content": content}}) + "\n" + CLOSE
    if syntax == "deepseek":
        return (deepseek_calls.CALLS_BEGIN + deepseek_calls.CALL_BEGIN + "function" + deepseek_calls.SEP + "write_file\n```json\n"
                + json.dumps({"path": "app.py", "content": content}) + "\n```" + deepseek_calls.CALL_END + deepseek_calls.CALLS_END)
    return (OPEN + "\n<function=write_file>\n<parameter=path>\napp.py\n</parameter>\n<parameter=content>\n" + content
            + "\n</parameter>\n</function>\n" + CLOSE)


def streamed(syntax: str, text: str, step: int) -> str:
    """Today's scanner: the call's arguments joined from its deltas."""
    scanner, arguments = CallReading(syntax).scanner(), ""
    for start in range(0, len(text), step):
        for piece in scanner.feed(text[start:start + step]):
            arguments += piece.call["function"]["arguments"] if piece.call else ""
    for piece in scanner.finish():
        arguments += piece.call["function"]["arguments"] if piece.call else ""
    return arguments


def at_the_end(syntax: str, text: str, step: int) -> str:
    """The baseline: hold the text, look for the close tag at each token, read the body once."""
    pending, arguments, close = "", "", CLOSES[syntax]
    for start in range(0, len(text), step):
        pending += text[start:start + step]
        end = pending.find(close)
        if end >= 0:
            scanner = CallReading(syntax).scanner()
            for piece in scanner.feed(pending[:end + len(close)]) + scanner.finish():
                arguments += piece.call["function"]["arguments"] if piece.call else ""
            pending = pending[end + len(close):]
    return arguments


def best(fn, rounds: int, *args) -> tuple[float, str]:
    times, out = [], ""
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 20000, 100000])
    parser.add_argument("--chars-per-token", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"{'syntax':<10}{'chars':>8}{'tokens':>8}{'streamed us/tok':>17}{'at the end us/tok':>19}{'ratio':>8}")
    for syntax in CLOSES:
        for size in args.sizes:
            text = answer(syntax, size)
            tokens = -(-len(text) // args.chars_per_token)
            t_stream, out_stream = best(streamed, args.rounds, syntax, text, args.chars_per_token)
            t_end, out_end = best(at_the_end, args.rounds, syntax, text, args.chars_per_token)
            assert json.loads(out_stream) == json.loads(out_end), "the two readings disagree"
            print(f"{syntax:<10}{size:>8}{tokens:>8}{t_stream / tokens * 1e6:>17.1f}{t_end / tokens * 1e6:>19.1f}"
                  f"{t_stream / t_end:>7.2f}x")
    print("ratio: streamed time / at-the-end time (the price of streaming the arguments)")


if __name__ == "__main__":
    main()
