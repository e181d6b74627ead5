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
back as the text it was.

Llama 3.1 and later answer a call with the whole message a JSON object, ``{"name": ...,
"parameters": {...}}`` (several joined by ``;``), as their templates ask ("Respond in the
format {"name": function name, "parameters": ..."): an answer that opens with ``{`` is a call
once its name and the start of its parameters are read (they then stream, and so does each
call joined after it), text if it never begins as one (vLLM's ``llama3_json``).

Mistral's models mark their calls with ``[TOOL_CALLS]`` (a control token, put back from its id
by answer_reading.py), followed by a JSON list of ``{"name", "arguments"}`` (v0.3's tokenizer)
or by ``name[ARGS]{...}``, one per mark (later ones); Granite 3.x's with ``<|tool_call|>`` and
a JSON list (its templates: "respond with <|tool_call|> followed by a JSON list of tools
used"). The text before the mark is content; each call after it streams.

Qwen3-Coder's templates (and Qwen3.5's) show the same tags around an XML body,
``<function=name><parameter=key>value</parameter></function>`` (xml_calls.py reads it, typed
by the tool's schema); a bare ``<function=...>`` without them is a call too. DeepSeek's
(V3, R1 and its distillations, V3.1) sit between ``<｜tool▁call▁begin｜>`` tags inside
``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>`` (deepseek_calls.py reads them). The
"pythonic" templates (Llama 3.2 and 4's, Gemma 3's) ask for a Python list of calls
(pythonic_calls.py). Other formats are not read: text.

While a tagged call is written, it streams out (call_streams.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstream.hf import deepseek_calls, pythonic_calls
from kvstream.hf.call_streams import (
    CallStream,
    JsonCallStream,
    JsonFollower,
    Piece,
    SeparatedCallStream,
)
from kvstream.hf.xml_calls import FUNCTION_END, FUNCTION_TAG, PARAMETER_TAG, XmlCallStream, parameter_schemas

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
MISTRAL_CALLS = "[TOOL_CALLS]"
GRANITE_CALLS = "<|tool_call|>"  # Granite 3.x: followed by a JSON list, as Mistral v0.3's mark
MISTRAL_ARGS = "[ARGS]"
# What Llama 3's templates tell the model (3.1, 3.2 and 3.3 alike), and the tag it may open with.
LLAMA3_FORMAT = 'Respond in the format {"name": function name, "parameters"'
PYTHON_TAG = "<|python_tag|>"
# The syntaxes read, in the order a template is matched against them (call_syntax).
# ("generic": tools described in the system message, the answer held to a call or a
# response object; generic_calls.py, chosen by the backend for a template that shows none.)
SYNTAXES = ("qwen3_xml", "hermes", "pythonic", "llama3_json", "mistral", "granite", "deepseek", "generic")


def call_syntax(chat_template: Any) -> str | None:
    """The syntax the chat template (a string, or a tokenizer's named templates) shows the
    model for its calls: ``"hermes"`` (JSON in ``<tool_call>`` tags), ``"qwen3_xml"`` (XML in
    them), ``"llama3_json"``, ``"mistral"`` (``[TOOL_CALLS]``), ``"granite"``
    (``<|tool_call|>``), ``"deepseek"``, ``"pythonic"`` (a Python list of calls); None when
    the model's calls are not read."""
    templates = [t for t in (chat_template.values() if isinstance(chat_template, dict) else [chat_template])
                 if isinstance(t, str)]
    if any(OPEN in t and FUNCTION_TAG in t and PARAMETER_TAG in t for t in templates):
        return "qwen3_xml"
    if any(OPEN in t for t in templates):
        return "hermes"
    if any(pythonic_calls.FORMAT_HINT in t for t in templates):
        return "pythonic"
    if any(LLAMA3_FORMAT in t for t in templates):
        return "llama3_json"
    if any(MISTRAL_CALLS in t for t in templates):
        return "mistral"
    if any(GRANITE_CALLS in t for t in templates):
        return "granite"
    if any(deepseek_calls.CALLS_BEGIN in t for t in templates):
        return "deepseek"
    return None


@dataclass(frozen=True)
class CallReading:
    """How one request's answers are read for calls: the syntax, whether only the first
    call counts (``parallel_tool_calls: false``), and the tools' parameter schemas (the XML
    syntax's values are typed by them)."""

    syntax: str
    single_call: bool = False
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)

    def scanner(self) -> ToolCallScanner | JsonCallScanner | MarkedCallScanner | pythonic_calls.PythonicCallScanner:
        """A fresh scanner for one choice's text."""
        if self.syntax == "pythonic":
            return pythonic_calls.PythonicCallScanner()
        if self.syntax == "hermes":
            return ToolCallScanner()
        if self.syntax == "qwen3_xml":
            return ToolCallScanner(new_call=functools.partial(XmlCallStream, schemas=self.schemas), tags=QWEN3_XML_TAGS)
        if self.syntax == "granite":
            return MarkedCallScanner(mark=GRANITE_CALLS)
        if self.syntax == "deepseek":
            return ToolCallScanner(new_call=deepseek_calls.DeepSeekCallStream, tags=DEEPSEEK_TAGS, marks=DEEPSEEK_MARKS)
        return MarkedCallScanner() if self.syntax == "mistral" else JsonCallScanner()


def call_reading(tokenizer: Any, extra: dict[str, Any], syntax: str = "auto") -> CallReading | None:
    """How a chat request offering ``extra["tools"]`` has its answers read; None when they
    are not (no tools, a call forced or refused by ``tool_choice``, no syntax we read).
    ``syntax``: one of SYNTAXES, or ``"auto"`` (the one the chat template shows), or
    ``"none"`` (calls are not read)."""
    if not extra.get("tools") or extra.get("tool_choice") not in (None, "auto") or syntax == "none":
        return None
    if syntax == "auto":
        syntax = call_syntax(getattr(tokenizer, "chat_template", None))
    if syntax is None:
        return None
    return CallReading(syntax, single_call=extra.get("parallel_tool_calls") is False,
                       schemas=parameter_schemas(extra["tools"]) if syntax == "qwen3_xml" else {})


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


def calls_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages for a template that cannot render an assistant's ``tool_calls`` (one
    written for chat only): each call written into the message's text as the JSON object
    ``{"tool_calls": [{"name", "arguments"}]}`` (the form llama.cpp's template polyfills
    use), and a missing ``content`` as empty text, which such templates concatenate."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list) and calls:
            written = [{"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}
                       for c in (_object_arguments(call) for call in calls) if isinstance(c, dict)]
            text = message.get("content") if isinstance(message.get("content"), str) else ""
            joined = "\n".join(part for part in (text, json.dumps({"tool_calls": written}, ensure_ascii=False)) if part)
            message = {key: value for key, value in message.items() if key != "tool_calls"} | {"content": joined}
        elif message.get("content") is None:
            message = {**message, "content": ""}
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


@dataclass
class _CallPieces:
    """What a scanner has to release: pieces in order, and how many calls it began."""

    calls: int = 0  # calls begun so far
    _pieces: list[Piece] = field(default_factory=list)

    def _send(self, deltas: list[dict[str, Any]]) -> None:
        """A call's deltas out; its first (the one with its id) counts the call."""
        for delta in deltas:
            self.calls += "id" in delta
            self._pieces.append(Piece(call=delta))

    def _take(self) -> list[Piece]:
        pieces, self._pieces = self._pieces, []
        return pieces


@dataclass(frozen=True)
class CallTags:
    """The tags around a call; ``in_body``: they are part of the body the call stream reads
    (a Qwen3-Coder ``<function=...>...</function>`` written without its ``<tool_call>``)."""

    open: str
    close: str
    in_body: bool = False

    def wrapped(self, body: str) -> str:
        """The text the tags and body were."""
        return body if self.in_body else self.open + body + self.close


HERMES_TAGS = (CallTags(OPEN, CLOSE),)
# vLLM's qwen3_coder parser reads a bare <function=...> too: Qwen3-Coder writes one at times.
QWEN3_XML_TAGS = (CallTags(OPEN, CLOSE), CallTags(FUNCTION_TAG, FUNCTION_END, in_body=True))
DEEPSEEK_TAGS = (CallTags(deepseek_calls.CALL_BEGIN, deepseek_calls.CALL_END),)
DEEPSEEK_MARKS = (deepseek_calls.CALLS_BEGIN, deepseek_calls.CALLS_END)  # around the calls: layout


@dataclass
class ToolCallScanner(_CallPieces):
    """One choice's text, split into content and calls as it arrives (``feed``, then
    ``finish`` at the end of the choice). Each tagged body goes to a ``new_call`` stream
    (call_streams.py: JSON by default), which streams the call out as it is written.
    ``marks``: tags around a group of calls (DeepSeek's), neither content nor a call: dropped
    next to a call, as whitespace is."""

    new_call: Callable[[int], CallStream] = JsonCallStream
    tags: tuple[CallTags, ...] = HERMES_TAGS
    marks: tuple[str, ...] = ()
    _pending: str = ""  # text not released yet: a possible tag start, whitespace, or a call's body
    _call: CallStream | None = None  # the call whose body is being read
    _in: CallTags = HERMES_TAGS[0]  # the tags around it
    _close_from: int = 0  # its close tag is not in the body before here
    _layout: str = ""  # the whitespace before the open tag: content again if the tag holds no call
    _after_call: bool = False  # a call was the last thing released: whitespace next is layout

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        while True:
            if self._call is not None:
                close = self._in.close
                end = self._pending.find(close, self._close_from)
                if end < 0:  # the body so far, less what may begin the close tag
                    self._close_from = max(0, len(self._pending) - len(close) + 1)
                    self._send(self._call.feed(self._pending[: len(self._pending) - _prefix_length(self._pending, close)]))
                    break
                end += len(close) if self._in.in_body else 0
                body, self._pending = self._pending[:end], self._pending[end + (0 if self._in.in_body else len(close)):]
                call, self._call = self._call, None
                deltas = call.close(body)
                if deltas is None:
                    self._release(self._layout + self._in.wrapped(body))
                else:
                    self._send(deltas)
                    self._after_call = True
                continue
            found = [(at, tags) for tags in self.tags if (at := self._pending.find(tags.open)) >= 0]
            if found:
                start, self._in = min(found, key=lambda item: item[0])
                content = _strip_layout(self._pending[:start], self.marks, end=True)  # (layout, not content)
                self._release(content)
                self._layout = self._pending[len(content):start]
                self._pending = self._pending[start + (0 if self._in.in_body else len(self._in.open)):]
                self._call, self._close_from = self.new_call(self.calls), 0
                continue
            # Hold back what could still become a tag, and whitespace and marks (around calls
            # they are not content).
            keep = max(_tag_prefix_length(self._pending, tag) for tag in (*(tags.open for tags in self.tags), *self.marks))
            keep = len(self._pending) - len(_strip_layout(self._pending[: len(self._pending) - keep], self.marks, end=True))
            head, tail = self._pending[: len(self._pending) - keep], self._pending[len(self._pending) - keep:]
            if head.strip():
                self._release(head)
                self._pending = tail
            break
        return self._take()

    def finish(self) -> list[Piece]:
        """The rest at the choice's end: a call cut short (max_tokens) as far as its
        arguments went, or the text held back."""
        if self._call is not None:
            deltas = self._call.cut(self._pending)
            if deltas is not None:
                self._send(deltas)
            else:
                self._release(self._layout + ("" if self._in.in_body else self._in.open) + self._pending)
        elif self._pending.strip() or not self.calls:  # (whitespace after a call is layout)
            self._release(self._pending)
        self._pending, self._call = "", None
        return self._take()

    def _release(self, text: str) -> None:
        if self._after_call:
            text = _strip_layout(text, self.marks)
        if not text:
            return
        self._after_call = False
        if self._pieces and self._pieces[-1].call is None:
            self._pieces[-1].text += text
        else:
            self._pieces.append(Piece(text=text))


def _strip_layout(text: str, marks: tuple[str, ...], end: bool = False) -> str:
    """``text`` less the whitespace and ``marks`` at its start (``end``: at its end)."""
    while True:
        stripped = text.rstrip() if end else text.lstrip()
        for mark in marks:
            stripped = stripped.removesuffix(mark) if end else stripped.removeprefix(mark)
        if stripped == text:
            return text
        text = stripped


def _tag_prefix_length(text: str, tag: str = OPEN) -> int:
    """How many characters at the end of ``text`` could begin ``tag``, with the whitespace
    before them (held back, as a call may follow)."""
    keep = _prefix_length(text, tag)
    head = text[: len(text) - keep]
    return keep + len(head) - len(head.rstrip())


def _prefix_length(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class JsonCallScanner(_CallPieces):
    """One choice's text, where a call is the whole answer as JSON (Llama 3): text that opens
    otherwise streams as it comes; an answer opening with ``{`` is a call once its name and
    the start of its parameters are read, and each call's arguments stream as written
    (call_streams.py), calls joined by ``;`` one after another. An object that is not a call
    where a later call should be, and what follows the calls, are content; an answer whose
    first object is not a call is its text."""

    _pending: str = ""
    _mode: str | None = None  # "text" or "json", once the answer's first character says
    _at: int = 0  # json: where the call being read (or the next) begins in the text
    _done: bool = False  # json: no call can follow (the rest is content)
    _stream: JsonCallStream | None = None  # the call being read
    _object: JsonFollower | None = None  # where its object ends
    # The first call, when it became certain only as its object closed (its parameters no
    # object, so nothing of it streamed): a call if calls or nothing follow it, else the
    # answer is text, prose after it included.
    _held: list[dict[str, Any]] | None = None

    def feed(self, text: str) -> list[Piece]:
        if self._mode == "text":
            return [Piece(text=text)] if text else []
        self._pending += text
        if self._mode is None:
            start = self._pending.lstrip().removeprefix(PYTHON_TAG).lstrip()
            if not start or PYTHON_TAG.startswith(self._pending.lstrip()):
                return []  # nothing yet says which
            self._mode = "json" if start.startswith("{") else "text"
            if self._mode == "text":
                text, self._pending = self._pending, ""
                return [Piece(text=text)]
            self._at = len(self._pending) - len(start)
        self._read_calls(end=False)
        return self._take()

    def finish(self) -> list[Piece]:
        text = self._pending
        if self._mode != "json":
            self._pending = ""
            return [Piece(text=text)] if text else []
        self._read_calls(end=True)
        self._pending = ""
        rest = text[self._at:].lstrip(" \t\r\n;")
        if self._held is not None and not rest:
            self._send(self._held)
        if not self.calls:  # the first object is no call: the answer is its text
            self._pieces.clear()
            return [Piece(text=text)]
        return self._take() + ([Piece(text=rest)] if rest else [])

    def _read_calls(self, end: bool) -> None:
        """Every call the text holds so far (``end``: the text is whole)."""
        while not self._done and self._read_call(end):
            continue

    def _read_call(self, end: bool) -> bool:
        """The next call, as far as the text goes (``end``: all of it); whether to go on."""
        text = self._pending
        if self._stream is None:
            at = self._at
            while at < len(text) and text[at] in " \t\r\n;":
                at += 1
            if at == len(text):
                self._done = end
                return False
            if text[at] != "{":
                self._done = True  # not a call where one should be: the rest is content
                return False
            if self._held is not None:  # another call follows the first: it was one
                self._send(self._held)
                self._held = None
            self._at, self._stream, self._object = at, JsonCallStream(self.calls), JsonFollower(at)
        closed = self._object.follow(text)  # type: ignore[union-attr]
        body = text[self._at:closed or len(text)]
        if closed is None or not self._stream.started:  # (a whole object in one piece: as far as it streams)
            self._send(self._stream.feed(body))
        if closed is None and not end:
            return False
        streamed = self._stream.started  # its parameters began as an object
        deltas = self._stream.close(body) if closed is not None else self._stream.cut(body)
        self._stream = None
        if deltas is None:  # an object that is not a call: it and the rest are content
            self._done = True
            return False
        if streamed or self.calls:
            self._send(deltas)
        else:
            self._held = deltas
        self._at = closed if closed is not None else len(text)
        return True


@dataclass
class MarkedCallScanner(_CallPieces):
    """One choice's text, where calls follow a ``mark`` (Mistral's ``[TOOL_CALLS]``,
    Granite's ``<|tool_call|>``): the text before it streams as content; after it, each call
    streams as it is written (call_streams.py), whether the mark is followed by a JSON list
    of ``{"name", "arguments"}`` objects or by ``name[ARGS]{...}`` (one call per mark). What
    follows the calls, or text where the next call should be, is content; an answer whose
    first call never begins is its text."""

    mark: str = MISTRAL_CALLS
    _pending: str = ""  # before the mark: text held back; after it: the text after the first mark
    _in_calls: bool = False
    _form: str = ""  # after the mark: "list" or "args" once its first character says, "done" after the calls
    _at: int = 0  # in _pending: where the call being read (or the next) begins
    _call: JsonCallStream | None = None  # the call being read
    _element: JsonFollower | None = None  # list form: the call object being read

    def feed(self, text: str) -> list[Piece]:
        self._pending += text
        if not self._in_calls:
            start = self._pending.find(self.mark)
            if start < 0:
                keep = _tag_prefix_length(self._pending, self.mark)
                head = self._pending[: len(self._pending) - keep]
                if not head.strip():
                    return []
                self._pending = self._pending[len(head):]
                return [Piece(text=head)]
            content = self._pending[:start].rstrip()
            self._pending, self._in_calls = self._pending[start + len(self.mark):], True
            if content:
                self._pieces.append(Piece(text=content))
        self._read(end=False)
        return self._take()

    def finish(self) -> list[Piece]:
        if not self._in_calls:
            text, self._pending = self._pending, ""
            return [Piece(text=text)] if text else []
        self._read(end=True)
        if not self.calls:  # no call began: the text as it was
            self._pieces.append(Piece(text=self.mark + self._pending))
        self._pending = ""
        return self._take()

    def _read(self, end: bool) -> None:
        """Stream the calls in the text after the mark as far as it goes (``end``: all of it)."""
        text = self._pending
        if not self._form:
            head = text.lstrip()
            if not head:
                return
            self._form = "list" if head.startswith("[") else "args"
            self._at = len(text) - len(head) + (self._form == "list")
        while self._form != "done":
            if self._form == "list":
                more = self._read_element(text, end)
            else:
                more = self._read_marked(text, end)
            if not more:
                return
        if end and text[self._at:].strip() and self.calls:  # what follows the calls
            self._pieces.append(Piece(text=text[self._at:].strip()))

    def _read_element(self, text: str, end: bool) -> bool:
        """List form: the next call object; whether to go on."""
        if self._call is None:
            at = self._at
            while at < len(text) and text[at] in " \t\r\n,":
                at += 1
            if at == len(text):
                return False
            self._at = at
            if text[at] == "]":
                self._form, self._at = "done", at + 1
                return True
            if text[at] != "{":
                self._form = "done"  # not a call where one should be: the rest is content
                return True
            self._call, self._element = JsonCallStream(self.calls), JsonFollower(at)
        closed = self._element.follow(text)  # type: ignore[union-attr]
        body = text[self._at:closed or len(text)]
        if closed is None and not end:
            self._send(self._call.feed(body))
            return False
        deltas = self._call.close(body) if closed is not None else self._call.cut(body)
        self._call = None
        if deltas is None:  # an object that is not a call: it and the rest are content
            self._form = "done"
            return True
        self._send(deltas)
        self._at = closed if closed is not None else len(text)
        return True

    def _read_marked(self, text: str, end: bool) -> bool:
        """``name[ARGS]{...}`` form: the call up to the next mark (or the end); whether to go on."""
        if self._call is None:
            self._call = SeparatedCallStream(self.calls, separator=MISTRAL_ARGS)
        after = text.find(self.mark, self._at)
        if after < 0 and not end:
            self._send(self._call.feed(text[self._at: len(text) - _prefix_length(text, self.mark)]))
            return False
        body = text[self._at:] if after < 0 else text[self._at:after]
        deltas = self._call.close(body) if after >= 0 else self._call.cut(body)
        self._call = None
        if deltas is None:
            self._form = "done"
            return True
        self._send(deltas)
        self._at = len(text) if after < 0 else after + len(self.mark)
        self._form = "done" if after < 0 else "args"
        return True
