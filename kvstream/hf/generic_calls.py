"""Tool calls for a model whose chat template shows it no tools (``tool_call_syntax``
``generic``, chosen by ``auto`` for such a template), in the form of llama.cpp's former
"Generic" chat format: the tools are described in the system message, and the answer is held
(json_schema.py) to one JSON object, either ``{"tool_calls": [{"name", "arguments"}, ...]}``
or ``{"response": "..."}``. (The llama-server built here, on its PEG parser, shows such a
template no tools and answers in free text; Ollama refuses the tools. Either way the model
cannot call: here it can, and ``--tool-call-syntax none`` gives Ollama's 400 instead.)

``GenericAnswerScanner`` reads that object as it streams: a ``response`` string's characters
go out as content as they are written (JSON escapes decoded), the calls as each one is
written (the list read as Mistral's JSON list after its mark is, call_streams.py). Earlier
calls in the conversation reach such a template as the same object in the assistant's text
(tool_call_syntax.calls_as_text), so the model sees the form it is asked for.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvstream.hf.call_streams import Piece
from kvstream.hf.tool_call_syntax import MarkedCallScanner
from kvstream.hf.tool_calls import forced_call_schema

GENERIC = "generic"
_HEAD = re.compile(r'\s*\{\s*"(tool_calls|response)"\s*:\s*')
_HEADS = ('{"tool_calls":', '{"response":')  # the object's two openings, without whitespace
_MARK = "\x00calls\x00"  # what the inner list scanner is told the calls follow (never in a model's text)


def tools_prompt(tools: list[dict[str, Any]], single_call: bool) -> str:
    """The system text that shows the model the tools and the answer's two forms."""
    described = [{key: function[key] for key in ("name", "description", "parameters") if key in function}
                 for function in (tool.get("function") or {} for tool in tools)]
    calls = ('{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}' if single_call else
             '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}, ...]}')
    return ("You can call these tools:\n" + json.dumps(described, ensure_ascii=False) + "\n\n"
            "Answer with one JSON object. To call " + ("a tool" if single_call else "tools") + ": " + calls +
            '. To answer the user without a tool: {"response": "<your answer>"}.')


def with_tools_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]], single_call: bool) -> list[dict[str, Any]]:
    """``messages`` with the tools' description at the end of the leading system message
    (one is added where there is none)."""
    prompt = tools_prompt(tools, single_call)
    if messages and messages[0].get("role") in ("system", "developer") and isinstance(messages[0].get("content"), str):
        first = messages[0]
        return [{**first, "content": (first["content"] + "\n\n" + prompt) if first["content"] else prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def answer_schema(tools: list[dict[str, Any]], single_call: bool) -> dict[str, Any]:
    """The JSON schema the answer is held to: the calls (each one of the tools with its
    parameters, as a forced call is) or a response."""
    call = forced_call_schema(tools, "required")
    assert call is not None
    definitions = {key: call.pop(key) for key in ("$defs", "definitions") if key in call}  # they resolve from the root
    calls = {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if single_call else {})}
    return {"type": "object", "anyOf": [{"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"]},
                      {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}],
            **definitions}


class GenericAnswerScanner:
    """One choice's answer object, split into content (the ``response`` string, decoded)
    and calls as it arrives (``feed``, then ``finish``). Text that does not begin as one
    of the two objects (a constraint the answer was not held to) is content as written."""

    def __init__(self) -> None:
        self._pending = ""  # before the key is read: the text so far; in the response: undecoded text
        self._mode = ""  # "", "calls", "response", "done" (the response's string closed), "text"
        self._calls: MarkedCallScanner | None = None

    @property
    def calls(self) -> int:
        """Calls begun so far."""
        return 0 if self._calls is None else self._calls.calls

    def feed(self, text: str) -> list[Piece]:
        if self._mode == "calls":
            assert self._calls is not None
            return self._calls.feed(text)
        if self._mode == "done":
            return []  # the object's closing brace
        self._pending += text
        if self._mode == "text":
            return self._text()
        if self._mode == "response":
            return self._response()
        head = _HEAD.match(self._pending)
        if head is None:
            if not "{".startswith(self._pending.lstrip()[:1]) or self._pending.count('"') > 2:
                self._mode = "text"
                return self._text()
            return []
        rest = self._pending[head.end():]
        if head.group(1) == "tool_calls":
            self._mode, self._pending, self._calls = "calls", "", MarkedCallScanner(mark=_MARK)
            return self._calls.feed(_MARK + rest)
        if not rest:
            return []
        if rest[0] != '"':
            self._mode = "text"
            return self._text()
        self._mode, self._pending = "response", rest[1:]
        return self._response()

    def finish(self) -> list[Piece]:
        """The rest at the choice's end: a cut-short call as far as it went, or text held.
        An answer cut before it said anything (inside the object's opening, or inside the
        calls' list before a call's arguments began) has no content: that text is the form
        the answer was held to, never words for the client."""
        if self._mode == "calls":
            assert self._calls is not None
            # The list's own text (the object's closing brace, a call cut before its
            # arguments, the inner scanner's mark when no call began) is not content.
            return [piece for piece in self._calls.finish() if piece.call is not None]
        if self._mode == "" and any(head.startswith(re.sub(r"\s+", "", self._pending)) for head in _HEADS):
            self._pending = ""
            return []
        if self._mode in ("", "text"):
            text, self._pending = self._pending, ""
            return [Piece(text=text)] if text else []
        if self._mode == "response":  # cut short inside the string: what decodes of it
            return self._response()
        return []

    def _text(self) -> list[Piece]:
        text, self._pending = self._pending, ""
        return [Piece(text=text)] if text else []

    def _response(self) -> list[Piece]:
        """The response string's characters written so far, decoded; an escape not yet
        whole (``\\``, ``\\u00``, a surrogate pair's first half) is held back."""
        out, at, raw = [], 0, self._pending
        while at < len(raw):
            char = raw[at]
            if char == '"':
                self._mode = "done"
                at = len(raw)
                break
            if char != "\\":
                end = at
                while end < len(raw) and raw[end] not in '"\\':
                    end += 1
                out.append(raw[at:end])
                at = end
                continue
            size = _escape_size(raw, at)
            if size is None:
                break
            try:
                out.append(json.loads('"' + raw[at:at + size] + '"'))
            except ValueError:  # not an escape JSON has (text no constraint held): as written
                out.append(raw[at:at + size])
            at += size
        self._pending = raw[at:]
        text = "".join(out)
        return [Piece(text=text)] if text else []


def _escape_size(raw: str, at: int) -> int | None:
    """The length of the escape at ``raw[at]`` (a backslash), or None while it is not whole."""
    if at + 1 >= len(raw):
        return None
    if raw[at + 1] != "u":
        return 2
    if at + 6 > len(raw):
        return None
    digits = raw[at + 2:at + 6]
    if all(c in "0123456789abcdefABCDEF" for c in digits) and 0xD800 <= int(digits, 16) < 0xDC00:  # a surrogate pair's first half: the second follows
        return 12 if at + 12 <= len(raw) else None
    return 6
