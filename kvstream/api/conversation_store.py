"""OpenAI's conversations (``/v1/conversations``), where KVStream answers the Responses API
itself: a conversation is a list of items that a response made with ``conversation`` reads
before its input, and to which that response's input and output are added.

Held in memory like stored responses (response_store.py; kept across a restart with them by
responses_file.py), bounded by count and by bytes (its items' JSON), least recently used first out, each owned by the cache salt
of the key that made it.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvstream.jsonfast import dumps

MAX_METADATA = 16  # key-value pairs, as OpenAI's


def conversation_id() -> str:
    return "conv_" + secrets.token_hex(24)


@dataclass
class Conversation:
    """One conversation: its items in order, each with an ``id``."""

    id: str
    owner: str | None
    metadata: dict[str, str]
    created_at: int = field(default_factory=lambda: int(time.time()))
    items: list[dict[str, Any]] = field(default_factory=list)
    size: int = 0  # bytes of its items and metadata, as JSON

    def public(self) -> dict[str, Any]:
        """The conversation object OpenAI answers with."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


class ConversationStore:
    """Conversations by id, least recently used evicted past ``max_conversations`` or
    ``max_bytes``; 0 conversations: none can be made."""

    def __init__(self, max_conversations: int, max_bytes: int) -> None:
        self.max_conversations = max_conversations
        self.max_bytes = max_bytes
        self._conversations: OrderedDict[str, Conversation] = OrderedDict()
        self.bytes = 0
        self.evicted = 0
        self.changes = 0  # counts every change of what is stored (responses_file writes when it moved)

    def __len__(self) -> int:
        return len(self._conversations)

    def values(self) -> list[Conversation]:
        """Every conversation, the least recently used first."""
        return list(self._conversations.values())

    def clear(self) -> None:
        self._conversations.clear()
        self.bytes = 0
        self.changes += 1

    @property
    def enabled(self) -> bool:
        return self.max_conversations > 0

    def create(self, owner: str | None, metadata: dict[str, str], items: list[dict[str, Any]]) -> Conversation:
        conversation = Conversation(conversation_id(), owner, metadata)
        self._conversations[conversation.id] = conversation
        self._resize(conversation, len(dumps(metadata)))
        self.add(conversation, items)
        return conversation

    def restore(self, conversation: Conversation, items: list[dict[str, Any]]) -> None:
        """Keep ``conversation`` (read back from a file: it has its id) with ``items``."""
        self._conversations[conversation.id] = conversation
        self._resize(conversation, len(dumps(conversation.metadata)))
        self.add(conversation, items)

    def get(self, owner: str | None, conversation_id: str) -> Conversation | None:
        """``owner``'s conversation (now the most recently used), or None."""
        conversation = self._conversations.get(conversation_id)
        if conversation is None or conversation.owner != owner:
            return None
        self._conversations.move_to_end(conversation_id)
        return conversation

    def full(self, conversation: Conversation) -> bool:
        """Whether ``conversation`` alone holds the whole byte budget: it takes no new turn
        (one turn may take it past the budget; none takes it further)."""
        return conversation.size >= self.max_bytes

    def add(self, conversation: Conversation, items: list[dict[str, Any]]) -> None:
        """Append ``items`` (each with an ``id``) to ``conversation``."""
        conversation.items += items
        self._resize(conversation, sum(len(dumps(item)) for item in items))

    def remove_item(self, conversation: Conversation, item_id: str) -> bool:
        for index, item in enumerate(conversation.items):
            if item.get("id") == item_id:
                del conversation.items[index]
                self._resize(conversation, -len(dumps(item)))
                return True
        return False

    def set_metadata(self, conversation: Conversation, metadata: dict[str, str]) -> None:
        self._resize(conversation, len(dumps(metadata)) - len(dumps(conversation.metadata)))
        conversation.metadata = metadata

    def delete(self, owner: str | None, conversation_id: str) -> bool:
        conversation = self.get(owner, conversation_id)
        if conversation is None:
            return False
        del self._conversations[conversation_id]
        self.bytes -= conversation.size
        self.changes += 1
        return True

    def _resize(self, conversation: Conversation, change: int) -> None:
        """Count ``change`` bytes to ``conversation``, then evict the least recently used
        others while over a bound (never the one just changed: it is in use)."""
        conversation.size += change
        self.bytes += change
        self.changes += 1
        while len(self._conversations) > 1 and (len(self._conversations) > self.max_conversations or self.bytes > self.max_bytes):
            oldest_id = next(iter(self._conversations))
            if oldest_id == conversation.id:
                self._conversations.move_to_end(oldest_id)
                oldest_id = next(iter(self._conversations))
            oldest = self._conversations.pop(oldest_id)
            self.bytes -= oldest.size
            self.evicted += 1

    def describe(self) -> dict[str, Any]:
        """The store in /status."""
        return {"stored": len(self._conversations), "bytes": self.bytes, "evicted": self.evicted}
