"""The application state shared by the route handlers (typed aiohttp AppKey)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from kvstream.api.conversation_store import ConversationStore
from kvstream.api.response_store import ResponseStore
from kvstream.config import Settings
from kvstream.engine import KVStreamEngine


@dataclass
class AppState:
    """What every handler needs: the engine, the settings it was built from, and the
    Responses API's stored responses and conversations."""

    engine: KVStreamEngine
    settings: Settings
    responses: ResponseStore = field(init=False)
    conversations: ConversationStore = field(init=False)

    def __post_init__(self) -> None:
        server = self.settings.server
        self.responses = ResponseStore(server.responses_max_stored, server.responses_max_bytes)
        self.conversations = ConversationStore(server.responses_max_stored, server.responses_max_bytes)


STATE = web.AppKey("kvstream_state", AppState)


@dataclass
class KeyInFlight:
    """One API key's generations in flight, capped by ``server.max_concurrent_per_key``."""

    limit: int | None
    count: int = 0

    def take(self) -> bool:
        """Count one more; False (nothing counted) at the cap."""
        if self.limit is not None and self.count >= self.limit:
            return False
        self.count += 1
        return True

    def keep(self) -> None:
        """Count one more without the check: a request's own place passed on to the work it
        leaves running (a background response), before the request gives its place back."""
        self.count += 1

    def give(self) -> None:
        self.count -= 1


# The requester's key's generations in flight (set by the auth middleware where they are capped).
KEY_IN_FLIGHT = web.RequestKey("key_in_flight", KeyInFlight)
# The requester's cache salt (set by the auth middleware when tenant isolation is on).
CACHE_SALT = web.RequestKey("cache_salt", str)
