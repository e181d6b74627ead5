"""Tool calls written as a Python list of calls, ``[get_weather(city="Paris"), get_time()]``
(the "pythonic" templates of Llama 3.2 and 4, Gemma 3 and ToolACE: "you MUST put it in the
format of [func_name1(params_name1=params_value1, ...), func_name2(params)]"), read as they
stream (vLLM's ``pythonic`` parser). An answer that opens with ``[`` is followed character by
character (strings, escapes, nesting); each call goes out whole, as a ``tool_calls`` entry,
the moment its closing parenthesis is read: its keyword arguments are Python literals
(``ast.literal_eval``, never evaluated as code), sent as a JSON object. Streamed piecemeal
they would not be JSON, so a call's arguments are not split. A call that does not read as one
(positional arguments, a variable for a value...), or one cut short, is text, with what
follows it; an answer whose first call is not one is its text.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass

from kvstream.hf.call_streams import Piece, call_entry

FORMAT_HINT = "[func_name1(params_name1=params_value1"  # what the templates tell the model
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4 may wrap the list in these


def pythonic_call(text: str) -> tuple[str, str] | None:
    """The name and JSON arguments of one call written ``name(key=literal, ...)``; None if
    the text is not such a call."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(keyword.arg is None for keyword in node.keywords):
            return None
        name = _dotted_name(node.func)
        arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords}
        return None if name is None else (name, json.dumps(arguments, ensure_ascii=False, allow_nan=False))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None  # not Python, not literals, not JSON-able (a set, bytes, NaN), too deep


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        owner = _dotted_name(node.value)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


@dataclass
class PythonicCallScanner:
    """One choice's text, read for a Python list of calls (``feed``, then ``finish``)."""

    calls: int = 0
    _pending: str = ""
    _mode: str = ""  # "" until the answer's first character says, then "text", "calls" or "done"
    _at: int = 0  # characters of _pending followed
    _depth: int = 0
    _quote: str = ""  # the quote of the string being read, if any
    _escaped: bool = False
    _call_start: int | None = None  # where the call being read begins
    _naming: bool = False  # its name is being read
    _rest: int | None = None  # "done": where the text after the calls (or after the last good call) begins

    def feed(self, text: str) -> list[Piece]:
        if self._mode == "text":
            return [Piece(text=text)] if text else []
        self._pending += text
        if not self._mode:
            start = self._pending.lstrip()
            if not start or (PYTHON_START.startswith(start) and start != PYTHON_START):
                return []  # nothing yet says which
            head = start.removeprefix(PYTHON_START).lstrip()
            if not head:
                return []
            if not head.startswith("["):
                self._mode, text, self._pending = "text", self._pending, ""
                return [Piece(text=text)]
            self._mode, self._at = "calls", len(self._pending) - len(head)
        return self._follow()

    def finish(self) -> list[Piece]:
        text, self._pending = self._pending, ""
        if self._mode != "done" or not self.calls:
            if not self.calls:  # no call: the text as it was
                return [Piece(text=text)] if text and self._mode != "text" else []
            self._rest = self._call_start if self._call_start is not None else self._at  # cut short: text
        rest = text[self._rest:].strip()
        rest = rest.removeprefix(PYTHON_END).strip() if self._mode == "done" else rest
        return [Piece(text=rest)] if rest else []

    def _follow(self) -> list[Piece]:
        text, out = self._pending, []
        at = self._at
        while at < len(text) and self._mode == "calls":
            char = text[at]
            at += 1
            if self._naming:  # a call's name, up to its parenthesis
                if char == "(":
                    self._naming, self._depth = False, self._depth + 1
                elif not (char.isalnum() or char in "_."):
                    return out + self._not_a_call(at)
            elif self._quote:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == self._quote:
                    self._quote = ""
            elif char in "'\"":
                self._quote = char
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                self._depth -= 1
                if self._depth == 0:  # the list's end
                    if not self.calls:
                        return self._not_a_call(at)
                    self._mode, self._rest = "done", at
                elif self._depth == 1 and char == ")" and self._call_start is not None:
                    read = pythonic_call(text[self._call_start:at])
                    if read is None:
                        return out + self._not_a_call(at)
                    out.append(Piece(call=call_entry(read[0], read[1], self.calls)))
                    self.calls, self._call_start = self.calls + 1, None
            elif self._depth == 1 and self._call_start is None and not char.isspace() and char != ",":
                if not (char.isalpha() or char == "_"):
                    return out + self._not_a_call(at)
                self._call_start, self._naming = at - 1, True
        self._at = at
        return out

    def _not_a_call(self, at: int) -> list[Piece]:
        """What was being read is not a call: before any call, the answer is text (all of it
        goes out now, the rest as it comes); after one, it and what follows are."""
        self._at = at
        if self.calls:
            self._mode, self._rest = "done", self._call_start
            return []
        self._mode, text, self._pending = "text", self._pending, ""
        return [Piece(text=text)]
