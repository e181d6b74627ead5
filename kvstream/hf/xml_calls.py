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
from typing import Any

FUNCTION_TAG = "<function="
PARAMETER_TAG = "<parameter="
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_OPEN_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*)", re.DOTALL)
_FUNCTION_END = "</function>"


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


def xml_arguments(body: str, schemas: dict[str, dict[str, Any]], partial: bool = False) -> tuple[str, dict[str, Any]] | None:
    """The function name and typed arguments a tag's ``body`` holds; None when it holds no
    call (no ``<function=...>`` first, text besides the tags). A missing ``</function>`` is
    forgiven, as vLLM does. ``partial``: a body cut short (``max_tokens``): the parameters as
    far as they went, the last one's text so far."""
    head = _FUNCTION.match(body)
    if head is None:
        return None
    name = head.group(1).strip()
    inner = body[head.end():]
    end = inner.rfind(_FUNCTION_END)
    if end >= 0:
        if inner[end + len(_FUNCTION_END):].strip():
            return None
        inner = inner[:end]
    schema = schemas.get(name, {})
    arguments: dict[str, Any] = {}
    at = 0
    for parameter in _PARAMETER.finditer(inner):
        if inner[at:parameter.start()].strip():
            return None  # text between parameters: not a call
        key = parameter.group(1).strip()
        arguments[key] = typed_value(_unwrap(parameter.group(2)), schema.get(key))
        at = parameter.end()
    rest = inner[at:]
    if partial and end < 0:
        cut = _OPEN_PARAMETER.match(rest)
        if cut is not None:  # the value being written when the tokens ran out: its text so far
            arguments[cut.group(1).strip()] = _without_cut_close(cut.group(2).removeprefix("\n"))
        return name, arguments
    return (name, arguments) if not rest.strip() else None


def _unwrap(value: str) -> str:
    """A value as written between its tags, less the newline after the open tag and the one
    before the close tag (the layout the templates show)."""
    return value.removeprefix("\n").removesuffix("\n")


def _without_cut_close(value: str) -> str:
    """A value cut short, less the start of its close tag (``"1\\n</para"`` -> ``"1"``)."""
    close = "\n</parameter>"
    for n in range(min(len(close), len(value)), 0, -1):
        if close.startswith(value[-n:]):
            return value[:-n]
    return value


def typed_value(text: str, schema: Any) -> Any:
    """``text`` as the JSON value its parameter ``schema`` asks for; the text itself when it
    does not read as that type or the schema names none."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), None)
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
