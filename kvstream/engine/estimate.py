"""Stand-in prompt tokens for runtimes that cannot tokenize for KVStream.

Counts from here are estimates and are named as such (/status ``kv.estimated``); the engine
measures their error against the usage the runtime reports (``EngineStats.estimate_error``).
"""

from __future__ import annotations

import zlib
from typing import Any

# Characters per token: the usual figure for English text with BPE vocabularies.
CHARS_PER_TOKEN = 4


def estimate_tokens(text: str) -> list[int]:
    """One stand-in id per CHARS_PER_TOKEN characters, each the CRC of its piece, so equal
    text prefixes give equal ids (and share blocks) while counts stay estimates."""
    return [zlib.crc32(text[i : i + CHARS_PER_TOKEN].encode()) for i in range(0, len(text), CHARS_PER_TOKEN)] or [0]


def flatten_messages(messages: list[dict[str, Any]]) -> str:
    """A template-like rendering of chat messages, for estimating only."""
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            # Only text parts count; what else a forwarded body holds is the runtime's to judge.
            content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        elif not isinstance(content, str):
            content = ""
        parts.append(f"<|{message.get('role')}|>\n{content}\n")
    return "".join(parts)
