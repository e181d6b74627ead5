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

# The requester's cache salt (set by the auth middleware when tenant isolation is on).
CACHE_SALT = web.RequestKey("cache_salt", str)
