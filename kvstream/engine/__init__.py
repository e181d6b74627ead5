"""The engine layer: one request lifecycle (core.py) over a runner that holds what differs per
backend (runners.py); prompt estimates for runtimes that cannot tokenize (estimate.py)."""

from kvstream.engine.core import EngineStats, Generation, KVStreamEngine, QueueTimeout
from kvstream.engine.runners import LocalRunner, RemoteRunner, Runner

__all__ = ["EngineStats", "Generation", "KVStreamEngine", "LocalRunner", "QueueTimeout", "RemoteRunner", "Runner"]
