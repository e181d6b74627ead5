"""``--backend auto``: probe the local runtimes in turn and take the first that answers."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from kvstream.backends.base import BaseBackend
from kvstream.config import Settings
from kvstream.backends.foundry import FoundryBackend
from kvstream.backends.llamacpp import LlamaCppBackend
from kvstream.backends.lmstudio import LMStudioBackend
from kvstream.backends.ollama import OllamaBackend

logger = logging.getLogger(__name__)

# Each runtime at its default address (None: the backend's own default, OLLAMA_HOST for
# Ollama). llama-server's default port moved from 8080 to 9931.
CANDIDATES: list[tuple[type[BaseBackend], str | None]] = [
    (OllamaBackend, None),
    (LlamaCppBackend, "http://127.0.0.1:9931"),
    (LlamaCppBackend, "http://127.0.0.1:8080"),
    (LMStudioBackend, None),  # its default port, or where `lms server status` says
    (FoundryBackend, None),  # discovered through the foundry CLI
]


async def probe_runtimes(settings: Settings, tried: list[str] | None = None) -> BaseBackend | None:
    """A backend (not yet started) for the first runtime that identifies as itself (by what
    only it answers; an answer relayed by a KVStream does not count), never on KVStream's
    own port; None when nothing answers. ``tried`` gets each runtime and the address it was
    asked at (a discovered one: LM Studio's default port or its CLI's, Foundry's CLI)."""
    own_port, model = settings.server.port, settings.backend.model
    for cls, url in CANDIDATES:
        if url is not None and urlsplit(url).port == own_port:
            continue
        probe = cls(url, model, settings)
        await probe.start()
        if tried is not None:
            tried.append(f"{cls.name} ({probe.base_url or 'no ' + cls.name + ' CLI found'})")
        try:
            # A discovered URL (Foundry's, LM Studio's CLI) may be KVStream's own port too.
            found = urlsplit(probe.base_url).port != own_port and await probe.identify()
        except Exception:
            found = False
        finally:
            await probe.close()
        if found:
            logger.info("auto: found %s at %s", probe.name, probe.base_url)
            return cls(probe.base_url, model, settings)
    return None
