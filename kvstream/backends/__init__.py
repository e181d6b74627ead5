"""Runtime adapters and the registry that finds them by name.

The registry names each built-in backend by module path and loads only the one asked for, so
that choosing ``ollama`` never imports what ``hf`` needs (torch, transformers): a proxy-only
install runs without them. Third-party backends register under the entry-point group
``kvstream.backends``::

    [project.entry-points."kvstream.backends"]
    mybackend = "my_package.module:MyBackend"
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points
from typing import Any

from kvstream.backends.base import BaseBackend, Capabilities
from kvstream.backends.foundry import FoundryBackend
from kvstream.backends.llamacpp import LlamaCppBackend
from kvstream.backends.lmstudio import LMStudioBackend
from kvstream.backends.ollama import OllamaBackend
from kvstream.backends.openai_compat import OpenAICompatibleBackend
from kvstream.types import (
    BackendError,
    BackendInterrupted,
    BackendRejected,
    BackendUnavailable,
    GenerateRequest,
    ModelInfo,
    RuntimeLimits,
    Token,
    Usage,
)

logger = logging.getLogger(__name__)

# name -> "module:Class"; loaded on demand by get_backend_class().
BUILTIN: dict[str, str] = {
    "ollama": "kvstream.backends.ollama:OllamaBackend",
    "llamacpp": "kvstream.backends.llamacpp.backend:LlamaCppBackend",
    "lmstudio": "kvstream.backends.lmstudio:LMStudioBackend",
    "foundry": "kvstream.backends.foundry:FoundryBackend",
    "openai": "kvstream.backends.openai_compat:OpenAICompatibleBackend",
    # OpenAI-compatible engines whose Prometheus metrics drive admission and routing.
    "vllm": "kvstream.backends.vllm:VLLMBackend",
    "sglang": "kvstream.backends.sglang:SGLangBackend",
    # The in-process engine: its module imports torch only when a model is loaded.
    "hf": "kvstream.hf.backend:HFBackend",
}

ENTRY_POINT_GROUP = "kvstream.backends"


def _load(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def available() -> list[str]:
    """Names of the built-in backends plus those installed under the entry points."""
    return sorted(set(BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def get_backend_class(name: str) -> type[BaseBackend]:
    """The backend class registered as ``name``; raises KeyError listing the known names.

    A plugin that fails to load, or is not a BaseBackend, is reported as unknown (and
    logged), never allowed to take KVStream down.
    """
    if name in BUILTIN:
        return _load(BUILTIN[name])
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name != name:
            continue
        try:
            cls = ep.load()
        except Exception as exc:  # a broken plugin must not stop KVStream
            logger.warning("backend plugin %r failed to load: %s", ep.name, exc)
            break
        if isinstance(cls, type) and issubclass(cls, BaseBackend):
            return cls
        logger.warning("backend plugin %r is not a BaseBackend subclass; ignored", ep.name)
        break
    raise KeyError(f"unknown backend {name!r}; known: {', '.join(available() + ['auto'])}")


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
