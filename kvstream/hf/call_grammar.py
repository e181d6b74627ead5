"""A model's own tool calls held to the offered tools, from the moment it opens one.

With ``tool_choice: "auto"`` the model decides whether to call: its answer stays free text
(tool_call_syntax.py reads the calls out of it). A small model left free inside the call,
though, misspells a tool's name or writes arguments its schema refuses, and the client gets
a call it cannot run, or the call as text. So, as llama-server holds a template's calls with a
lazy grammar, the engine holds the answer from the opening tag on (lazy_grammar.py): every
call one of the offered tools, its arguments valid for that tool's parameters, the same
expression a forced call is held to (tool_calls.py); after the last call, only the end.

Held for the Hermes syntax (``<tool_call>{"name", "arguments"}</tool_call>``: Qwen2.5 and
Qwen3, Hermes, SmolLM3...). A tag written inside the model's thinking is not a call and does
not begin the hold: the trigger is a tag outside any ``<think>`` block. The other syntaxes are
read unheld.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import regex

from kvstream.hf.grammar import TOKEN_SENTINELS
from kvstream.hf.json_schema import compile_schema
from kvstream.hf.lazy_grammar import Triggers
from kvstream.hf.tool_call_syntax import CLOSE, OPEN, CallReading
from kvstream.hf.tool_calls import forced_call_schema

GAP = "[ \\t\\n]{0,4}"  # between the tags and the call, and between calls: a few blanks, never a run


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
    id -> text), which the expression references as those tokens."""
    if calls.syntax != "hermes":
        return None
    schema = forced_call_schema(tools, "required")
    if schema is None:
        return None
    tokens = {text: (token, chr(TOKEN_SENTINELS + k)) for k, (token, text) in enumerate(
        (t, s) for t, s in special_tags.items() if s in (OPEN, CLOSE))}

    def tag(text: str) -> str:
        return regex.escape(tokens[text][1]) if text in tokens else regex.escape(text)

    call = f"{tag(OPEN)}{GAP}(?:{compile_schema(schema).pattern}){GAP}{tag(CLOSE)}{GAP}"
    pattern = call if calls.single_call else f"(?:{call})+"
    # The opening tag outside a thinking block (the model's draft of a call is not one): the
    # tag's token where it is one (its text spelled by other tokens is not the tag).
    if OPEN in tokens:
        triggers = Triggers(tokens=frozenset({tokens[OPEN][0]}), thinking=thinking_opened)
    else:
        triggers = Triggers(words=(OPEN,), thinking=thinking_opened)
    return CallHold(pattern, triggers, tuple(tokens.values()))
