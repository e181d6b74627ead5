"""Sampling and decoding fields of other servers (llama-server's, Ollama's options, vLLM's)
that the in-process engine does not have, each with the test for the values that leave it
off: a request setting one on gets a 400 naming it, never a silently different answer, and
one sent at its off value (llama.cpp's web UI sends them all with every request) is taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _zero_or_less(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value <= 0


OFF_WHEN: dict[str, Callable[[Any], bool]] = {
    "mirostat": _zero_or_less, "dry_multiplier": _zero_or_less, "xtc_probability": _zero_or_less,
    "top_n_sigma": _zero_or_less, "dynatemp_range": _zero_or_less,
}


def first_unsupported(fields: dict[str, Any]) -> str | None:
    """The first of ``fields`` the engine lacks that is set to a value turning it on, or None."""
    return next((name for name, off in OFF_WHEN.items() if fields.get(name) is not None and not off(fields[name])), None)
