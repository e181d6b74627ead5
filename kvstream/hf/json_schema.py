"""Structured outputs (``response_format: {"type": "json_schema", ...}``, Ollama's ``format``
as a schema) and JSON mode (``json_object``, Ollama's ``format: "json"``: the schema
``JSON_OBJECT``, any one object): the answer is constrained to JSON text that a regular
expression built from the schema accepts, and ends where the root value is whole and nothing
can follow it (an object's or an array's close, a string's closing quote); a value that could
go on (a number: ``4`` or ``42``) may end there with the model's end token.

``schema_pattern`` writes the expression: strings (``enum``, ``const``, ``minLength`` /
``maxLength``), integers, numbers, booleans, null, arrays (``items``, ``minItems`` /
``maxItems``, tuples: ``prefixItems`` or ``items`` as a list), objects with their
``properties`` written in the schema's order, all of them
(an optional property present is still valid, and OpenAI's strict mode makes every property
required anyway), ``anyOf`` / ``oneOf`` / a list of types as alternatives, ``$ref`` into
``$defs`` / ``definitions`` or ``#`` itself (recursive ones too: a tree of nodes; each
reference a rule the expression calls, as a grammar's), and any JSON value for a schema that says
nothing (at any depth). A keyword that would constrain the value in a
way the expression does not (``pattern``, ``minimum``, ``allOf``, ``patternProperties``,
...) is refused (``SchemaError``, a 400 naming it), never ignored; annotations (``title``,
``description``, ``format``, ``default``, ...) are ignored, as they constrain nothing.

``pattern_constraint.PatternConstraint`` holds the answer to the expression, following it
one character at a time (pattern_machine.py).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import regex

from kvstream.hf.bounded_compile import bounded_compile
from kvstream.hf.engine_turns import give_turn
from kvstream.hf.pattern_machine import LazyExpression, machine_for, machine_holds

# Whitespace between tokens: none, one space, or a newline and an indent of up to MAX_INDENT
# spaces or tabs (llama.cpp's JSON grammars' rule). That is all compact or pretty-printed JSON
# needs, and a small model otherwise pads with runs of blank lines and spaces, each of them
# valid JSON (and could forever). An empty container holds one such run, not two.
MAX_INDENT = 20
WS = rf"(?: |\n[ \t]{{0,{MAX_INDENT}}})?"
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
# Keywords that only describe: nothing to enforce.
# (``additionalProperties`` and ``required``: every listed property is written and no other,
# which both allow; a map, with no properties listed, takes additionalProperties' schema.)
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "format", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "strict", "name", "additionalProperties", "required", "$defs", "definitions", "contentMediaType",
})
# JSON mode (``response_format: {"type": "json_object"}``, Ollama's ``format: "json"``): the
# answer is one JSON object, of any members, and ends where it closes.
JSON_OBJECT = {"type": "object"}
HANDLED = frozenset({
    "type", "properties", "items", "prefixItems", "additionalItems", "enum", "const", "anyOf", "oneOf", "$ref",
    "minLength", "maxLength", "minItems", "maxItems",
})


class SchemaError(ValueError):
    """A schema (or a part of it) the engine cannot constrain its output to."""


def _bounded(unit: str, low: int, high: int | None) -> str:
    return f"(?:{unit}){{{low},{'' if high is None else high}}}"


def _container(opening: str, item: str, closing: str) -> str:
    """``item``s between an opening and a closing bracket, comma-separated, maybe none."""
    return rf"{opening}(?:{WS}{item}(?:{WS},{WS}{item})*)?{WS}{closing}"


class Spelling:
    """How the values a schema admits are written: as JSON (``JSON``), or as the Python
    literals that ``ast.literal_eval`` reads back as the same values (``PYTHON``: the
    arguments of a pythonic tool call, ``f(city="Paris", days=3)``)."""

    true, false, null = "true", "false", "null"
    any, any_object = "any", "any_object"  # the rules of any value (see _Writer.any_value)

    def string(self, low: int = 0, high: int | None = None) -> str:
        """A string of ``low`` to ``high`` characters (an escape counts one)."""
        return '"' + _bounded(STRING_CHAR, low, high) + '"'

    def literal(self, value: Any) -> str:
        """Exactly ``value`` (a ``const``, an ``enum``'s member, a property's name)."""
        return regex.escape(json.dumps(value, ensure_ascii=False, separators=(",", ":")))

    def any_rules(self) -> dict[str, str]:
        """The two rules of any value at any depth: any value, and any object."""
        member = f"{self.string()}{WS}:{WS}(?&{self.any})"
        options = [self.string(), NUMBER, self.true, self.false, self.null,
                   _container(r"\[", f"(?&{self.any})", r"\]"), f"(?&{self.any_object})"]
        return {self.any: "(?:" + "|".join(options) + ")", self.any_object: _container(r"\{", member, r"\}")}


# A character of a Python string in double quotes, and in single: JSON's escapes and the other
# quote's, not "\/" (Python keeps it as two characters).
PY_DOUBLE_CHAR = r"""(?:[^"\\\x00-\x1f]|\\["'\\bfnrt]|\\u[0-9a-fA-F]{4})"""
PY_SINGLE_CHAR = r"""(?:[^'\\\x00-\x1f]|\\["'\\bfnrt]|\\u[0-9a-fA-F]{4})"""


class PythonSpelling(Spelling):
    """Python's literals: ``True``, ``False``, ``None``, and strings in either quotes."""

    true, false, null = "True", "False", "None"
    any, any_object = "py_any", "py_any_object"

    def string(self, low: int = 0, high: int | None = None) -> str:
        return f"""(?:"{_bounded(PY_DOUBLE_CHAR, low, high)}"|'{_bounded(PY_SINGLE_CHAR, low, high)}')"""

    def literal(self, value: Any) -> str:
        if isinstance(value, str):  # in either quotes
            inner = json.dumps(value, ensure_ascii=False)[1:-1]
            single = "'" + inner.replace('\\"', '"').replace("'", "\\'") + "'"
            return f'(?:{regex.escape(f"{chr(34)}{inner}{chr(34)}")}|{regex.escape(single)})'
        return regex.escape(_python_text(value))


def _python_text(value: Any) -> str:
    """``value`` as a Python literal, compactly (its strings in double quotes)."""
    if value is None or isinstance(value, bool):
        return {None: "None", True: "True", False: "False"}[value]
    if isinstance(value, dict):
        return "{" + ",".join(f"{_python_text(str(key))}:{_python_text(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(map(_python_text, value)) + "]"
    return json.dumps(value, ensure_ascii=False)


JSON, PYTHON = Spelling(), PythonSpelling()


class _Writer:
    def __init__(self, root: dict[str, Any], prefix: str = "", spelling: Spelling = JSON) -> None:
        self.root = root
        self.prefix = prefix  # of the references' group names
        self.spelling = spelling
        # Each $ref is one named group of a DEFINE block, called where it is used, so that a
        # schema may refer to itself (a tree of nodes) as a grammar's rule does.
        self.groups: dict[str, str] = {}  # ref -> its group's name
        self.definitions: dict[str, str] = {}  # group name -> its expression
        self.resolving: dict[str, int] = {}  # ref being written -> the containers open when it began
        self.containers = 0  # objects and arrays open around the value being written

    def any_value(self) -> str:
        """Any JSON value (a schema that says nothing)."""
        for name, rule in self.spelling.any_rules().items():
            self.definitions.setdefault(name, rule)
        return f"(?&{self.spelling.any})"

    def any_object(self) -> str:
        self.any_value()
        return f"(?&{self.spelling.any_object})"

    def inside(self, schema: Any, where: str) -> str:
        """A value inside an object or an array: after its ``{`` or ``[``."""
        self.containers += 1
        try:
            return self.value(schema, where)
        finally:
            self.containers -= 1

    def value(self, schema: Any, where: str) -> str:
        give_turn()  # (written on a request's worker thread: engine_turns.py)
        if schema is True or schema == {}:
            return self.any_value()
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object")
        unknown = set(schema) - ANNOTATIONS - HANDLED
        if unknown:
            raise SchemaError(f"{where}: '{sorted(unknown)[0]}' is not supported")
        if "$ref" in schema:
            return self._ref(schema["$ref"], where)
        if "const" in schema:
            return self.spelling.literal(schema["const"])
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise SchemaError(f"{where}: 'enum' must be a non-empty list")
            return "(?:" + "|".join(map(self.spelling.literal, schema["enum"])) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                options = schema[key]
                if not isinstance(options, list) or not options:
                    raise SchemaError(f"{where}: '{key}' must be a non-empty list")
                return "(?:" + "|".join(self.value(o, f"{where}.{key}[{i}]") for i, o in enumerate(options)) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):
            return "(?:" + "|".join(self.value({**schema, "type": k}, where) for k in kind) + ")"
        if kind is None:
            if "properties" in schema:
                kind = "object"
            elif "items" in schema or "prefixItems" in schema:
                kind = "array"
            else:
                return self.any_value()
        return self._typed(kind, schema, where)

    def _typed(self, kind: Any, schema: dict[str, Any], where: str) -> str:
        if kind == "string":
            return self.spelling.string(int(schema.get("minLength", 0)), schema.get("maxLength"))
        if kind == "integer":
            return INTEGER
        if kind == "number":
            return NUMBER
        if kind == "boolean":
            return f"(?:{self.spelling.true}|{self.spelling.false})"
        if kind == "null":
            return self.spelling.null
        if kind == "array":
            return self._array(schema, where)
        if kind == "object":
            properties = schema.get("properties") or {}
            if not isinstance(properties, dict):
                raise SchemaError(f"{where}: 'properties' must be an object")
            extra = schema.get("additionalProperties")
            if not properties and isinstance(extra, dict) and extra:  # a map: any keys, values of one schema
                member = f'{self.spelling.string()}{WS}:{WS}{self.inside(extra, f"{where}.additionalProperties")}'
                return _container(r"\{", member, r"\}")
            if not properties:  # a free-form object
                return self.any_object()
            members = [f"{self.spelling.literal(name)}{WS}:{WS}{self.inside(sub, f'{where}.{name}')}"
                       for name, sub in properties.items()]
            return rf"\{{{WS}" + f"{WS},{WS}".join(members) + rf"{WS}\}}"
        raise SchemaError(f"{where}: type {kind!r} is not supported")

    def _array(self, schema: dict[str, Any], where: str) -> str:
        """An array: a tuple's items first (``prefixItems``, or ``items`` as a list in drafts
        before 2020-12), each of them, as llama.cpp's converter writes a tuple; then the
        rest, of ``items`` (after a tuple: 2020-12's ``items``, older drafts'
        ``additionalItems``; none where that is false or a tuple says nothing more);
        ``minItems`` / ``maxItems`` count them all."""
        items, tuple_items = schema.get("items", {}), schema.get("prefixItems", [])
        if isinstance(items, list):  # the older drafts' tuple
            if "prefixItems" in schema:
                raise SchemaError(f"{where}: 'items' as a list and 'prefixItems' together")
            items, tuple_items, rest_key = schema.get("additionalItems", False), items, "additionalItems"
        else:
            rest_key = "items"
            if "prefixItems" in schema and "items" not in schema:
                items = False
        if not isinstance(tuple_items, list):
            raise SchemaError(f"{where}: 'prefixItems' must be a list")
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        first = [self.inside(sub, f"{where}.prefixItems[{i}]") for i, sub in enumerate(tuple_items)]
        more = None if items is False or high == len(first) else self.inside(items, f"{where}.{rest_key}")
        if (high is not None and high < len(first)) or (more is None and low > len(first)):
            raise SchemaError(f"{where}: minItems / maxItems do not fit its {len(first)} tuple items")
        if not first:
            if more is None or high == 0:
                return rf"\[{WS}\]"
            tail = _bounded(f"{WS},{WS}{more}", max(low - 1, 0), None if high is None else high - 1)
            return rf"\[{WS}{more}{tail}{WS}\]" if low else rf"\[(?:{WS}{more}{tail})?{WS}\]"
        tail = "" if more is None else _bounded(f"{WS},{WS}{more}", max(low - len(first), 0),
                                                None if high is None else high - len(first))
        return rf"\[{WS}" + f"{WS},{WS}".join(first) + rf"{tail}{WS}\]"

    def _ref(self, ref: Any, where: str) -> str:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"{where}: only local references ('#/$defs/...') are supported")
        if ref in self.resolving:
            if self.resolving[ref] == self.containers:  # no '{' or '[' read since: it would never end
                raise SchemaError(f"{where}: {ref} refers to itself outside any object or array")
            return f"(?&{self.groups[ref]})"
        if ref not in self.groups:
            target: Any = self.root
            for part in ref[2:].split("/") if ref != "#" else ():
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise SchemaError(f"{where}: {ref} does not resolve")
                target = target[part]
            name = self.groups[ref] = f"{self.prefix}d{len(self.groups)}"
            self.resolving[ref] = self.containers
            try:
                self.definitions[name] = self.value(target, ref)
            finally:
                del self.resolving[ref]
        return f"(?&{self.groups[ref]})"


def schema_pattern(schema: Any) -> str:
    """The regular expression of the JSON texts ``schema`` admits (its root any value it
    describes: an object, an array, a string, a number, a constant...)."""
    return with_rules(*schema_parts(schema))


def schema_parts(schema: Any, prefix: str = "", spelling: Spelling = JSON) -> tuple[str, dict[str, str]]:
    """``schema``'s expression as its root and the named rules the root calls (``(?&name)``),
    for an expression that holds several schemas (call_grammar.py): a name may be defined only
    once in it, so each schema's references get their own ``prefix``; the rules of any JSON
    value are the same in every schema. ``spelling``: the values as JSON, or as Python
    literals (``PYTHON``)."""
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    writer = _Writer(schema, prefix, spelling)
    return writer.value(schema, "schema"), writer.definitions


def with_rules(expression: str, rules: dict[str, str]) -> str:
    """``expression`` with the named ``rules`` it calls defined before it."""
    if not rules:
        return expression
    defined = "".join(f"(?P<{name}>{pattern})" for name, pattern in rules.items())
    return f"(?(DEFINE){defined}){expression}"


def loosened(schema: Any) -> Any:
    """``schema`` less the keywords the expression cannot hold (``minimum``, ``pattern``,
    ``allOf``...) at any depth: a schema admitting everything it admits, and more. For the
    calls of a tool (tool_calls.holdable_tools), whose schema is written to tell the model what
    to write: a bound the expression cannot enforce is no reason to refuse the tool or hold
    nothing. A schema the client asks the answer to follow (``response_format``) is refused
    instead."""
    if not isinstance(schema, dict):
        return schema
    out = {key: value for key, value in schema.items() if key in ANNOTATIONS or key in HANDLED}
    for key in ("properties", "$defs", "definitions"):  # maps of schemas
        if isinstance(out.get(key), dict):
            out[key] = {name: loosened(value) for name, value in out[key].items()}
    for key in ("items", "additionalItems", "additionalProperties"):  # one schema (items: or a list)
        if key in out:
            out[key] = [loosened(v) for v in out[key]] if isinstance(out[key], list) else loosened(out[key])
    for key in ("prefixItems", "anyOf", "oneOf"):  # lists of schemas
        if isinstance(out.get(key), list):
            out[key] = [loosened(v) for v in out[key]]
    return out


@functools.lru_cache(maxsize=64)
def _compiled(text: str) -> Any:
    try:
        pattern = schema_pattern(json.loads(text))
        machine = machine_for(pattern)
        if machine is not None and not machine.matches_something():
            raise SchemaError("no JSON value satisfies the schema (a reference that must always hold itself again)")
        if machine_holds(pattern):  # the regex module only if the machine gives up on an answer
            return LazyExpression(pattern)
        return bounded_compile(pattern)
    except SchemaError:
        raise
    except (ValueError, TypeError, RecursionError, regex.error) as exc:  # a malformed bound, an expression too large
        raise SchemaError(f"the schema cannot be turned into an expression ({exc})") from None


def compile_schema(schema: Any) -> Any:
    """The compiled expression of ``schema`` (cached by its text: clients resend one schema;
    not with sorted keys, as the properties' order is the answer's)."""
    return _compiled(json.dumps(schema))
