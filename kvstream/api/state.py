"""The application state shared by the route handlers (typed aiohttp AppKey)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web

from kvstream.config import Settings
from kvstream.engine import Generation, KVStreamEngine


@dataclass
class AppState:
    """What every handler needs: the engine and the settings it was built from."""

    engine: KVStreamEngine
    settings: Settings
    # Exponential moving average of end-to-end request time, for Retry-After.
    recent_latency_s: float | None = None

    def observe_latency(self, gen: Generation) -> None:
        elapsed = time.monotonic() - gen.submitted_at
        prev = self.recent_latency_s
        self.recent_latency_s = elapsed if prev is None else 0.8 * prev + 0.2 * elapsed


STATE = web.AppKey("kvstream_state", AppState)
