"""The engine's per-token log-probabilities in OpenAI's two shapes.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}``. Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token:
logprob}], "text_offset"}``. Each streamed chunk carries its token's; a non-streamed answer
joins them (``openai_format.join_logprobs``).

A token's ``bytes`` are its own bytes, which for a byte-level BPE vocabulary (GPT-2's, Llama
3's, SmolLM2's) may be part of a character: its string is those bytes decoded, a partial
character shown as U+FFFD, and a client joins ``bytes`` to get the exact text.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from kvstream.hf.sampling import TokenLogprobs

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's alphabet: printable bytes stand for themselves, the other 68 bytes
    for the characters from U+0100 up, in byte order (the GPT-2 scheme)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class LogprobFormatter:
    """Builds one request's logprobs objects (one formatter per request: completions'
    ``text_offset`` runs on per choice)."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self._offsets: dict[int, int] = {}
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for."""
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        table = _unicode_to_byte()
        if (match := _BYTE_TOKEN.fullmatch(piece)) is not None:
            raw = bytes([int(match.group(1), 16)])
        elif piece and all(ch in table for ch in piece):
            raw = bytes(table[ch] for ch in piece)
        else:  # SentencePiece pieces: "▁" is a space
            raw = piece.replace("\u2581", " ").encode()
        self._bytes[token_id] = raw
        return raw

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    def format(self, token_id: int, logprobs: TokenLogprobs, index: int = 0) -> dict[str, Any]:
        """The logprobs object of one chunk: token ``token_id`` of choice ``index``."""
        entry = self._entry(token_id, logprobs.logprob)
        if self.chat:
            entry["top_logprobs"] = [self._entry(tid, lp) for tid, lp in logprobs.top]
            return {"content": [entry]}
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(entry["token"])
        return {
            "tokens": [entry["token"]],
            "token_logprobs": [logprobs.logprob],
            "top_logprobs": [{self._entry(tid, lp)["token"]: lp for tid, lp in logprobs.top}],
            "text_offset": [offset],
        }
