"""The in-process HuggingFace engine: KVStream's scheduler and block manager driving a real
model over a paged KV pool.

- ``model_runner.py``: the continuous-batching step (admit, append, one packed forward, sample);
- ``kv_cache.py`` / ``attention.py`` / ``compat.py``: the paged KV tensors and the attention
  over them, registered with transformers;
- ``kv_store.py`` / ``kv_quant.py`` / ``blend.py``: spill tiers, KIVI quantization, blend reuse;
- ``backend.py``: ``HFBackend``, the runner behind the proxy's API (``--backend hf``);
- ``library.py``: ``HFEngine``, the same engine as a Python library;
- ``awq/``: AWQ 4-bit checkpoints (making, loading, layer streaming).

torch and transformers are optional (``pip install 'kvstream[hf]'``): importing this package
does not import them; the names below load their modules on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "HFBackend": "kvstream.hf.backend",
    "HFEngine": "kvstream.hf.library",
    "GenerationResult": "kvstream.hf.library",
    "StreamingConfig": "kvstream.hf.awq.streaming",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstream.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_LAZY)
