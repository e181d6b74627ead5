"""Pure-Python work on other threads that leaves the engine's thread its turns.

A step of the engine is a few hundred torch calls, each of which lets go of the
interpreter's lock and takes it back. While another thread runs pure Python (reading a
client's schema or grammar into its constraint machine, before the request is queued),
taking it back waits for that thread's switch interval (5 ms) each time: a 20 ms step took
over 3 s beside a busy thread here, so the engine all but stopped, and every stream with
it, for as long as the reading lasted (the 300-property schemas of
`benchmarks/loop_stall.py`).

So such work runs ``yielding_to_engine()``, and its loops call ``give_turn()``: while an
engine is stepping, after each ``SLICE_S`` of work the thread sleeps ``PAUSE_S``, in which
the engine runs with the lock to itself. The work then takes up to
``(SLICE_S + PAUSE_S) / SLICE_S`` times as long while others stream, and no longer when the
engine is idle. Elsewhere (the engine's own thread, the event loop, a thread that did not
ask) ``give_turn()`` does nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

SLICE_S = 0.002  # work between turns
PAUSE_S = 0.006  # each turn: the engine's, about three quarters of the time

_busy: set[int] = set()  # id() of the engines stepping now (set.add/discard: atomic under the lock)
_local = threading.local()  # .deadline: when this thread's next turn is due (absent: it does not yield)


def set_busy(engine: object, busy: bool) -> None:
    """Mark ``engine`` stepping (``give_turn`` pauses) or idle (it does not)."""
    if busy:
        _busy.add(id(engine))
    else:
        _busy.discard(id(engine))


@contextlib.contextmanager
def yielding_to_engine() -> Iterator[None]:
    """Within it, this thread's ``give_turn()`` calls pause for the engine while it steps."""
    outer = getattr(_local, "deadline", None)
    _local.deadline = time.perf_counter() + SLICE_S
    try:
        yield
    finally:
        if outer is None:
            del _local.deadline
        else:
            _local.deadline = outer


def give_turn() -> None:
    """A point in a long pure-Python loop where this thread may let the engine step: sleeps
    ``PAUSE_S`` once ``SLICE_S`` of work has passed since the last turn, within
    ``yielding_to_engine()`` and while an engine steps; else returns at once."""
    if not _busy:
        return
    deadline = _local.__dict__.get("deadline")
    if deadline is None:
        return
    now = time.perf_counter()
    if now >= deadline:
        time.sleep(PAUSE_S)
        _local.deadline = time.perf_counter() + SLICE_S
