"""KVStream: a transparent OpenAI-compatible proxy with a paged KV block manager, a prefix
cache and a continuous-batching scheduler in front of local LLM runtimes."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Loaded on first use, so that ``import kvstream`` (and every module that only needs the
    # version) does not pull in the engine and everything below it.
    if name == "KVStreamEngine":
        from kvstream.engine import KVStreamEngine

        return KVStreamEngine
    raise AttributeError(f"module 'kvstream' has no attribute {name!r}")


__all__ = ["KVStreamEngine", "__version__"]
