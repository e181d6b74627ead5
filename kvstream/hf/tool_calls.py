"""Forced tool calls on the in-process engine: ``tool_choice: "required"`` or a named function.

The call is structured output (json_schema.py): a choice naming the function holds the
answer to that function's parameters, the arguments alone (the name is the request's, as vLLM
serves a named call: no tokens spent writing it, and the call is certain from the first
token); ``"required"`` to the schema of any one call, ``{"name": <one of the tools>,
"arguments": <that tool's parameters>}``. It comes back as OpenAI's ``tool_calls``
(``finish_reason: "tool_calls"``, no content); streamed, its arguments go out as they are
written (call_streams.py). The model sees the tools where its chat template renders them;
where it does not, the schema still holds the call to the tool's parameters, as a
``response_format`` schema does.

With ``tool_choice: "auto"`` the model decides, and its own call syntax is read out of its
text where its template shows one (tool_call_syntax.py).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

from kvstream.types import BackendRejected

def _invalid(message: str) -> BackendRejected:
    return BackendRejected(message, param="tool_choice", code="invalid_value")


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """The request's function tools by name."""
    if not isinstance(tools, list) or not tools:
        raise _invalid("'tool_choice' forces a call but 'tools' lists none.")
    functions: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise BackendRejected("Invalid value for 'tools': each tool is a function with a name.", param="tools",
                                  code="invalid_value")
        functions[name] = function  # type: ignore[assignment]
    return functions


@dataclass(frozen=True)
class ForcedNames:
    """The functions a forced call may be; ``named``: the choice names it (``names`` is that
    one), and the answer's text is its arguments alone."""

    names: tuple[str, ...]
    named: bool


def forced_names(tools: Any, choice: Any) -> ForcedNames | None:
    """Which functions ``choice`` forces the call to be; None when the model may answer in
    text (``"auto"``, ``"none"``, no choice). BackendRejected (400) for a choice naming no
    listed function, or one that is not a choice."""
    if choice is None or choice in ("auto", "none"):
        return None
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
    if choice == "required" or named:
        functions = _functions(tools)
        if not named:
            return ForcedNames(tuple(functions), named=False)
        name = choice["function"].get("name")
        if name not in functions:
            raise _invalid(f"Invalid value for 'tool_choice': no function named {name!r} in 'tools'.")
        return ForcedNames((name,), named=True)
    raise _invalid("Invalid value for 'tool_choice': 'none', 'auto', 'required' or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}.")


def holdable_tools(tools: Any) -> Any:
    """``tools`` with the bounds an expression cannot hold (``minimum``, ``pattern``...) left
    out of each function's parameters (json_schema.loosened): a tool's schema tells the model
    what to write, real tools carry such bounds, and the call is held to the rest. A function
    marked ``strict`` keeps its schema whole: the client asked for all of it to hold, so one
    the engine cannot hold is a 400, as a ``response_format`` schema is."""
    if not isinstance(tools, list):
        return tools
    return [_loosened_tool(tool) for tool in tools]


def _loosened_tool(tool: Any) -> Any:
    # (imported here: this module is imported by what a proxy-only install runs, which has
    # no ``regex``; json_schema.py needs it)
    from kvstream.hf.json_schema import loosened

    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("parameters"), dict) or function.get("strict") is True:
        return tool
    return {**tool, "function": {**function, "parameters": loosened(function["parameters"])}}


def forced_call_schema(tools: Any, choice: Any, arguments_key: str = "arguments") -> dict[str, Any] | None:
    """The JSON schema the answer is held to when ``choice`` forces a call: a named function's
    parameters, or (``"required"``) any one call of the tools, ``{"name", arguments_key}``
    (Llama 3 writes "parameters"); None when the model may answer in text. BackendRejected
    (400) as forced_names, or for tools whose parameters reuse another's ``$defs`` name
    differently."""
    forced = forced_names(tools, choice)
    if forced is None:
        return None
    functions = _functions(tools)
    if forced.named:
        return dict(functions[forced.names[0]].get("parameters") or {"type": "object"})
    names = forced.names
    definitions: dict[str, Any] = {}
    calls = []
    for name in names:
        parameters = dict(functions[name].get("parameters") or {"type": "object"})
        # Pydantic writes nested models as "$defs" with "#/$defs/..." references: those
        # resolve against the root, so they move there.
        for key in ("$defs", "definitions"):
            for def_name, definition in (parameters.pop(key, None) or {}).items():
                if definitions.setdefault(f"{key}/{def_name}", definition) != definition:
                    raise BackendRejected(f"Invalid value for 'tools': two tools define {def_name!r} differently.",
                                          param="tools", code="invalid_value")
        calls.append({"type": "object", "properties": {"name": {"const": name}, arguments_key: parameters}})
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"type": "object", "anyOf": calls}
    for path, definition in definitions.items():
        key, def_name = path.split("/", 1)
        schema.setdefault(key, {})[def_name] = definition
    return schema


_PARTIAL_NAME = re.compile(r'\s*\{\s*(?:"name"\s*:\s*"((?:[^"\\]|\\.)*))?')


def cut_call_name(body: str, names: tuple[str, ...]) -> str | None:
    """The function a ``{"name": ..., "arguments": ...}`` call cut short before its arguments
    began is calling: the one of ``names`` its name so far begins (or the only one); None
    where that is not one function."""
    head = _PARTIAL_NAME.match(body)
    if head is None:
        return None
    written = head.group(1) or ""
    candidates = [name for name in names if name.startswith(written)]
    return candidates[0] if len(candidates) == 1 else None


def call_id() -> str:
    return "call_" + secrets.token_hex(12)
