"""Other servers' ways of holding the answer to a shape, read as the engine's constraints:
llama-server's ``grammar`` (GBNF), vLLM's ``guided_grammar``, ``guided_regex``,
``guided_choice`` and ``guided_json``, and vLLM's newer ``structured_outputs`` object
(``{"grammar" | "regex" | "choice" | "json": ...}``).

Each becomes either a JSON schema (json_schema.py, the same as ``response_format``'s) or a
regular expression the whole answer must match (pattern_constraint.py). One constraint per
request: two of them, or one with a JSON ``response_format`` or a forced tool call, is a 400,
as is a grammar or an expression that cannot be read or followed, naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import regex

from kvstream.hf.grammar import GrammarError, read_gbnf
from kvstream.hf.pattern_constraint import PatternError, check_pattern, compile_pattern
from kvstream.hf.pattern_machine import machine_holds
from kvstream.types import BackendRejected

# A client's own expression the machine cannot follow is compiled by the regex module, in C
# with the interpreter's lock held: every stream pauses for as long (about 4 ms per 1,000
# characters here, linearly: 3 s for 490 KB of alternatives); one it follows is compiled in
# the helper process alone (bounded_compile.py), and read into the machine. Past this length
# either is refused, which bounds that pause to about 0.1 s; hand-written expressions are far
# shorter, and a long list of literal answers is what ``guided_choice`` (or a schema's
# ``enum``) is for: the machine follows those.
MAX_EXPRESSION_CHARS = 16 * 1024

FIELDS = ("grammar", "guided_grammar", "guided_regex", "guided_choice", "guided_json", "structured_outputs")
STRUCTURED_KINDS = {"grammar": "guided_grammar", "regex": "guided_regex", "choice": "guided_choice", "json": "guided_json"}


@dataclass(frozen=True)
class Guide:
    """What a request's constraint field asks: a JSON schema or an expression, and the field."""

    field: str
    schema: dict[str, Any] | None = None
    pattern: str | None = None
    # A grammar's token references, as written, each with the character standing for it in
    # ``pattern`` (grammar.py); the engine resolves them against its vocabulary.
    tokens: tuple[tuple[str, str], ...] = ()


def _invalid(field: str, why: str) -> BackendRejected:
    return BackendRejected(f"Invalid value for '{field}': {why}.", param=field, code="invalid_value")


def guide(extra: dict[str, Any]) -> Guide | None:
    """The request's constraint field read (None: it sets none); BackendRejected (400) for
    two of them, or one that cannot be read or followed."""
    present = [name for name in FIELDS if extra.get(name) not in (None, "", [], {})]
    if not present:
        return None
    if len(present) > 1:
        raise _invalid(present[1], f"only one constraint applies to an answer ('{present[0]}' is set too)")
    field, value = present[0], extra[present[0]]
    if field == "structured_outputs":
        if not isinstance(value, dict):
            raise _invalid(field, "expected an object such as {\"regex\": ...}")
        kinds = [k for k in STRUCTURED_KINDS if value.get(k) not in (None, "", [], {})]
        if len(kinds) != 1:
            raise _invalid(field, f"expected exactly one of {', '.join(STRUCTURED_KINDS)}")
        return _read(STRUCTURED_KINDS[kinds[0]], value[kinds[0]], f"{field}.{kinds[0]}")
    return _read(field, value, field)


def _read(kind: str, value: Any, field: str) -> Guide:
    if kind == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise _invalid(field, "expected a JSON schema (an object, or its JSON text)") from None
        if not isinstance(value, dict):
            raise _invalid(field, "expected a JSON schema object")
        return Guide(field, schema=value)
    if kind == "guided_choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise _invalid(field, "expected a non-empty list of strings")
        return Guide(field, pattern="|".join(regex.escape(choice) for choice in value))
    if not isinstance(value, str):
        raise _invalid(field, "expected a string")
    tokens: tuple[tuple[str, str], ...] = ()
    if kind in ("grammar", "guided_grammar"):
        try:
            grammar = read_gbnf(value)
        except GrammarError as exc:
            raise _invalid(field, f"the grammar cannot be read: {exc}") from None
        pattern, tokens = grammar.pattern, grammar.tokens
        if machine_holds(pattern):
            # An expression KVStream wrote, which the machine holds the answer to: the regex
            # module compiles it only if an answer needs it (seconds for a large grammar, with
            # the interpreter's lock held: every stream paused).
            return Guide(field, pattern=pattern, tokens=tokens)
    else:
        if len(value) > MAX_EXPRESSION_CHARS:
            raise _invalid(field, f"the expression is {len(value)} characters long, past the {MAX_EXPRESSION_CHARS} this "
                                  "server compiles (a list of literal answers fits 'guided_choice', or a JSON schema's 'enum')")
        pattern = value
    try:
        # A client's expression: what the regex module refuses is a 400. One the machine holds
        # is compiled by the helper only (the engine compiles it if an answer needs it): the
        # regex module holds the interpreter's lock as it compiles, pausing every stream.
        if machine_holds(pattern):
            check_pattern(pattern)
        else:
            compile_pattern(pattern)
    except PatternError as exc:
        raise _invalid(field, str(exc)) from None
    return Guide(field, pattern=pattern, tokens=tokens)
