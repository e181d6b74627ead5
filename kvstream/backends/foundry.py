"""Microsoft Foundry Local: OpenAI-compatible, on a port chosen at random each start.

The URL is discovered from Foundry's own CLI (``foundry server status``, or ``foundry
service status`` before CLI 0.10.2) and confirmed with ``GET /openai/status``; never by
scanning local ports (an earlier proxy picked up another proxy that way). Aliases such as
``phi-4-mini`` are mapped to model ids through ``/foundry/list``. Foundry serves requests one
at a time, so KVStream's queue is the only useful queue (parallel = 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any

from kvstream.config import Settings
from kvstream.types import BackendError, BackendUnavailable, GenerateRequest, RuntimeLimits
from kvstream.backends.http import UpstreamSession
from kvstream.backends.openai_compat import OpenAICompatibleBackend

logger = logging.getLogger(__name__)

_URL = re.compile(r"https?://(?:[a-zA-Z0-9.-]+|\d{1,3}(?:\.\d{1,3}){3}):\d+")
# The SDK's preference among variants of one alias: NPU, GPU, then CPU.
_DEVICE_ORDER = ("npu", "gpu", "cpu")


def parse_status_output(text: str) -> str | None:
    """The service URL (scheme://host:port, no path) in ``foundry server|service status``
    output, or None when the service is not running."""
    match = _URL.search(text)
    return match.group(0) if match else None


async def discover_url(timeout: float = 10.0) -> str | None:
    """Ask the foundry CLI where the service listens; None if it is not installed or not up."""
    for args in (("server", "status"), ("service", "status")):
        try:
            proc = await asyncio.create_subprocess_exec(
                "foundry", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
        except FileNotFoundError:
            return None
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            continue
        url = parse_status_output(out.decode("utf-8", "replace"))
        if url:
            return url
    return None


def resolve_alias(name: str, catalog: list[dict[str, Any]]) -> str | None:
    """A model id for ``name``: an exact id, the highest ``id:version``, or an alias's best
    variant (NPU before GPU before CPU), as the Foundry SDK resolves them."""
    lowered = name.lower()
    for entry in catalog:
        if str(entry.get("name", "")).lower() == lowered:
            return entry["name"]
    versions = [e for e in catalog if str(e.get("name", "")).lower().startswith(lowered + ":")]
    if versions:
        return max(versions, key=lambda e: int(str(e["name"]).rsplit(":", 1)[1] or 0))["name"]
    variants = [e for e in catalog if str(e.get("alias", "")).lower() == lowered]

    def rank(entry: dict[str, Any]) -> int:
        device = str((entry.get("runtime") or {}).get("deviceType", "")).lower()
        return _DEVICE_ORDER.index(device) if device in _DEVICE_ORDER else len(_DEVICE_ORDER)

    return min(variants, key=rank)["name"] if variants else None


class FoundryBackend(OpenAICompatibleBackend):
    """Adapter for Foundry Local."""

    name = "foundry"
    default_url = None
    health_path = "/openai/status"

    def __init__(
        self, base_url: str | None = None, model: str | None = None, settings: Settings | None = None, **overrides: Any
    ) -> None:
        super().__init__(base_url, model, settings, **overrides)
        self._explicit_url = bool(base_url)
        self._model_ids: dict[str, str] = {}

    async def start(self) -> None:
        if not self.base_url:
            self.base_url = (await discover_url()) or ""
            if self.base_url:
                logger.info("foundry: service found at %s", self.base_url)
        await super().start()

    async def _rediscover(self) -> bool:
        """Foundry picks a new port on every start: look again after a connection failure."""
        if self._explicit_url:
            return False
        url = await discover_url()
        if not url or url == self.base_url:
            return False
        logger.info("foundry: service moved to %s", url)
        old = self.session
        self.base_url = url
        await super().start()
        if old is not None:
            await old.close()
        return True

    @property
    def http(self) -> UpstreamSession:
        if not self.base_url:
            raise BackendUnavailable("Foundry Local is not running (no URL from `foundry server status`)")
        return super().http

    async def health(self) -> bool:
        if not self.base_url and not await self._rediscover():
            return False
        try:
            payload = await self.http.get_json("/openai/status", timeout=3.0)
        except BackendError:
            return await self._rediscover() and await self.health()
        return isinstance(payload, dict) and "Endpoints" in payload

    async def model_id(self, name: str | None) -> str | None:
        if not name:
            return None
        if name not in self._model_ids:
            try:
                catalog = await self.http.get_json("/foundry/list")
            except BackendError:
                catalog = []
            self._model_ids[name] = resolve_alias(name, catalog if isinstance(catalog, list) else []) or name
        return self._model_ids[name]

    def build_body(self, request: GenerateRequest) -> dict[str, Any]:
        body = super().build_body(request)
        if body["model"] in self._model_ids:
            body["model"] = self._model_ids[body["model"]]
        return body

    async def generate(self, request: GenerateRequest):  # type: ignore[override]
        await self.model_id(request.model or self.model)
        async with contextlib.aclosing(super().generate(request)) as tokens:
            async for token in tokens:
                yield token

    async def limits(self) -> RuntimeLimits:
        return RuntimeLimits(parallel=1)
