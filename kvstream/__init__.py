"""KVStream: a transparent OpenAI-compatible proxy with a paged KV block manager, a prefix
cache and a continuous-batching scheduler in front of local LLM runtimes."""

__version__ = "0.1.0"

from kvstream.engine import KVStreamEngine  # noqa: E402

__all__ = ["KVStreamEngine", "__version__"]
