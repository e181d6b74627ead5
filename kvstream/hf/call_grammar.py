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
  one call a mark (later ones).

A call opened inside the model's thinking is a draft, not a call, and does not start the hold
(the trigger counts outside ``<think>`` blocks). An opening the expression cannot begin with
(blanks it does not allow) leaves the answer unheld, read as before; so do tools whose
expression cannot be followed. DeepSeek's, Qwen3-Coder's XML and the pythonic lists are read
unheld.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import regex

from kvstream.hf.grammar import TOKEN_SENTINELS
from kvstream.hf.json_schema import compile_schema
from kvstream.hf.lazy_grammar import Triggers
from kvstream.hf.pattern_constraint import PatternError, compile_pattern
from kvstream.hf.tool_call_syntax import CLOSE, GRANITE_CALLS, MISTRAL_ARGS, MISTRAL_CALLS, OPEN, PYTHON_TAG, CallReading
from kvstream.hf.tool_calls import forced_call_schema, forced_names

# The syntaxes held, each with the tags its expression writes (referenced where they are tokens).
HELD_TAGS = {"hermes": (OPEN, CLOSE), "llama3_json": (), "granite": (GRANITE_CALLS,), "mistral": (MISTRAL_CALLS, MISTRAL_ARGS)}

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
    other tokens is not the tag."""
    if calls.syntax not in HELD_TAGS:
        return None
    schema = forced_call_schema(tools, "required", "parameters" if calls.syntax == "llama3_json" else "arguments")
    if schema is None:
        return None
    hold = _hold(calls, tools, schema, thinking_opened, special_tags)
    try:
        compile_pattern(hold.pattern)
    except PatternError:  # (tools whose schemas the expression cannot hold together: read unheld)
        return None
    return hold


def _hold(calls: CallReading, tools: Any, schema: dict[str, Any], thinking_opened: bool | None,
          special_tags: dict[int, str]) -> CallHold:
    call = f"(?:{compile_schema(schema).pattern})"
    tags = {text: (token, chr(TOKEN_SENTINELS + k)) for k, (token, text) in enumerate(
        (t, s) for t, s in special_tags.items() if s in HELD_TAGS[calls.syntax])}

    def tag(text: str) -> str:
        return regex.escape(tags[text][1]) if text in tags else regex.escape(text)

    def opened_by(text: str) -> Triggers:  # the tag's token where it is one, else its text
        if text in tags:
            return Triggers(tokens=frozenset({tags[text][0]}), thinking=thinking_opened, strict=False)
        return Triggers(words=(text,), thinking=thinking_opened, strict=False)

    several = not calls.single_call
    if calls.syntax == "hermes":
        one = f"{tag(OPEN)}{GAP}{call}{GAP}{tag(CLOSE)}{GAP}"
        return CallHold(f"(?:{one})+" if several else one, opened_by(OPEN), tuple(tags.values()))
    listed = f"\\[{GAP}{call}(?:{GAP},{GAP}{call})*{GAP}\\]{GAP}" if several else f"\\[{GAP}{call}{GAP}\\]{GAP}"
    if calls.syntax == "granite":
        return CallHold(f"{tag(GRANITE_CALLS)}{GAP}{listed}", opened_by(GRANITE_CALLS), tuple(tags.values()))
    if calls.syntax == "mistral":
        named = "|".join(
            f"{regex.escape(name)}{tag(MISTRAL_ARGS)}(?:{compile_schema(forced_call_schema(tools, _named(name))).pattern})"
            for name in forced_names(tools, "required").names)
        one = f"{tag(MISTRAL_CALLS)}(?:{named}){GAP}"
        pattern = f"{tag(MISTRAL_CALLS)}{GAP}{listed}|{f'(?:{one})+' if several else one}"
        return CallHold(f"(?:{pattern})", opened_by(MISTRAL_CALLS), tuple(tags.values()))
    # Llama 3: the answer itself is the calls (a thinking model's, after its block: not one of these).
    joined = f"{call}(?:{GAP};{GAP}{call})*" if several else call
    return CallHold(f"{joined}{GAP}", Triggers(patterns=(LLAMA3_OPENING,), strict=False))


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}
