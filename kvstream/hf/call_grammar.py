"""A model's own tool calls held to the offered tools, from the moment it opens one.

With ``tool_choice: "auto"`` the model decides whether to call: its answer stays free text
(tool_call_syntax.py reads the calls out of it). A small model left free inside the call,
though, misspells a tool's name or writes arguments its schema refuses, and the client gets
a call it cannot run, or the call as text. So, as llama-server holds a template's calls with a
lazy grammar, the engine holds the answer from the call's opening on (lazy_grammar.py): every
call one of the offered tools, its arguments valid for that tool's parameters (the same
expression a forced call is held to, tool_calls.py); after the last call, only the end.

Held syntaxes, and what opens a call:

- Hermes (Qwen2.5 and Qwen3, Hermes, SmolLM3...): ``<tool_call>``, each call
  ``{"name", "arguments"}`` between the tags;
- Llama 3's JSON: an answer that begins ``{"name": "`` (llama.cpp's trigger for it), calls
  ``{"name", "parameters"}`` joined by ``;``;
- Granite 3's: ``<|tool_call|>`` and a JSON list of ``{"name", "arguments"}``;
- Mistral's: ``[TOOL_CALLS]`` and either such a list (v0.3's tokenizer) or ``name[ARGS]{...}``,
  one call a mark (later ones);
- Qwen3-Coder's XML: ``<tool_call>`` (or a bare ``<function=``, which the reader takes too),
  each call ``<function=name>`` and its ``<parameter=key>value</parameter>``s in the schema's
  order, the required ones present and each other one at most once; a string's value any text
  but its close tag, a typed value (integer, boolean, object...) JSON its schema admits, as
  xml_calls.py reads it back (or the call as JSON in the tags, which the reader takes too);
- DeepSeek's: ``<｜tool▁calls▁begin｜>`` (or a first ``<｜tool▁call▁begin｜>``), each call in
  V3's fenced form or V3.1's bare one (deepseek_calls.py), then ``<｜tool▁calls▁end｜>`` or the
  end (the reader takes the calls without their closing mark; held to write it, SmolLM2 wrote
  another call instead of ending);
- the pythonic templates' (Llama 3.2 and 4, Gemma 3, ToolACE): an answer that begins with ``[``
  and the first two characters of an offered tool's name (or all of a shorter one), a Python
  list of calls ``name(key=value, ...)``, each argument a keyword in the schema's order (the
  required ones present, each other one at most once), its value the Python literal of a
  value its schema admits (``True``, ``None``, strings in either quotes: json_schema's
  ``PYTHON`` spelling), as pythonic_calls.py reads them back. A bare ``[`` opens no hold (an
  answer may begin with a bracketed word): the name's first characters say it is a call.
  Tools whose names or parameters a Python call cannot write (``get-weather``, a parameter
  named ``class``) are left out of the hold.

A call opened inside the model's thinking is a draft, not a call, and does not start the hold
(the trigger counts outside ``<think>`` blocks). An opening the expression cannot begin with
(blanks it does not allow) leaves the answer unheld, read as before; so do tools whose
expression cannot be followed.

A tool's bounds the expression cannot enforce (``minimum``, ``pattern``...) are left out of its
hold (tool_calls.holdable_tools). The expression of many tools is long (50 tools: 0.1-0.25 MB):
the hold is cached by its arguments and read into the incremental machine only (the regex
module compiles it only if an answer needs it), on a worker thread before the request is
queued (backend.py).
"""

from __future__ import annotations

import functools
import json
import keyword
from dataclasses import dataclass
from typing import Any

import regex

from kvstream.hf import deepseek_calls, pythonic_calls
from kvstream.hf.grammar import TOKEN_SENTINELS
from kvstream.hf.json_schema import JSON, PYTHON, WS, Spelling, schema_parts, with_rules
from kvstream.hf.lazy_grammar import Triggers
from kvstream.hf.pattern_constraint import expression
from kvstream.hf.tool_call_syntax import CLOSE, GRANITE_CALLS, MISTRAL_ARGS, MISTRAL_CALLS, OPEN, PYTHON_TAG, CallReading
from kvstream.hf.tool_calls import forced_call_schema, forced_names, holdable_tools
from kvstream.hf.xml_calls import FUNCTION_END, FUNCTION_TAG, PARAMETER_END, PARAMETER_TAG, value_kind

# The syntaxes held, each with the tags its expression writes (referenced where they are tokens).
HELD_TAGS = {"hermes": (OPEN, CLOSE), "llama3_json": (), "granite": (GRANITE_CALLS,), "mistral": (MISTRAL_CALLS, MISTRAL_ARGS),
             "qwen3_xml": (OPEN, CLOSE), "deepseek": deepseek_calls.TAGS, "pythonic": (pythonic_calls.PYTHON_END,)}

GAP = "[ \\t\\n]{0,4}"  # between the tags and the call, and between calls: a few blanks, never a run
# The whole answer so far beginning as a Llama 3 call (its python tag may open it).
LLAMA3_OPENING = f'^\\s*(?:{regex.escape(PYTHON_TAG)}\\s*)?(\\{{\\s*"name"\\s*:\\s*")[\\s\\S]*$'


@dataclass(frozen=True)
class CallHold:
    """The expression a call-writing answer is held to, from one of ``triggers`` on, and the
    special tokens it references (token id, the character standing for it)."""

    pattern: str
    triggers: Triggers
    tokens: tuple[tuple[int, str], ...] = ()


def call_hold(calls: CallReading, tools: Any, thinking_opened: bool | None,
              special_tags: dict[int, str]) -> CallHold | None:
    """The hold for an answer read for ``calls`` (None: its syntax is read unheld).
    ``thinking_opened``: whether the prompt left a ``<think>`` block open (None: the model
    does not think). ``special_tags``: tags that are special tokens of the vocabulary (token
    id -> text), which the expression references as those tokens: their text spelled by
    other tokens is not the tag. Bounds the expression cannot hold (a ``minimum``, a
    ``pattern``) are left out of it: the call is held to everything else (tool_calls.holdable_tools;
    a ``strict`` tool with one is read unheld). Cached by its arguments: the expression of many
    tools takes seconds to compile (the backend does it off the event loop first)."""
    if calls.syntax not in HELD_TAGS:
        return None
    try:
        tools_text = json.dumps(tools)
    except (TypeError, ValueError):
        return None
    return _cached_hold(calls.syntax, calls.single_call, tools_text, thinking_opened, tuple(sorted(special_tags.items())))


@functools.lru_cache(maxsize=64)
def _cached_hold(syntax: str, single_call: bool, tools_text: str, thinking_opened: bool | None,
                 special_tags: tuple[tuple[int, str], ...]) -> CallHold | None:
    tools = holdable_tools(json.loads(tools_text))
    if forced_call_schema(tools, "required") is None:  # (BackendRejected, a 400, for tools that are not functions)
        return None
    try:
        hold = _hold(CallReading(syntax, single_call), _Rules(tools), thinking_opened, dict(special_tags))
        expression(hold.pattern)  # read into its machine now (cached: the constraint is made on the event loop)
    except (ValueError, TypeError, RecursionError):  # tools whose schemas the expression cannot hold: read unheld
        return None
    return hold


def _hold(calls: CallReading, rules: _Rules, thinking_opened: bool | None, special_tags: dict[int, str]) -> CallHold:
    tags = {text: (token, chr(TOKEN_SENTINELS + k)) for k, (token, text) in enumerate(
        (t, s) for t, s in special_tags.items() if s in HELD_TAGS[calls.syntax])}

    def tag(text: str) -> str:
        return regex.escape(tags[text][1]) if text in tags else regex.escape(text)

    def held(pattern: str, *opening: str) -> CallHold:  # each opening tag's token where it is one, else its text
        triggers = Triggers(tokens=frozenset(tags[text][0] for text in opening if text in tags),
                            words=tuple(text for text in opening if text not in tags), thinking=thinking_opened,
                            strict=False)
        return CallHold(rules.pattern(pattern), triggers, tuple(tags.values()))

    several = not calls.single_call
    some = (lambda one: f"(?:{one})+") if several else (lambda one: f"(?:{one})")
    call = rules.call("parameters" if calls.syntax == "llama3_json" else "arguments")  # {"name", "arguments"}
    if calls.syntax == "hermes":
        return held(some(f"{tag(OPEN)}{GAP}{call}{GAP}{tag(CLOSE)}{GAP}"), OPEN)
    listed = f"\\[{GAP}{call}(?:{GAP},{GAP}{call})*{GAP}\\]{GAP}" if several else f"\\[{GAP}{call}{GAP}\\]{GAP}"
    if calls.syntax == "granite":
        return held(f"{tag(GRANITE_CALLS)}{GAP}{listed}", GRANITE_CALLS)
    if calls.syntax == "qwen3_xml":
        functions = "|".join(_xml_call(name, rules) for name in rules.names)
        return held(some(f"{tag(OPEN)}{GAP}(?:{functions}|{call}){GAP}{tag(CLOSE)}{GAP}|(?:{functions}){GAP}"),
                    OPEN, FUNCTION_TAG)
    if calls.syntax == "deepseek":
        sep = tag(deepseek_calls.SEP)
        bodies = "|".join(f"function{sep}{regex.escape(name)}\\n```json\\n{rules.arguments(name)}\\n```"
                          f"|{regex.escape(name)}{sep}{rules.arguments(name)}" for name in rules.names)
        each = some(f"{tag(deepseek_calls.CALL_BEGIN)}(?:{bodies}){tag(deepseek_calls.CALL_END)}{GAP}")
        # (the closing mark is layout to the reader: a model that ends without it is not held to write more calls)
        return held(f"(?:{tag(deepseek_calls.CALLS_BEGIN)}{GAP}{each}(?:{tag(deepseek_calls.CALLS_END)}{GAP})?|{each})",
                    deepseek_calls.CALLS_BEGIN, deepseek_calls.CALL_BEGIN)
    if calls.syntax == "mistral":
        named = "|".join(f"{regex.escape(name)}{tag(MISTRAL_ARGS)}{rules.arguments(name)}" for name in rules.names)
        return held(f"(?:{tag(MISTRAL_CALLS)}{GAP}{listed}|{some(f'{tag(MISTRAL_CALLS)}(?:{named}){GAP}')})",
                    MISTRAL_CALLS)
    if calls.syntax == "pythonic":
        return _pythonic_hold(rules, several, tag(pythonic_calls.PYTHON_END))
    # Llama 3: the answer itself is the calls (a thinking model's, after its block: not one of these).
    joined = f"{call}(?:{GAP};{GAP}{call})*" if several else call
    return CallHold(rules.pattern(f"{joined}{GAP}"), Triggers(patterns=(LLAMA3_OPENING,), strict=False))


def _pythonic_hold(rules: _Rules, several: bool, list_end: str) -> CallHold:
    """A Python list of calls of the tools a Python call can name (ValueError if none),
    opened by ``[`` and the first characters of one of their names."""
    names = [name for name in rules.names if all(part.isidentifier() and not keyword.iskeyword(part)
                                                 for part in name.split("."))]
    calls = {name: call for name in names if (call := _python_call(name, rules)) is not None}
    if not calls:
        raise ValueError("no offered tool can be called in Python's syntax")
    call = "(?:" + "|".join(calls.values()) + ")"
    listed = f"\\[{GAP}{call}(?:{GAP},{GAP}{call})*{GAP},?{GAP}\\]" if several else f"\\[{GAP}{call}{GAP},?{GAP}\\]"
    starts = sorted({regex.escape(name[:2]) for name in calls})
    opening = f"^\\s*(?:{regex.escape(pythonic_calls.PYTHON_START)}\\s*)?(\\[[ \\t\\n]*(?:{'|'.join(starts)}))[\\s\\S]*$"
    return CallHold(rules.pattern(f"{listed}{GAP}(?:{list_end}{GAP})?"), Triggers(patterns=(opening,), strict=False))


def _python_call(name: str, rules: _Rules) -> str | None:
    """One call of ``name`` as a Python call, ``name(key=value, ...)``: its parameters as
    keywords in the schema's order, the required ones present, each other one at most once;
    None where a parameter's name cannot be a keyword argument. A tool with no properties
    listed takes any keywords unless ``additionalProperties`` is false."""
    parameters = rules.parameters(name)
    properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
    required = set(parameters.get("required") or ()) if isinstance(parameters.get("required"), list) else set()
    definitions = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    if any(not key.isidentifier() or keyword.iskeyword(key) for key in properties):
        return None
    equals = "[ ]?=[ ]?"
    if not properties:
        if parameters.get("additionalProperties") is False:
            return f"{regex.escape(name)}\\({WS}\\)"
        value = rules.schema({}, PYTHON)
        one = f"{rules.rule(python_identifier(rules.rule('[A-Za-z0-9_]*')))}{equals}{value}"
        return f"{regex.escape(name)}\\({WS}(?:{one}(?:{WS},{WS}{one})*{WS},?)?{WS}\\)"
    keywords = [(rules.rule(f"{regex.escape(key)}{equals}{rules.schema({**schema, **definitions}, PYTHON)}"),
                 key in required) for key, schema in properties.items()]
    listed = f"{_in_order(keywords)}{WS},?"  # (a trailing comma only after an argument)
    return f"{regex.escape(name)}\\({WS}{listed if any(needed for _, needed in keywords) else f'(?:{listed})?'}{WS}\\)"


_ID_START = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_"
_ID_CHARS = _ID_START + "0123456789"


@functools.cache
def python_identifier(tail: str = "[A-Za-z0-9_]*") -> str:
    """An ASCII name Python takes as a keyword argument: an identifier that is not one of its
    keywords (``class=1`` does not parse, and the reader takes such a call as text). Built
    from a trie of the keywords, no lookahead (the constraint machine reads none): at each
    node of the trie, the name may take a child's character and go on from there, take any
    other character and be free, or end where no keyword does. ``tail``: the expression of
    any identifier characters (a named rule's call keeps the expression short)."""
    trie: dict = {}
    for word in keyword.kwlist:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # a keyword ends here

    def others(chars: str, taken: dict) -> str:
        free = sorted(char for char in chars if char not in taken)
        runs: list[list[str]] = []  # contiguous characters as ranges: a short class reads fast
        for char in free:
            if runs and ord(char) == ord(runs[-1][-1]) + 1:
                runs[-1].append(char)
            else:
                runs.append([char])
        spans = "".join(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
        return f"[{spans}]{tail}"

    def after(node: dict) -> str:
        options = [f"{char}{after(child)}" for char, child in sorted(node.items()) if char]
        options.append(others(_ID_CHARS, node))
        group = "(?:" + "|".join(options) + ")"
        return group if "" in node else group + "?"

    return "(?:" + "|".join([f"{char}{after(child)}" for char, child in sorted(trie.items())] + [others(_ID_START, trie)]) + ")"


def _in_order(items: list[tuple[str, bool]]) -> str:
    """Comma-separated ``items`` (expression, required) in their order, at least one, each
    optional one present or not: an option for each optional item before the first required
    one (the one the list begins with), each item a named rule called, not copied."""
    def following(start: int) -> str:
        return "".join(f"{WS},{WS}{item}" if needed else f"(?:{WS},{WS}{item})?" for item, needed in items[start:])

    options = []
    for k, (item, needed) in enumerate(items):
        options.append(item + following(k + 1))
        if needed:
            break
    return "(?:" + "|".join(options) + ")"


class _Rules:
    """The schemas' expressions of one hold. An expression that holds several schemas (each
    tool's arguments, a call written twice in a list) defines the named rules they call once,
    in one block before it: a name defined twice does not compile."""

    def __init__(self, tools: list[Any]) -> None:
        self.tools = tools
        self.names = forced_names(tools, "required").names  # type: ignore[union-attr]  # (checked by call_hold)
        self.rules: dict[str, str] = {}
        self._roots: dict[tuple[str, Spelling], str] = {}  # a schema's text and spelling -> its root expression

    def schema(self, schema: dict[str, Any], spelling: Spelling = JSON) -> str:
        """``schema``'s expression, its values as JSON (or as ``spelling`` writes them)."""
        key = (json.dumps(schema), spelling)
        if key not in self._roots:
            root, rules = schema_parts(schema, f"s{len(self._roots)}_", spelling)
            self.rules.update(rules)  # (the rules of any JSON value are the same in every schema)
            self._roots[key] = f"(?:{root})"
        return self._roots[key]

    def rule(self, expression: str) -> str:
        """``expression`` as a named rule of its own, called where it is used (written once)."""
        name = f"r{len(self.rules)}"
        self.rules[name] = expression
        return f"(?&{name})"

    def call(self, arguments_key: str) -> str:
        """A call of any of the tools as JSON, ``{"name", arguments_key}``."""
        return self.schema(forced_call_schema(self.tools, "required", arguments_key))  # type: ignore[arg-type]

    def parameters(self, name: str) -> dict[str, Any]:
        return forced_call_schema(self.tools, {"type": "function", "function": {"name": name}}) or {}

    def arguments(self, name: str) -> str:
        """``name``'s arguments object as JSON."""
        return self.schema(self.parameters(name))

    def pattern(self, expression: str) -> str:
        return with_rules(expression, self.rules)


def _xml_call(name: str, rules: _Rules) -> str:
    """One call of ``name`` in Qwen3-Coder's XML: its parameters in the schema's order (the
    order a JSON call is held to as well), the required ones always, each other one at most once."""
    parameters = rules.parameters(name)
    properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
    required = set(parameters.get("required") or ()) if isinstance(parameters.get("required"), list) else set()
    definitions = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    written = ""
    for key, schema in properties.items():
        value = _xml_value(schema, definitions, rules)
        one = f"{regex.escape(PARAMETER_TAG + key)}>{value}{regex.escape(PARAMETER_END)}{GAP}"
        written += one if key in required else f"(?:{one})?"
    return f"{regex.escape(FUNCTION_TAG + name)}>{GAP}{written}{regex.escape(FUNCTION_END)}"


def _xml_value(schema: Any, definitions: dict[str, Any], rules: _Rules) -> str:
    """A parameter's value as the XML form writes it: a string's raw text (any text but the
    close tag; an enum's words), a typed value as JSON (read back by type, xml_calls.py)."""
    kind = value_kind(schema)
    if kind == "string":
        words = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if isinstance(words, list) and words and all(isinstance(w, str) for w in words):
            return "\\n?(?:" + "|".join(map(regex.escape, words)) + ")\\n?"
    if kind is None or kind == "string":
        bound = schema.get("maxLength") if kind == "string" else None
        # (a bound counts the expression's units, each a character or a "<" and what follows
        # it: about the characters, and a value that runs on is cut)
        return _text_without(PARAMETER_END, bound + 2 if isinstance(bound, int) and bound >= 0 else None)
    return f"{GAP}{rules.schema({**schema, **definitions})}{GAP}"


def _text_without(word: str, most: int | None = None) -> str:
    """The expression of any text in which ``word`` does not occur, for a ``word`` whose first
    character occurs nowhere else in it (a close tag): the automaton that searches for it, a
    state for each of its characters matched, written out. A value may hold a ``<`` (code
    does), only not its close tag. ``most``: at most that many of its units (a character, or
    the word's first character and what follows it up to a character that ends the match)."""
    first, n = word[0], len(word)
    assert first not in word[1:], word
    lit, other = regex.escape, lambda c: f"[^{regex.escape(c)}{regex.escape(first)}]"
    back, again, cut = other(word[n - 1]), lit(first), ""  # from k matched: to none, to the first again, the end
    for k in range(n - 2, 0, -1):
        back, again, cut = (f"(?:{other(word[k])}|{lit(word[k])}{back})", f"(?:{lit(first)}|{lit(word[k])}{again})",
                            f"(?:{lit(word[k])}{cut})?")
    units = "*" if most is None else f"{{0,{most}}}"
    return f"(?:[^{lit(first)}]|{lit(first)}{again}*{back}){units}(?:{lit(first)}{again}*{cut})?"
