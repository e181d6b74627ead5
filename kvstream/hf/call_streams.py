"""One tool call's body, turned into ``tool_calls`` deltas while the model is still writing it.

A client streaming an answer sees a call the way OpenAI (and vLLM) stream one: a first delta
with the call's index, id and function name once the call is certain, then its ``arguments``
in pieces as they are written, all of them joined being the call's arguments. An agent that
shows a file being written through a tool call sees it grow instead of waiting for the
whole call; a non-streamed answer joins the same pieces.

Used for the calls in ``<tool_call>`` tags (and DeepSeek's, Mistral's...), Llama 3's bare
JSON call and forced calls.
What has been sent cannot be taken back, so only what is certain goes out: a JSON call's
arguments are streamed once ``{"name": ..., "arguments": {`` has been read (the text of the
object as the model writes it, to its closing brace); an XML call's (xml_calls.py) once
``<function=name>`` and its first parameter's tag (or its end) have, its arguments rebuilt
as JSON parameter by parameter, a string value's text as it comes. A body that never began as a call comes back as text; one that
began as a call and then stops reading as one stands as far as its arguments went (as a
call cut short by ``max_tokens`` does), streamed or not.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from kvstream.hf.tool_calls import call_id

# A JSON call whose name is read and whose arguments have begun ("parameters": Llama 3's name).
_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class Piece:
    """What a scanner releases: content text, thinking, or one call (a ``tool_calls`` entry,
    or a delta of one)."""

    text: str = ""
    call: dict[str, Any] | None = None
    reasoning: bool = False  # thinking, not content (reasoning.py)


def call_entry(name: str, arguments: Any, index: int) -> dict[str, Any]:
    """A whole ``tool_calls`` entry; ``arguments`` as given when a string, else as JSON."""
    return {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": _text(arguments)}}


def json_call(body: str) -> dict[str, Any] | None:
    """The call a JSON text holds, ``{"name": ..., "arguments" | "parameters": ...}``; None
    if it holds none."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    return call if isinstance(call, dict) and isinstance(call.get("name"), str) else None


def call_arguments(call: dict[str, Any]) -> str:
    """A JSON call's arguments as the ``arguments`` string (Llama 3 names them "parameters")."""
    return _text(call.get("arguments", call.get("parameters", {})))


def _text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


@dataclass
class CallStream(ABC):
    """One call's deltas as its body grows: ``feed`` the body so far, then ``close`` it (its
    end tag read) or ``cut`` it (the answer ended inside it). Subclasses say what is certain:
    ``_progress`` (the name and a prefix of the final arguments) and ``_whole``."""

    index: int
    _header_sent: bool = False
    _arguments_sent: str = ""

    @property
    def started(self) -> bool:
        """Whether any of this call went out (it can no longer become text)."""
        return self._header_sent

    def feed(self, body: str) -> list[dict[str, Any]]:
        """The deltas the body so far makes certain."""
        progress = self._progress(body)
        return [] if progress is None else self._advance(*progress)

    def close(self, body: str) -> list[dict[str, Any]] | None:
        """The call's last deltas, its whole body read; None when it holds no call (the
        caller gives the text back). A body that began as a call and then stopped reading
        as one is the call as far as it went, whether or not any of it went out yet, so
        that a streamed answer and a whole one agree."""
        return self._complete(body, self._whole(body, cut=False))

    def cut(self, body: str) -> list[dict[str, Any]] | None:
        """As ``close``, for a body the answer ended inside: its arguments as far as they went."""
        return self._complete(body, self._whole(body, cut=True))

    def _complete(self, body: str, whole: tuple[str, str] | None) -> list[dict[str, Any]] | None:
        if whole is None:
            whole = self._progress(body)
            if whole is None:
                return [] if self._header_sent else None
        return self._advance(*whole)

    def _advance(self, name: str, arguments: str) -> list[dict[str, Any]]:
        """A delta for what ``arguments`` adds to what went out (the header with it, the first time)."""
        if not self._header_sent:
            self._header_sent, self._arguments_sent = True, arguments
            return [{"index": self.index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}]
        if len(arguments) <= len(self._arguments_sent) or not arguments.startswith(self._arguments_sent):
            return []  # nothing new (or a body that stopped reading as it began: what went out stands)
        piece, self._arguments_sent = arguments[len(self._arguments_sent):], arguments
        return [{"index": self.index, "function": {"arguments": piece}}]

    @abstractmethod
    def _progress(self, body: str) -> tuple[str, str] | None:
        """The name and the part of the final arguments that the body so far makes certain;
        None while nothing is."""

    @abstractmethod
    def _whole(self, body: str, cut: bool) -> tuple[str, str] | None:
        """The name and the final arguments of a whole body (``cut``: one the answer ended
        inside); None when it holds no call."""


@dataclass
class JsonFollower:
    """Where a JSON object or list that begins at ``start`` of a growing text ends, followed
    as the text grows (nesting, strings and escapes): each character is looked at once."""

    start: int
    end: int | None = None  # just past its closing bracket, once read
    in_string: bool = False  # the text so far ends inside a string
    _at: int = -1  # characters followed so far (-1: none)
    _depth: int = 0
    _escaped: bool = False

    def follow(self, text: str) -> int | None:
        """Follow ``text`` (the same text, grown) from where the last call stopped; the end, once read."""
        at = self.start if self._at < 0 else self._at
        while self.end is None and at < len(text):
            char = text[at]
            at += 1
            if self.in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end = at
        self._at = at
        return self.end

    def value(self, text: str) -> str:
        """The value's text as far as it went."""
        return text[self.start:self.end or len(text)]


@dataclass
class JsonCallStream(CallStream):
    """A call written as JSON, ``{"name": ..., "arguments": {...}}`` (Hermes' tags, and the
    JSON form in Qwen3-Coder's): the arguments object's text goes out as written, to its
    closing brace."""

    _name: str = ""
    _value: JsonFollower | None = None  # the arguments object, once it began

    def _progress(self, body: str) -> tuple[str, str] | None:
        if self._value is None and not self._find_arguments(body):
            return None
        self._value.follow(body)  # type: ignore[union-attr]
        return self._name, self._value.value(body)  # type: ignore[union-attr]

    def _begin(self, name: str, start: int) -> None:
        """The call's name is read and its arguments object begins at ``start`` of the body."""
        self._name, self._value = name, JsonFollower(start)

    def _find_arguments(self, body: str) -> bool:
        head = _JSON_HEAD.match(body)
        if head is None or not body[head.end():].startswith("{"):
            return False  # arguments not begun, or not an object (a string...): read whole at the end
        self._begin(json.loads(head.group(1)), head.end())
        return True

    def _whole(self, body: str, cut: bool) -> tuple[str, str] | None:
        if cut:
            if self._value is None and not self._find_arguments(body):
                return _cut_json_call(body)
            self._value.follow(body)  # type: ignore[union-attr]  # (the object may have closed: what follows it is not arguments)
            return self._name, self._value.value(body)  # type: ignore[union-attr]
        call = json_call(body)
        if call is None:
            return None
        if (self._value is not None or self._find_arguments(body)) and self._value.follow(body) is not None:  # type: ignore[union-attr]
            return call["name"], self._value.value(body)  # type: ignore[union-attr]  # the object as written, as it streamed
        return call["name"], call_arguments(call)


@dataclass
class ArgumentsCallStream(JsonCallStream):
    """A call whose name is known before a word of it is written (a forced call naming its
    function): the body is its arguments object alone, and the header goes out with the
    first token."""

    name: str = ""

    def _progress(self, body: str) -> tuple[str, str] | None:
        if self._value is None:
            bare = body.lstrip()
            if not bare.startswith("{"):
                return self.name, ""
            self._begin(self.name, len(body) - len(bare))
        self._value.follow(body)  # type: ignore[union-attr]
        return self.name, self._value.value(body)  # type: ignore[union-attr]

    def _whole(self, body: str, cut: bool) -> tuple[str, str] | None:
        return self._progress(body)


@dataclass
class SeparatedCallStream(JsonCallStream):
    """A call whose name comes before a ``separator`` and whose arguments object follows it,
    ``name<separator>{...}`` (Mistral's ``[ARGS]``, DeepSeek-V3.1's ``<｜tool▁sep｜>``); a
    body whose arguments never begin as an object holds no call."""

    separator: str = ""

    def _find_arguments(self, body: str) -> bool:
        name, separator, rest = body.partition(self.separator)
        bare = rest.lstrip()
        if not separator or not name.strip() or not bare.startswith("{"):
            return False
        self._begin(name.strip(), len(body) - len(bare))
        return True

    def _whole(self, body: str, cut: bool) -> tuple[str, str] | None:
        if self._value is None and not self._find_arguments(body):
            return None
        if self._value.follow(body) is not None or cut:  # type: ignore[union-attr]
            return self._name, self._value.value(body)  # type: ignore[union-attr]
        return self._name, self._value.value(body).rstrip()  # type: ignore[union-attr]  # never closed: as far as it went


def _cut_json_call(body: str) -> tuple[str, str] | None:
    """A JSON call cut short whose arguments never began as an object: its name and what
    follows it, or the whole call if it parses; None if not even the name is there."""
    call = json_call(body)
    if call is not None and ("arguments" in call or "parameters" in call):
        return call["name"], call_arguments(call)
    head = _JSON_HEAD.match(body)
    return None if head is None else (json.loads(head.group(1)), body[head.end():])
