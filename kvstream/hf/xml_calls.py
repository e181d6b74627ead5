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
tool_call_syntax.py finds the tags; this module reads what is inside them.
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
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_OPEN_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*)", re.DOTALL)
_FUNCTION_END = "</function>"
_PARAMETER_END = "</parameter>"


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
    is read as one (models fall back on it)."""

    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    _json: JsonCallStream | None = None  # the body is the JSON form
    _pairs: list[str] = field(default_factory=list)  # '"key": value' of the parameters read
    _read_to: int = 0  # where the parameters read end, in the body

    def _progress(self, body: str) -> tuple[str, str] | None:
        if self._use_json(body):
            return self._json._progress(body)  # type: ignore[union-attr]
        head = _FUNCTION.match(body)
        if head is None:
            return None
        name = head.group(1).strip()
        rest = self._read_parameters(body, max(self._read_to, head.end()), name)
        if rest is None:
            return None  # text among the parameters: nothing more is certain
        opened = _OPEN_PARAMETER.match(rest)
        if opened is None:
            # Nothing is certain of a call before its first parameter (or its end) is read.
            begun = self._pairs or rest.lstrip().startswith(_FUNCTION_END)
            return (name, "{" + ", ".join(self._pairs)) if begun else None
        key, text = opened.group(1).strip(), opened.group(2)
        if _kind(self._schema(name).get(key)) not in (None, "string"):
            return name, "{" + ", ".join(self._pairs)  # typed: goes out whole, once read
        return name, "{" + ", ".join([*self._pairs, _pair(key, _text_so_far(text))])[:-1]  # (open quote)

    def _whole(self, body: str, cut: bool) -> tuple[str, str] | None:
        if self._use_json(body):
            return self._json._whole(body, cut)  # type: ignore[union-attr]
        head = _FUNCTION.match(body)
        if head is None:
            return None
        name = head.group(1).strip()
        end = body.rfind(_FUNCTION_END)
        if end >= 0:
            if body[end + len(_FUNCTION_END):].strip():
                return None
            inner_end = end
        else:
            inner_end = len(body)  # a missing </function> is forgiven, as vLLM does
        rest = self._read_parameters(body[:inner_end], max(self._read_to, head.end()), name)
        if rest is None:
            return None
        pairs = list(self._pairs)
        if cut and end < 0:
            opened = _OPEN_PARAMETER.match(rest)
            if opened is not None:  # the value being written when the tokens ran out: its text so far
                pairs.append(_pair(opened.group(1).strip(), _text_so_far(opened.group(2))))
        elif rest.strip():
            return None
        return name, "{" + ", ".join(pairs) + "}"

    def _use_json(self, body: str) -> bool:
        if self._json is None and body.lstrip().startswith("{"):
            self._json = JsonCallStream(self.index)
        return self._json is not None

    def _read_parameters(self, body: str, at: int, name: str) -> str | None:
        """Read the parameters whole from ``at`` on into ``_pairs``; the text after them, or
        None when there is text between them (not a call)."""
        schema = self._schema(name)
        for parameter in _PARAMETER.finditer(body, at):
            if body[at:parameter.start()].strip():
                return None
            key = parameter.group(1).strip()
            self._pairs.append(_pair(key, typed_value(_unwrap(parameter.group(2)), schema.get(key))))
            at = self._read_to = parameter.end()
        return body[at:]

    def _schema(self, name: str) -> dict[str, Any]:
        return self.schemas.get(name, {})


def _pair(key: str, value: Any) -> str:
    return json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


def _text_so_far(text: str) -> str:
    """A string value still being written: less the newline after its open tag and what may
    be the start of its close tag (``"1\\n</para"`` -> ``"1"``)."""
    return _without_cut_close(text.removeprefix("\n"))


def _unwrap(value: str) -> str:
    """A value as written between its tags, less the newline after the open tag and the one
    before the close tag (the layout the templates show)."""
    return value.removeprefix("\n").removesuffix("\n")


def _without_cut_close(value: str) -> str:
    """``value`` less the longest end of it that may begin its close tag (with the newline
    before it, or without)."""
    for n in range(min(len(_PARAMETER_END) + 1, len(value)), 0, -1):
        end = value[-n:]
        if ("\n" + _PARAMETER_END).startswith(end) or _PARAMETER_END.startswith(end):
            return value[:-n]
    return value


def _kind(schema: Any) -> str | None:
    """The JSON type a parameter's schema names (of ``["integer", "null"]``, the first
    that is not null); None when it names none."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def typed_value(text: str, schema: Any) -> Any:
    """``text`` as the JSON value its parameter ``schema`` asks for; the text itself when it
    does not read as that type or the schema names none."""
    kind = _kind(schema)
    if kind is None or kind == "string":
        return text
    if text.strip().lower() == "null":
        return None
    if kind == "boolean":
        word = text.strip().lower()
        return word == "true" if word in ("true", "false") else text
    try:
        value = json.loads(text)
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
