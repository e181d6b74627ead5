"""What a chat answer holds besides its content, read as it streams: a reasoning model's
thinking (reasoning.py), then, in what follows it, the model's own tool calls
(tool_call_syntax.py). Each choice of a request gets its own ``AnswerReader``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstream.hf import deepseek_calls, pythonic_calls
from kvstream.hf.generic_calls import GENERIC, GenericAnswerScanner
from kvstream.hf.reasoning import END_THINK, THINK, ThinkingScanner, opened_in_prompt, thinks
from kvstream.hf.tool_call_syntax import (
    CLOSE,
    GRANITE_CALLS,
    MISTRAL_ARGS,
    MISTRAL_CALLS,
    OPEN,
    PYTHON_TAG,
    CallReading,
    Piece,
    call_reading,
)

TAGS = (OPEN, CLOSE, PYTHON_TAG, MISTRAL_CALLS, MISTRAL_ARGS, GRANITE_CALLS, THINK, END_THINK, *deepseek_calls.TAGS,
        pythonic_calls.PYTHON_START, pythonic_calls.PYTHON_END)
PROMPT_TAIL_TOKENS = 16  # of the prompt, decoded to see whether it opened a thinking block


@dataclass(frozen=True)
class AnswerReading:
    """How one request's answers are read: for calls (None: not), for thinking (None: not;
    else whether the prompt opened the block), and the text of tag tokens the tokenizer
    marks special (the detokenizer skips those: they are put back from their ids, as vLLM
    keeps special tokens for its parsers)."""

    calls: CallReading | None = None
    thinking_opened: bool | None = None
    tag_texts: dict[int, str] = field(default_factory=dict)

    def reader(self) -> AnswerReader:
        return AnswerReader(self)


def answer_reading(tokenizer: Any, extra: dict[str, Any], prompt_ids: list[int], call_syntax: str = "auto") -> AnswerReading | None:
    """How a chat request's answers are read (``extra``: its fields beyond the core ones,
    ``prompt_ids``: its rendered prompt, ``call_syntax``: as call_reading takes it); None
    when there is nothing to read."""
    template = getattr(tokenizer, "chat_template", None)
    calls = call_reading(tokenizer, extra, call_syntax)
    opened = None
    if thinks(template):
        opened = opened_in_prompt(tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
    if calls is None and opened is None:
        return None
    return AnswerReading(calls, opened, special_tag_texts(tokenizer))


def special_tag_texts(tokenizer: Any) -> dict[int, str]:
    """Token id -> text of the tags that are single tokens of ``tokenizer`` which the
    detokenizer skips (special: whether listed among its special tokens or only marked so)."""
    out = {}
    for tag in TAGS:
        token_id = tokenizer.convert_tokens_to_ids(tag)
        if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
            continue
        if tokenizer.convert_ids_to_tokens(token_id) == tag and not tokenizer.decode([token_id], skip_special_tokens=True):
            out[token_id] = tag
    return out


class AnswerReader:
    """One choice's answer: its text in, pieces of thinking, content and calls out."""

    def __init__(self, reading: AnswerReading) -> None:
        self.tag_texts = reading.tag_texts
        self.single_call = reading.calls is not None and reading.calls.single_call
        self._thinking = None if reading.thinking_opened is None else ThinkingScanner(reading.thinking_opened)
        calls = reading.calls
        self._calls = None if calls is None else GenericAnswerScanner() if calls.syntax == GENERIC else calls.scanner()
        # Tokens read inside the thinking block, its opening and closing tags' included.
        self.reasoning_tokens = 0
        self._undecided = 0  # tokens read while the text may still open a block (a "<think>" in pieces)

    @property
    def calls(self) -> int:
        """Calls read so far."""
        return 0 if self._calls is None else self._calls.calls

    def _count(self, before: str, after: str) -> None:
        """Count a generated token that took the thinking scanner from mode ``before`` to
        ``after``: thinking if it was read inside the block or opened it; the tokens that
        spelled an opening tag in pieces count once the tag is whole."""
        if after == "maybe":
            self._undecided += 1
            return
        if before == "thinking" or after == "thinking" or (before == "maybe" and after == "after"):
            self.reasoning_tokens += 1 + (self._undecided if before == "maybe" else 0)
        if before == "maybe":
            self._undecided = 0

    def read(self, token_id: int | None, text: str, end: bool = False, generated: bool = True) -> list[Piece]:
        """The pieces the token ``token_id`` (spelled ``text``) completes; with ``end``, the
        rest. A thinking piece may be empty: the block's end, the text held until then spent.
        ``generated``: the token counts as generated (not an end-of-sequence token that
        stopped the answer), so it is counted in ``reasoning_tokens`` when it is thinking."""
        text = self.tag_texts.get(token_id, text) if token_id is not None else text
        if self._thinking is None:
            parts = [Piece(text=text)]
        else:
            before = self._thinking.mode
            parts = self._thinking.feed(text)
            if generated and token_id is not None:
                self._count(before, self._thinking.mode)
            parts += self._thinking.finish() if end else []
        if self._calls is None:
            return [part for part in parts if part.text or part.reasoning]
        pieces: list[Piece] = []
        for part in parts:
            pieces += [part] if part.reasoning else self._calls.feed(part.text)
        if end:
            pieces += self._calls.finish()
        if self.single_call:  # parallel_tool_calls false: the first call only
            pieces = [p for p in pieces if p.call is None or not p.call["index"]]
        return pieces
