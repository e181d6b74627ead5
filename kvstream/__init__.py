"""KVStream: a transparent OpenAI-compatible proxy with a paged KV block manager, a prefix
cache and a continuous-batching scheduler in front of local LLM runtimes."""

from kvstream.engine import KVStreamEngine

__version__ = "0.1.0"
__all__ = ["KVStreamEngine", "__version__"]
