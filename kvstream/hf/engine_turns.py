"""Pure-Python work on other threads that leaves the engine's thread its turns.

A step of the engine is a few hundred torch calls, each of which lets go of the
interpreter's lock and takes it back. While another thread runs pure Python (reading a
client's schema or grammar into its constraint machine, before the request is queued),
taking it back waits for that thread's switch interval (5 ms) each time: a 13-19 ms step took
3.7 s beside a thread looping in pure Python here, and 4-6x as long beside one reading
schemas (`benchmarks/engine_turns.py`), so the engine all but stopped, and every stream
with it, for as long as the reading lasted (the 300-property schemas of
`benchmarks/loop_stall.py`).

So such work runs ``yielding_to_engine()``, and its loops call ``give_turn()``: while an
engine is stepping, after each ``SLICE_S`` of work the thread sleeps ``PAUSE_S``, in which
the engine runs with the lock to itself. The work then takes up to
``(SLICE_S + PAUSE_S) / SLICE_S`` times as long while others stream, and no longer when the
engine is idle. Threads within it work one at a time, and a slice never starts during the
engine's turn whichever thread gave it: four requests read at once left the engine no turns
while each thread gave its own. The working lock is taken only while an engine steps (at the
first ``give_turn()`` then) and let go when none does: with the engine idle, requests read at
once share the interpreter as any threads do, and a small schema does not wait out a large
one's reading. Elsewhere (the engine's own thread, the event loop, a thread that did not ask)
``give_turn()`` does nothing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

_clock, _sleep = time.perf_counter, time.sleep  # (module names: tests replace these alone)

SLICE_S = 0.002  # work between turns
PAUSE_S = 0.006  # each turn: the engine's, about three quarters of the time

_busy: set[int] = set()  # id() of the engines stepping now (set.add/discard: atomic under the lock)
_local = threading.local()  # .deadline: when this thread's next turn is due (absent: it does not yield)
# Held by the one thread whose slice of such work runs now (its ident in _holder), and the
# time before which no slice starts (the engine's turn): several requests read at once (a
# client sending schemas in parallel) take turns among themselves and leave the engine the
# same turns as one does.
_working = threading.Lock()
_holder: int | None = None
_resume_at = 0.0


def set_busy(engine: object, busy: bool) -> None:
    """Mark ``engine`` stepping (``give_turn`` pauses) or idle (it does not)."""
    if busy:
        _busy.add(id(engine))
    else:
        _busy.discard(id(engine))


@contextlib.contextmanager
def yielding_to_engine() -> Iterator[None]:
    """Within it, this thread's ``give_turn()`` calls pause for the engine while it steps,
    one such thread working at a time then (the others wait, off the interpreter's lock)."""
    if "deadline" in _local.__dict__:  # within one already: that one lets go
        yield
        return
    _local.deadline = 0.0  # (a slice is started when an engine steps: give_turn)
    try:
        yield
    finally:
        del _local.deadline
        if _holder == threading.get_ident():
            _let_go()


def give_turn() -> None:
    """A point in a long pure-Python loop where this thread may let the engine step: sleeps
    ``PAUSE_S`` once ``SLICE_S`` of work has passed since the last turn, within
    ``yielding_to_engine()`` and while an engine steps; else returns at once."""
    global _resume_at
    if not _busy:
        if _holder is not None and _holder == threading.get_ident():
            _let_go()  # every engine idle: the other readers need not wait for this one
        return
    deadline = _local.__dict__.get("deadline")
    if deadline is None:
        return
    if _holder != threading.get_ident():
        _start_slice()  # the first turn point since an engine began stepping
        return
    now = _clock()
    if now >= deadline:
        _resume_at = now + PAUSE_S
        _let_go()  # another reading thread may wait out the turn meanwhile
        try:
            _sleep(PAUSE_S)
        finally:
            _start_slice()  # (held again whatever happens: the context lets go)


def _start_slice() -> None:
    """Take the working lock, wait out the engine's turn if one is under way, and start a slice."""
    global _holder
    _working.acquire()
    _holder = threading.get_ident()
    if _busy and (wait := _resume_at - _clock()) > 0:
        _sleep(wait)
    _local.deadline = _clock() + SLICE_S


def _let_go() -> None:
    """Let go of the working lock this thread holds."""
    global _holder
    _holder = None
    _working.release()
