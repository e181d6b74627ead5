"""The hottest shared prefixes, so that a runtime that lost its caches gets them back first.

A runtime that restarts or reloads its model (Ollama reports a ``load_duration`` of
seconds; the llama-server KVStream manages restarts) starts with empty prompt caches, and
the next request of every tenant pays its whole system prompt again. KVStream remembers the
prefixes most requests shared (the leading system messages of chat requests, per model and
tenant) and re-prefills the few hottest through the warm path (low priority, one token
each) as soon as it learns of the reload, before they are asked for.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvstream.jsonfast import dumps
from kvstream.types import GenerateRequest

# A prefix shorter than this many characters is not worth a warm request (~64 tokens).
MIN_PREFIX_CHARS = 256
# Prefixes remembered; the least recently seen is forgotten first.
MAX_TRACKED = 64


@dataclass
class _Entry:
    model: str | None
    cache_salt: str | None
    messages: list[dict]
    hits: float = 0.0
    seen_at: float = field(default_factory=time.monotonic)


class HotPrefixes:
    """Counts of the chat prefixes requests shared, decayed with age (half-life
    ``half_life_s``), so that "hottest" means frequent and recent."""

    def __init__(self, half_life_s: float = 600.0) -> None:
        self.half_life_s = half_life_s
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()

    @staticmethod
    def prefix_of(request: GenerateRequest) -> list[dict] | None:
        """The request's leading system messages, if long enough to be worth keeping warm."""
        messages = request.messages or []
        head = []
        for message in messages[:-1]:  # the last message is the request's own
            if message.get("role") not in ("system", "developer"):
                break
            head.append(message)
        size = sum(len(dumps(m.get("content"))) for m in head)
        return head if head and size >= MIN_PREFIX_CHARS else None

    def observe(self, request: GenerateRequest) -> None:
        """Count ``request``'s prefix (requests KVStream itself sends to warm are not)."""
        if request.prefix_only:
            return
        head = self.prefix_of(request)
        if head is None:
            return
        key = dumps([request.model, request.cache_salt, head])
        now = time.monotonic()
        entry = self._entries.pop(key, None) or _Entry(request.model, request.cache_salt, head)
        entry.hits = self._decayed(entry, now) + 1.0
        entry.seen_at = now
        self._entries[key] = entry
        while len(self._entries) > MAX_TRACKED:
            self._entries.popitem(last=False)

    def top(self, k: int) -> list[GenerateRequest]:
        """The ``k`` hottest prefixes as warm requests (hottest first)."""
        now = time.monotonic()
        ranked = sorted(self._entries.values(), key=lambda e: self._decayed(e, now), reverse=True)[:k]
        return [
            GenerateRequest(model=e.model, messages=[dict(m) for m in e.messages], cache_salt=e.cache_salt) for e in ranked
        ]

    def __len__(self) -> int:
        return len(self._entries)

    def _decayed(self, entry: _Entry, now: float) -> float:
        return entry.hits * 0.5 ** ((now - entry.seen_at) / self.half_life_s)
