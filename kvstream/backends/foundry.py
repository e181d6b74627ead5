"""Microsoft Foundry Local: OpenAI-compatible, on a port chosen at random each start.

The URL is discovered from Foundry's own CLI (``foundry server status``, or ``foundry
service status`` before CLI 0.10.2) and confirmed with ``GET /openai/status``; never by
scanning local ports (an earlier proxy picked up another proxy that way). Aliases such as
``phi-4-mini`` are mapped to model ids through ``/foundry/list``. Foundry serves requests one
at a time, so KVStream's queue is the only useful queue (parallel = 1).
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

from kvstream.config import Settings
from kvstream.types import BackendError, BackendUnavailable, GenerateRequest, ModelInfo, RuntimeLimits
from kvstream.backends.http import UpstreamSession, cli_output, raise_for_upstream_status
from kvstream.backends.openai_compat import OpenAICompatibleBackend

logger = logging.getLogger(__name__)

_URL = re.compile(r"https?://(?:[a-zA-Z0-9.-]+|\d{1,3}(?:\.\d{1,3}){3}):\d+")
# How long Foundry keeps a model KVStream loaded once idle (the SDK's default).
LOAD_TTL_S = 600
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
        out = await cli_output("foundry", *args, timeout=timeout)
        url = parse_status_output(out) if out is not None else None
        if url:
            return url
    return None


def resolve_alias(name: str, catalog: list[dict[str, Any]], downloaded: list[str] | None = None) -> str | None:
    """A model id for ``name``: an exact id, the highest ``id:version``, or an alias's best
    variant (NPU before GPU before CPU), as the Foundry SDK resolves them; among the variants
    this machine has downloaded when it has any (``/openai/models``): the catalog lists GPU
    variants that a CPU-only machine has not got and cannot load."""
    lowered = name.lower()
    for entry in catalog:
        if str(entry.get("name", "")).lower() == lowered:
            return entry["name"]
    versions = [e for e in catalog if str(e.get("name", "")).lower().startswith(lowered + ":")]
    if versions:
        return max(versions, key=lambda e: int(str(e["name"]).rsplit(":", 1)[1] or 0))["name"]
    variants = [e for e in catalog if str(e.get("alias", "")).lower() == lowered]
    have = {d.lower() for d in downloaded or ()}
    variants = [e for e in variants if str(e.get("name", "")).lower() in have] or variants

    def rank(entry: dict[str, Any]) -> int:
        device = str((entry.get("runtime") or {}).get("deviceType", "")).lower()
        return _DEVICE_ORDER.index(device) if device in _DEVICE_ORDER else len(_DEVICE_ORDER)

    return min(variants, key=rank)["name"] if variants else None


class FoundryBackend(OpenAICompatibleBackend):
    """Adapter for Foundry Local."""

    name = "foundry"
    may_keep_ollama_store = False
    default_url = None
    health_path = "/openai/status"

    def __init__(
        self, base_url: str | None = None, model: str | None = None, settings: Settings | None = None, **overrides: Any
    ) -> None:
        super().__init__(base_url, model, settings, **overrides)
        self._explicit_url = bool(base_url)
        self._model_ids: dict[str, str] = {}
        self._loaded: set[str] = set()  # loaded by us since the service was (re)discovered

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
        self._loaded.clear()  # a restarted service has nothing loaded
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
        """The model id for ``name`` (an alias resolves to a downloaded variant), loaded into
        the service before first use: a fresh service has nothing loaded, and its chat
        refuses a model it has not loaded."""
        if not name:
            return None
        if name not in self._model_ids:
            catalog = await self._json_list("/foundry/list")
            self._model_ids[name] = resolve_alias(name, catalog, await self._json_list("/openai/models")) or name
        model = self._model_ids[name]
        if model not in self._loaded:
            loaded = await self._json_list("/openai/loadedmodels")
            if model not in loaded:
                logger.info("foundry: loading %s", model)
                async with self.http.request("GET", f"/openai/load/{model}?ttl={LOAD_TTL_S}") as resp:
                    await raise_for_upstream_status(resp)
            self._loaded.add(model)
        return model

    async def _json_list(self, path: str) -> list[Any]:
        """A list the service answers; [] when it answers anything else (an older service
        without the route). A service that cannot be reached raises BackendUnavailable."""
        try:
            payload = await self.http.get_json(path)
        except BackendUnavailable:
            raise
        except BackendError:
            return []
        return payload if isinstance(payload, list) else []

    async def models(self) -> list[ModelInfo]:
        """What this machine can serve: its downloaded models (``/openai/models``) and their
        aliases; ``/v1/models`` lists only what is loaded, which on a fresh service is nothing."""
        downloaded = await self._json_list("/openai/models")
        if not downloaded:
            return await super().models()
        aliases = {
            str(e["alias"]) for e in await self._json_list("/foundry/list")
            if isinstance(e, dict) and e.get("alias") and e.get("name") in downloaded
        }
        return [ModelInfo(id=str(name), owned_by="foundry") for name in [*downloaded, *sorted(aliases)]]

    def build_body(self, request: GenerateRequest) -> dict[str, Any]:
        body = super().build_body(request)
        if body["model"] in self._model_ids:
            body["model"] = self._model_ids[body["model"]]
        return body

    async def generate(self, request: GenerateRequest):  # type: ignore[override]
        """Generate; when the service cannot be reached before anything was sent, it may
        have restarted on a new port: ask the CLI again and retry once."""
        started = False
        for attempt in (1, 2):
            try:
                await self.model_id(request.model or self.model)
                async with contextlib.aclosing(super().generate(request)) as tokens:
                    async for token in tokens:
                        started = True
                        yield token
                return
            except BackendUnavailable:
                if started or attempt == 2 or not await self._rediscover():
                    raise

    async def limits(self) -> RuntimeLimits:
        return RuntimeLimits(parallel=1)
