"""JSON on the hot path: orjson, several times faster than the stdlib for the small
objects a proxy handles per token. ``dumps`` returns compact UTF-8 bytes."""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(data: bytes | str) -> Any:
    """Parse JSON. What orjson refuses and the stdlib takes (NaN, integers past 64 bits) is
    parsed by the stdlib, whose exception (with its message) is what invalid input raises.

    Raises ValueError for anything that is not JSON KVStream can carry on: nesting deeper
    than orjson's 1,024 levels (whatever ``sys.getrecursionlimit()`` is: torch.compile, for
    one, raises it in the same process, and the stdlib's depth limit follows it) and lone
    surrogates (``"\\ud800"``), which no UTF-8 body can hold."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):
            raise ValueError("nested too deeply (more than 1,024 levels)") from None
        return _stdlib_loads(data)


def _stdlib_loads(data: bytes | str) -> Any:
    """What orjson refused, parsed by the stdlib, and refused if KVStream cannot carry it."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ValueError("a string holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return value


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes, non-ASCII kept as UTF-8 (what ``ensure_ascii=False`` gives).

    What orjson refuses (integers past 64 bits, which a client may pass through to the
    runtime) is written by the stdlib instead."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
