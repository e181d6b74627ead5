"""Exact prompt tokens from llama-server, without re-tokenizing a long conversation each turn.

llama-server's /tokenize costs about 4.5 microseconds per token here (7 ms for a
1,500-token system prompt), on the path of every request. Most chat requests extend a
conversation KVStream has seen: the same messages with one new message at the end. The
chat template renders those earlier messages as the same leading text, which ends where a
special token begins the next message, so the tokens of that text do not depend on what
follows. This cache keeps the tokens of such conversation prefixes (keyed by the messages
themselves) and sends only the new tail to /tokenize.

Exactness is checked, not assumed: a prefix's tokens must equal the head of a full
tokenization when they are learned, and the first time a prefix is used the spliced result
is compared with a full tokenization once more; a prefix that ever disagrees is never
spliced again.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class PrefixEntry:
    text: str  # the template's rendering of the earlier messages
    tokens: list[int]
    verified: bool | None = None  # None: not yet compared with a full tokenization


class ConversationTokenCache:
    """LRU of conversation-prefix tokens (see the module docstring)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.hits = 0
        self.mismatches = 0

    @staticmethod
    def keys(messages: list[dict[str, Any]]) -> list[str]:
        """Chained keys: ``keys[k]`` names the first k+1 messages."""
        out, parent = [], b""
        for message in messages:
            digest = hashlib.blake2b(parent + json.dumps(message, sort_keys=True, ensure_ascii=False).encode(), digest_size=16)
            parent = digest.digest()
            out.append(digest.hexdigest())
        return out

    def lookup(self, messages: list[dict[str, Any]], text: str) -> PrefixEntry | None:
        """The longest known conversation prefix of a request whose full rendering is
        ``text`` (the same conversation one or more turns later)."""
        keys = self.keys(messages[:-1])
        for key in reversed(keys):
            entry = self.entries.get(key)
            if entry is not None and entry.verified is not False and text.startswith(entry.text):
                self.entries.move_to_end(key)
                return entry
        return None

    def learn(self, head: list[dict[str, Any]], head_text: str, head_tokens: list[int], full_tokens: list[int]) -> None:
        """Remember the earlier messages' tokens if they agree with the full tokenization."""
        if not head_tokens or full_tokens[: len(head_tokens)] != head_tokens:
            return
        self.entries[self.keys(head)[-1]] = PrefixEntry(head_text, head_tokens)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
