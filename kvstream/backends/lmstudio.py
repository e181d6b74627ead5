"""LM Studio's OpenAI-compatible server (default port 1234).

Quirks (protocols.md section 4): unknown routes answer 200, so health is probed on
/v1/models; /api/v0/models tells which model is loaded and its context length; "Max
Concurrent Predictions" defaults to 4 and is not reported, so it is a backend option. The
server keeps the last port it was started with (``lms server start --port N``): without an
explicit URL, KVStream asks ``lms server status --json --quiet`` where it is.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kvstream.config import Settings
from kvstream.types import BackendError, RuntimeLimits
from kvstream.backends.http import cli_output
from kvstream.backends.openai_compat import OpenAICompatibleBackend


logger = logging.getLogger(__name__)


async def discover_port(timeout: float = 10.0) -> int | None:
    """The port LM Studio's server runs on, from its CLI; None when the CLI is missing, the
    server is not running, or the answer is not what ``lms`` prints."""
    out = await cli_output("lms", "server", "status", "--json", "--quiet", timeout=timeout)
    if out is None:
        return None
    try:
        status = json.loads(out)
    except ValueError:
        return None
    port = status.get("port") if isinstance(status, dict) and status.get("running") is True else None
    return port if isinstance(port, int) and 0 < port < 65536 else None


class LMStudioBackend(OpenAICompatibleBackend):
    """Adapter for LM Studio's server."""

    name = "lmstudio"
    may_keep_ollama_store = False
    default_url = "http://127.0.0.1:1234"

    def __init__(
        self, base_url: str | None = None, model: str | None = None, settings: Settings | None = None, **overrides: Any
    ) -> None:
        super().__init__(base_url, model, settings, **overrides)
        self.parallel = self.settings.backend.parallel or 4
        self._explicit_url = bool(base_url)

    async def start(self) -> None:
        if not self._explicit_url:
            port = await discover_port()
            if port is not None and f"http://127.0.0.1:{port}" != self.base_url:
                self.base_url = f"http://127.0.0.1:{port}"
                logger.info("lmstudio: `lms server status` says the server is at %s", self.base_url)
        await super().start()

    async def identify(self) -> bool:
        """LM Studio answers its own REST API, ``/api/v0/models``, with each model's type and
        load state (any route answers 200 there, so the shape is what tells)."""
        payload = await self.http.probe_json("/api/v0/models")
        data = payload.get("data") if isinstance(payload, dict) else None
        return isinstance(data, list) and all(isinstance(m, dict) and "state" in m and "type" in m for m in data)

    async def limits(self) -> RuntimeLimits:
        n_ctx = None
        try:
            payload = await self.http.get_json("/api/v0/models")
        except BackendError:
            payload = {}
        for m in payload.get("data", []) if isinstance(payload, dict) else []:
            if not isinstance(m, dict) or m.get("type") == "embeddings":
                continue
            if (self.model is None and m.get("state") == "loaded") or m.get("id") == self.model:
                n_ctx = m.get("max_context_length")
                break
        n_ctx = int(n_ctx) if n_ctx else None
        return RuntimeLimits(
            n_ctx_total=n_ctx * self.parallel if n_ctx else None, n_ctx_per_request=n_ctx, parallel=self.parallel
        )
