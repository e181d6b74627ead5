"""llama.cpp's llama-server: the adapter (backend.py), hard KV inject through /slots
(inject.py over the slot-file store in slots.py), exact prompt tokens (tokens.py), and a
llama-server that KVStream starts and watches itself (runtime.py)."""

from kvstream.backends.llamacpp.backend import LlamaCppBackend

__all__ = ["LlamaCppBackend"]
