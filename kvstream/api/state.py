"""The application state shared by the route handlers (typed aiohttp AppKey)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from kvstream.config import Settings
from kvstream.engine import KVStreamEngine


@dataclass
class AppState:
    """What every handler needs: the engine and the settings it was built from."""

    engine: KVStreamEngine
    settings: Settings


STATE = web.AppKey("kvstream_state", AppState)

# The requester's cache salt (set by the auth middleware when tenant isolation is on).
CACHE_SALT = web.RequestKey("cache_salt", str)
