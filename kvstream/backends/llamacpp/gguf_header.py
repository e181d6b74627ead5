"""The scalar metadata at the head of a GGUF file (its architecture, its trained context), read
without loading it: what Ollama's ``/api/show`` reports of a model and llama-server's ``/props``
does not. Only what precedes the first large array is usually needed; arrays are skipped.

GGUF layout (version 2 and 3): magic ``GGUF``, uint32 version, uint64 tensor count, uint64
key-value count, then each key-value: a string key (uint64 length, UTF-8 bytes), a uint32
value type, the value. Little-endian throughout.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

# value type -> struct format of a scalar of it
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# A key-value count or a string past these is not a GGUF header worth reading on.
_MAX_ENTRIES = 1 << 16
_MAX_STRING = 1 << 24


# The keys of a model's identity that Ollama shows in /api/show's model_info.
GGUF_GENERAL_KEYS = ("general.architecture", "general.basename", "general.name", "general.size_label", "general.finetune")


def read_gguf_metadata(path: str | Path, wanted: set[str], max_entries: int = 64) -> dict[str, Any]:
    """The values of the ``wanted`` scalar keys found among the first ``max_entries`` of the
    file's metadata (stops once all are found). ValueError for a file that is not GGUF."""
    found: dict[str, Any] = {}
    with open(path, "rb") as f:
        magic, version = f.read(4), _read(f, "<I")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path} is not a GGUF file of version 2 or 3")
        _read(f, "<Q")  # tensors
        entries = _read(f, "<Q")
        if entries > _MAX_ENTRIES:
            raise ValueError(f"{path}: {entries} metadata entries")
        for _ in range(min(entries, max_entries)):
            key = _string(f)
            kind = _read(f, "<I")
            value = _value(f, kind)
            if key in wanted:
                found[key] = value
                if len(found) == len(wanted):
                    break
    return found


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    raw = f.read(size)
    if len(raw) != size:
        raise ValueError("the GGUF header ends early")
    return struct.unpack(fmt, raw)[0]


def _string(f: BinaryIO) -> str:
    length = _read(f, "<Q")
    if length > _MAX_STRING:
        raise ValueError(f"a GGUF string of {length} bytes")
    return f.read(length).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = _read(f, "<I"), _read(f, "<Q")
        if item in _SCALARS:  # skipped whole: a vocabulary's scores are 200 KB
            f.seek(count * struct.calcsize(_SCALARS[item]), 1)
        else:
            for _ in range(count):
                _value(f, item)
        return None
    raise ValueError(f"GGUF value type {kind}")
