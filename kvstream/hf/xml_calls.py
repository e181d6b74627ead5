"""Tool calls in Qwen3-Coder's XML form (Qwen3-Coder, Qwen3.5 and the templates that copy
them): inside the ``<tool_call>`` tags the model writes::

    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>

Each parameter's value is raw text, so its JSON type comes from the tool's schema (as vLLM's
``qwen3_coder`` parser reads it): ``"3"`` is the integer 3 where the parameter is an
integer and the string "3" where it is a string; objects and arrays are JSON. A value that
does not read as its type, or a parameter the schema does not list, stays a string.
tool_call_syntax.py finds the tags; this module reads what is inside them into JSON
arguments, as they are written (``XmlCallStream``, call_streams.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvstream.hf.call_streams import CallStream, JsonCallStream

FUNCTION_TAG = "<function="
PARAMETER_TAG = "<parameter="
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER_HEAD = re.compile(r"\s*<parameter=([^>\n]+)>")
FUNCTION_END = "</function>"
PARAMETER_END = "</parameter>"


def parameter_schemas(tools: Any) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' schemas (``properties``), from a request's tools
    (OpenAI's and Ollama's shape alike); what is not a function with properties is skipped."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools if isinstance(tools, list) else ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        out[function["name"]] = properties if isinstance(properties, dict) else {}
    return out


@dataclass
class XmlCallStream(CallStream):
    """A call in the XML form; its arguments go out as JSON, ``{"key": value, ...}`` in the
    order written: each parameter once its close tag is read, and a string parameter's text
    as it comes (less what may be the start of its close tag). A JSON body in the same tags
    is read as one (models fall back on it). Each body character is looked at about once:
    a long value (a file's content) costs the same per token at its end as at its start."""

    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    _json: JsonCallStream | None = None  # the body is the JSON form
    _name: str | None = None
    _pairs: str = ""  # '"key": value, ...' of the parameters read whole
    _read_to: int = 0  # where they end in the body
    _open: tuple[str, int] | None = None  # the parameter being written: its key, where its value begins
    _searched_to: int = 0  # its close tag is not before here
    _open_sent: tuple[int, str] = (0, "")  # of its value: the raw end that went out, and that text escaped

    def _progress(self, body: str) -> tuple[str, str] | None:
        if self._use_json(body):
            return self._json._progress(body)  # type: ignore[union-attr]
        if not self._read(body):
            return None
        if self._open is None:
            # Nothing is certain of a call before its first parameter (or its end) is read.
            begun = self._pairs or body[self._read_to:].lstrip().startswith(FUNCTION_END)
            return (self._name, "{" + self._pairs) if begun else None  # type: ignore[return-value]
        key, start = self._open
        if value_kind(self._schema().get(key)) not in (None, "string"):
            return self._name, "{" + self._pairs  # type: ignore[return-value]  # (typed: goes out whole, once read)
        head = "{" + self._pairs + (", " if self._pairs else "") + json.dumps(key, ensure_ascii=False) + ': "'
        return self._name, head + self._escaped_so_far(body, start)  # type: ignore[return-value]

    def _whole(self, body: str, cut: bool) -> tuple[str, str] | None:
        if self._use_json(body):
            return self._json._whole(body, cut)  # type: ignore[union-attr]
        end = body.rfind(FUNCTION_END)
        if end >= 0 and body[end + len(FUNCTION_END):].strip():
            return None
        inner = body[:end] if end >= 0 else body  # a missing </function> is forgiven, as vLLM does
        if not self._read(inner):
            return None
        pairs = self._pairs
        if self._open is not None:
            if not (cut and end < 0):
                return None  # a parameter never closed
            key, start = self._open  # the value being written when the tokens ran out: its text so far
            pairs += (", " if pairs else "") + _pair(key, _without_cut_close(inner[start:].removeprefix("\n")))
        elif inner[self._read_to:].strip():
            return None
        return self._name, "{" + pairs + "}"  # type: ignore[return-value]

    def _use_json(self, body: str) -> bool:
        if self._json is None and body.lstrip().startswith("{"):
            self._json = JsonCallStream(self.index)
        return self._json is not None

    def _read(self, body: str) -> bool:
        """Read on from where the last call stopped: the function's name, then each
        parameter whose close tag has come; False until the name is read."""
        if self._name is None:
            head = _FUNCTION.match(body)
            if head is None:
                return False
            self._name, self._read_to = head.group(1).strip(), head.end()
        while True:
            if self._open is None:
                opened = _PARAMETER_HEAD.match(body, self._read_to)
                if opened is None:
                    return True
                self._open = opened.group(1).strip(), opened.end()
                self._searched_to = opened.end()
            key, start = self._open
            close = body.find(PARAMETER_END, self._searched_to)
            if close < 0:
                self._searched_to = max(start, len(body) - len(PARAMETER_END) + 1)
                return True
            value = typed_value(_unwrap(body[start:close]), self._schema().get(key))
            self._pairs += (", " if self._pairs else "") + _pair(key, value)
            self._read_to, self._open, self._open_sent = close + len(PARAMETER_END), None, (0, "")

    def _escaped_so_far(self, body: str, start: int) -> str:
        """The open string value as far as it is certain, JSON-escaped, only its new text
        escaped each time (less the newline after its open tag and what may begin its close)."""
        if start < len(body) and body[start] == "\n":
            start += 1
        tail = max(start, len(body) - len(PARAMETER_END) - 1)  # what may begin "\n</parameter>"
        end = tail + len(_without_cut_close(body[tail:]))
        sent_end, escaped = self._open_sent
        if end > max(sent_end, start):
            escaped += json.dumps(body[max(sent_end, start):end], ensure_ascii=False)[1:-1]
            self._open_sent = (end, escaped)
        return escaped

    def _schema(self) -> dict[str, Any]:
        return self.schemas.get(self._name or "", {})


def _pair(key: str, value: Any) -> str:
    return json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


def _unwrap(value: str) -> str:
    """A value as written between its tags, less the newline after the open tag and the one
    before the close tag (the layout the templates show)."""
    return value.removeprefix("\n").removesuffix("\n")


def _without_cut_close(value: str) -> str:
    """``value`` less the longest end of it that may begin its close tag (with the newline
    before it, or without)."""
    for n in range(min(len(PARAMETER_END) + 1, len(value)), 0, -1):
        end = value[-n:]
        if ("\n" + PARAMETER_END).startswith(end) or PARAMETER_END.startswith(end):
            return value[:-n]
    return value


def value_kind(schema: Any) -> str | None:
    """The JSON type a parameter's schema names (of ``["integer", "null"]``, the first
    that is not null); None when it names none."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: Python reads them, clients would not


def typed_value(text: str, schema: Any) -> Any:
    """``text`` as the JSON value its parameter ``schema`` asks for; the text itself when it
    does not read as that type or the schema names none."""
    kind = value_kind(schema)
    if kind is None or kind == "string":
        return text
    if text.strip().lower() == "null":
        return None
    if kind == "boolean":
        word = text.strip().lower()
        return word == "true" if word in ("true", "false") else text
    try:
        value = json.loads(text, parse_constant=_not_json)
    except ValueError:
        return text
    if kind == "integer":
        ok = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        return int(value) if ok and not isinstance(value, bool) else text
    if kind == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else text
    if kind == "object":
        return value if isinstance(value, dict) else text
    if kind == "array":
        return value if isinstance(value, list) else text
    return value
