"""A reasoning model's thinking, split from its answer as it streams (``reasoning_content``).

Reasoning models (Qwen3, DeepSeek-R1 and its distillations, SmolLM3, Phi-4-reasoning...)
think inside ``<think>...</think>`` before they answer, and their chat templates say so. The
thinking goes out as ``reasoning_content`` deltas (vLLM's, DeepSeek's and llama-server's
field; Ollama's ``thinking``), the answer after ``</think>`` as content, so a client shows
the answer and not the scratch work. Some templates open the block in the prompt itself
(the generation prompt ends with ``<think>``): the answer then starts inside it. Otherwise
an answer that opens with ``<think>`` starts one; any other answer is content throughout.
A block never closed (cut by ``max_tokens``) is all thinking, as vLLM reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstream.hf.tool_call_syntax import Piece, _tag_prefix_length

THINK = "<think>"
END_THINK = "</think>"
# Template keyword arguments a request may set (``chat_template_kwargs``, vLLM's and
# llama-server's field): not the ones the engine sets itself.
RESERVED_TEMPLATE_ARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "return_dict",
                                    "continue_final_message", "conversation", "chat_template", "documents"})


def thinks(chat_template: Any) -> bool:
    """Whether the chat template (a string, or a tokenizer's named templates) shows the model
    ``<think>`` blocks."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    return any(isinstance(t, str) and THINK in t for t in templates)


def opened_in_prompt(prompt_tail: str) -> bool:
    """Whether the prompt's last text (its generation prompt) leaves a ``<think>`` block open."""
    return prompt_tail.rfind(THINK) > prompt_tail.rfind(END_THINK)


@dataclass
class ThinkingScanner:
    """One choice's text, split into thinking and content (``feed``, then ``finish``)."""

    opened: bool = False  # the prompt opened the block: the answer starts inside it
    _mode: str = ""  # "maybe" (not known yet), "thinking", "after" (just closed), "content"
    _pending: str = ""
    _thought: bool = False  # some thinking went out (the whitespace opening the block does not)

    def __post_init__(self) -> None:
        self._mode = "thinking" if self.opened else "maybe"

    @property
    def mode(self) -> str:
        """"maybe" (the text so far may still open a block), "thinking" (inside one), "after"
        (just closed), "content"."""
        return self._mode

    def feed(self, text: str) -> list[Piece]:
        if self._mode == "content":
            return [Piece(text=text)] if text else []
        self._pending += text
        out: list[Piece] = []
        if self._mode == "maybe":
            start = self._pending.lstrip()
            if not start or (THINK.startswith(start) and start != THINK):
                return out  # nothing yet says which
            if not start.startswith(THINK):
                self._mode = "content"
                text, self._pending = self._pending, ""
                return [Piece(text=text)]
            self._mode, self._pending = "thinking", start[len(THINK):]
        if self._mode == "thinking":
            if not self._thought:
                self._pending = self._pending.lstrip()
            end = self._pending.find(END_THINK)
            if end < 0:
                keep = _tag_prefix_length(self._pending, END_THINK)
                head = self._pending[: len(self._pending) - keep]
                if head:
                    out.append(Piece(text=head, reasoning=True))
                    self._pending, self._thought = self._pending[len(head):], True
                return out
            # The block's end, even with no text left to send: the tokens held until now
            # (the end tag's) were thinking.
            thought = self._pending[:end].rstrip()
            out.append(Piece(text=thought if thought.strip() else "", reasoning=True))
            self._mode, self._pending = "after", self._pending[end + len(END_THINK):]
        if self._mode == "after":  # the whitespace between the block and the answer is layout
            self._pending = self._pending.lstrip()
            if self._pending:
                self._mode = "content"
                out.append(Piece(text=self._pending))
                self._pending = ""
        return out

    def finish(self) -> list[Piece]:
        text, self._pending = self._pending, ""
        if self._mode == "thinking":
            text = text if self._thought else text.lstrip()
            return [Piece(text=text, reasoning=True)] if text.strip() else []
        if self._mode == "maybe" and text:
            return [Piece(text=text)]
        return []
