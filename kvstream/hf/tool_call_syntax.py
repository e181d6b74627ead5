"""A model's own tool calls (``tool_choice: "auto"``), read out of its text as it streams.

Models trained on the Hermes function-calling format (Qwen2.5 and Qwen3, the Hermes models,
SmolLM3 and others) write each call as::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and their chat templates show them the format in those tags. When a model's template does,
its answers are scanned as they stream: the text outside the tags is the message's content,
each tagged call becomes an OpenAI ``tool_calls`` entry (``finish_reason: "tool_calls"``),
as vLLM's ``hermes`` parser serves them. Text that might begin a tag is held back until it
does or cannot; whitespace around calls is not content. A tag whose body is not a call comes
back as the text it was. Other formats (Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]``)
are not read: their calls come back as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvstream.hf.tool_calls import call_id, tool_call_delta

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def call_syntax(chat_template: Any) -> str | None:
    """``"hermes"`` when the chat template (a string, or a tokenizer's named templates) shows
    the model ``<tool_call>`` tags; None when the model's calls are not read."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return "hermes" if any(isinstance(t, str) and OPEN in t for t in templates) else None


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as chat templates expect them: OpenAI sends an earlier call's
    ``arguments`` as a JSON string, templates render them as an object (as vLLM passes them)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            message = {**message, "tool_calls": [_object_arguments(call) for call in calls]}
        out.append(message)
    return out


def _object_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # not JSON: the template gets what the client sent
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _call(body: str, index: int) -> dict[str, Any] | None:
    """The tool_calls entry a tag's body holds; None if it holds no call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"index": index, "id": call_id(), "type": "function", "function": {"name": call["name"], "arguments": arguments}}


@dataclass
class Piece:
    """What the scanner releases: content text, or one call (a ``tool_calls`` entry)."""

    text: str = ""
    call: dict[str, Any] | None = None


@dataclass
class ToolCallScanner:
    """One choice's text, split into content and calls as it arrives (``feed``, then
    ``finish`` at the end of the choice)."""

    calls: int = 0  # calls released so far
    _pending: str = ""  # text not released yet: a possible tag start, whitespace, or a call's body
    _in_call: bool = False
    _layout: str = ""  # the whitespace before the open tag: content again if the tag holds no call
    _after_call: bool = False  # a call was the last thing released: whitespace next is layout
    _pieces: list[Piece] = field(default_factory=list)

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                self._in_call = False
                call = _call(body, self.calls)
                if call is None:
                    self._release(self._layout + OPEN + body + CLOSE)
                else:
                    self._pieces.append(Piece(call=call))
                    self.calls += 1
                    self._after_call = True
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                content = self._pending[:start].rstrip()  # whitespace before a call is layout, not content
                self._release(content)
                self._layout = self._pending[len(content):start]
                self._pending = self._pending[start + len(OPEN):]
                self._in_call = True
                continue
            # Hold back what could still become a tag, and whitespace (around calls it is not content).
            keep = _tag_prefix_length(self._pending)
            head, tail = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep:]
            if head.strip():
                self._release(head)
                self._pending = tail
            break
        return self._take()

    def finish(self) -> list[Piece]:
        """The rest at the choice's end: a call cut short (max_tokens) as far as its
        arguments went, or the text held back."""
        if self._in_call:
            delta = tool_call_delta(self._pending)
            if delta is not None:
                entry = delta["tool_calls"][0]
                entry["index"] = self.calls
                self._pieces.append(Piece(call=entry))
                self.calls += 1
            else:
                self._release(self._layout + OPEN + self._pending)
        elif self._pending.strip() or not self.calls:  # (whitespace after a call is layout)
            self._release(self._pending)
        self._pending, self._in_call = "", False
        return self._take()

    def _release(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
        if not text:
            return
        self._after_call = False
        if self._pieces and self._pieces[-1].call is None:
            self._pieces[-1].text += text
        else:
            self._pieces.append(Piece(text=text))

    def _take(self) -> list[Piece]:
        pieces, self._pieces = self._pieces, []
        return pieces


def _tag_prefix_length(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``, with the
    whitespace before them (held back, as a call may follow)."""
    keep = 0
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            keep = n
            break
    head = text[: len(text) - keep]
    return keep + len(head) - len(head.rstrip())
