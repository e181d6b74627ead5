"""The responses KVStream answered itself, kept so that a client can continue one
(``previous_response_id``), read it again (``GET /v1/responses/{id}``), list what it was
given (``.../input_items``) and delete it, as OpenAI's Responses API does with ``store``.

Held in memory (written to a file at a graceful stop and read back at start where
``server.responses_file`` says: responses_file.py), bounded by count and by bytes, least
recently used first out. A response keeps the whole conversation it continued as references
to the earlier turns' items (shared, not copied), so that a conversation survives its earlier
responses leaving the store; the bytes counted are each response's own items. Every response belongs
to the cache salt of the key that made it (tenant isolation): another key's request does not
find it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvstream.jsonfast import dumps


@dataclass(frozen=True)
class StoredResponse:
    """One stored response and the items it was made from."""

    response: dict[str, Any]
    context: tuple[dict[str, Any], ...]  # the earlier turns' input and output items it continued
    input_items: tuple[dict[str, Any], ...]  # what its own request added
    owner: str | None  # the cache salt of the key that made it
    size: int  # bytes of its own items (the response, its input, its events), as JSON
    # Every event a background response created with ``stream: true`` sent, for streaming it
    # again; None for any other.
    events: tuple[dict[str, Any], ...] | None = None

    def conversation(self) -> tuple[dict[str, Any], ...]:
        """Every item up to and including this response's output: what a continuation of
        it is prompted with before its own input."""
        return self.context + self.input_items + tuple(self.response["output"])


class ResponseStore:
    """Stored responses by id, least recently used evicted past ``max_responses`` or
    ``max_bytes``. 0 responses: nothing is stored."""

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0
        self.evicted = 0
        self.changes = 0  # counts every change of what is stored (responses_file writes when it moved)

    def __len__(self) -> int:
        return len(self._responses)

    def values(self) -> list[StoredResponse]:
        """Every stored response, the least recently used first."""
        return list(self._responses.values())

    def clear(self) -> None:
        self._responses.clear()
        self.bytes = 0
        self.changes += 1

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def put(self, owner: str | None, response: dict[str, Any], context: tuple[dict[str, Any], ...],
            input_items: tuple[dict[str, Any], ...], events: tuple[dict[str, Any], ...] | None = None) -> bool:
        """Keep ``response``; False when it is larger than the whole budget (kept not at all)."""
        size = len(dumps(response)) + len(dumps(list(input_items))) + (len(dumps(list(events))) if events else 0)
        if not self.enabled or size > self.max_bytes:
            return False
        self._drop(response["id"])
        self._responses[response["id"]] = StoredResponse(response, context, input_items, owner, size, events)
        self.changes += 1
        self.bytes += size
        while len(self._responses) > self.max_responses or self.bytes > self.max_bytes:
            _, oldest = self._responses.popitem(last=False)
            self.bytes -= oldest.size
            self.evicted += 1
        return True

    def get(self, owner: str | None, response_id: str) -> StoredResponse | None:
        """The response ``owner`` stored under ``response_id`` (now the most recently used),
        or None."""
        stored = self._responses.get(response_id)
        if stored is None or stored.owner != owner:
            return None
        self._responses.move_to_end(response_id)
        return stored

    def find_item(self, owner: str | None, item_id: str) -> dict[str, Any] | None:
        """The item ``owner``'s stored responses hold (in their input, output or the
        conversation they continued) under ``item_id``, the newest first; None if none does."""
        for stored in reversed(self._responses.values()):
            if stored.owner != owner:
                continue
            for item in (*stored.response["output"], *stored.input_items, *stored.context):
                if item.get("id") == item_id:
                    return item
        return None

    def delete(self, owner: str | None, response_id: str) -> bool:
        """Forget ``owner``'s response ``response_id``; False when there was none."""
        if self.get(owner, response_id) is None:
            return False
        self._drop(response_id)
        self.changes += 1
        return True

    def _drop(self, response_id: str) -> None:
        stored = self._responses.pop(response_id, None)
        if stored is not None:
            self.bytes -= stored.size

    def describe(self) -> dict[str, Any]:
        """The store in /status."""
        return {"stored": len(self._responses), "bytes": self.bytes, "max_responses": self.max_responses,
                "max_bytes": self.max_bytes, "evicted": self.evicted}
