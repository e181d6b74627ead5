"""Runtime adapters and the registry that finds them by name.

Third-party backends register under the entry-point group ``kvstream.backends``::

    [project.entry-points."kvstream.backends"]
    mybackend = "my_package.module:MyBackend"
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

from kvstream.backends.base import (
    BackendError,
    BackendInterrupted,
    BackendRejected,
    BackendUnavailable,
    BaseBackend,
    Capabilities,
    GenerateRequest,
    ModelInfo,
    RuntimeLimits,
    Token,
    Usage,
)
from kvstream.backends.foundry import FoundryBackend
from kvstream.backends.hf import HFBackend
from kvstream.backends.llamacpp import LlamaCppBackend
from kvstream.backends.lmstudio import LMStudioBackend
from kvstream.backends.ollama import OllamaBackend
from kvstream.backends.openai_compat import OpenAICompatibleBackend

logger = logging.getLogger(__name__)

BUILTIN: dict[str, type[BaseBackend]] = {
    "ollama": OllamaBackend,
    "llamacpp": LlamaCppBackend,
    "lmstudio": LMStudioBackend,
    "foundry": FoundryBackend,
    "openai": OpenAICompatibleBackend,
    "hf": HFBackend,
}

ENTRY_POINT_GROUP = "kvstream.backends"


def available() -> dict[str, type[BaseBackend]]:
    """Built-in backends plus those installed under the ``kvstream.backends`` entry points."""
    found = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            continue
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plugin must not stop KVStream
            logger.warning("backend plugin %r failed to load: %s", ep.name, exc)
            continue
        if isinstance(cls, type) and issubclass(cls, BaseBackend):
            found[ep.name] = cls
        else:
            logger.warning("backend plugin %r is not a BaseBackend subclass; ignored", ep.name)
    return found


def get_backend_class(name: str) -> type[BaseBackend]:
    """The backend class registered as ``name``; raises KeyError listing the known names."""
    backends = available()
    if name not in backends:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(sorted(backends) + ['auto'])}")
    return backends[name]


__all__ = [
    "BUILTIN",
    "BackendError",
    "BackendInterrupted",
    "BackendRejected",
    "BackendUnavailable",
    "BaseBackend",
    "Capabilities",
    "FoundryBackend",
    "GenerateRequest",
    "HFBackend",
    "LMStudioBackend",
    "LlamaCppBackend",
    "ModelInfo",
    "OllamaBackend",
    "OpenAICompatibleBackend",
    "RuntimeLimits",
    "Token",
    "Usage",
    "available",
    "get_backend_class",
]
