"""The in-process HuggingFace backend: KVStream's scheduler and block manager driving a real
model over a paged KV pool (see engine.py for the step, attention.py for the kernel).

torch and transformers are optional (``pip install 'kvstream[hf]'``); importing this package
does not import them, so the proxy runs without them.
"""

from kvstream.backends.hf.backend import HFBackend

__all__ = ["HFBackend"]
