"""Forced tool calls on the in-process engine: ``tool_choice: "required"`` or a named function.

The call is structured output: the answer is held to the JSON schema of a call,
``{"name": <one of the tools>, "arguments": <that tool's parameters>}`` (json_schema.py), and
comes back as OpenAI's ``tool_calls`` (``finish_reason: "tool_calls"``, no content), as
vLLM serves a forced call; streamed, its arguments go out as they are written (call_streams.py). The model sees the tools where its chat template renders them;
where it does not, the schema still holds the call to the tool's parameters, as a
``response_format`` schema does.

With ``tool_choice: "auto"`` the model decides, and its own call syntax is read out of its
text where its template shows one (tool_call_syntax.py).
"""

from __future__ import annotations

import secrets
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


def forced_call_schema(tools: Any, choice: Any) -> dict[str, Any] | None:
    """The JSON schema the answer is held to when ``choice`` forces a call; None when the
    model may answer in text (``"auto"``, ``"none"``, no choice). BackendRejected (400) for a
    choice naming no listed function, or a tool whose parameters reuse another's ``$defs`` name."""
    if choice is None or choice in ("auto", "none"):
        return None
    functions = _functions(tools)
    if choice == "required":
        names = list(functions)
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise _invalid(f"Invalid value for 'tool_choice': no function named {name!r} in 'tools'.")
        names = [name]
    else:
        raise _invalid("Invalid value for 'tool_choice': 'none', 'auto', 'required' or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}.")
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
        calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": parameters}})
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"type": "object", "anyOf": calls}
    for path, definition in definitions.items():
        key, def_name = path.split("/", 1)
        schema.setdefault(key, {})[def_name] = definition
    return schema


def call_id() -> str:
    return "call_" + secrets.token_hex(12)
