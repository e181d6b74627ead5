"""Tokens decided beside the engine's steps, for rows whose constraint judges candidates slowly.

A client's expression that the pattern machine cannot follow (a backreference, a lookaround)
is matched by the ``regex`` module, reading the whole answer for every candidate token, and
may backtrack: up to its matching budget, a quarter of a second per token
(pattern_constraint.py). Decided inside the step, that time was every stream's: each of their
tokens waited for it, as many times over as such requests ran. The ``regex`` module lets go of
the interpreter's lock while it matches, so such a row's token is decided here instead, on a
thread of its own, while the engine's steps go on without that row (it sits out until its
token comes back, ModelRunner._plan_batch). Rows queue on the one thread, at a lower CPU
priority (as large prompts' preparation, low_priority.py): a second costly request waits
behind the first, never in front of anyone else. A lazy grammar's trigger patterns, searched
in all the text at each token (lazy_grammar.py), are noted here too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from kvstream.hf.low_priority import lower_thread_priority

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _start_thread() -> None:
    # One OpenMP thread for this one (see SideDecider._started), at a lower CPU priority: the
    # engine's threads get the cores first (what is left of the other streams' pause is cores,
    # not the lock: a p99 gap of 96-97 ms at the normal priority, 54-57 ms lowered). The
    # matching budget is wall time, so under load a costly expression reaches it sooner.
    torch.get_num_threads()  # (torch reads its default for this thread now, not at its first kernel)
    torch.set_num_threads(1)
    lower_thread_priority()


class SideDecider:
    """One thread that runs token decisions in turn and hands each result (or the exception
    it raised) to its ``deliver`` callback, on that thread."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, decide: Callable[[], T], deliver: Callable[[T | Exception], None]) -> None:
        """Run ``decide()`` on the side thread, then ``deliver`` its result (call from the
        engine's thread)."""

        def run() -> None:
            try:
                result: T | Exception = decide()
            except Exception as exc:  # noqa: BLE001 - the request ends with it, not the thread
                logger.exception("deciding a token beside the steps failed")
                result = exc
            deliver(result)

        self._started().submit(run)

    def _started(self) -> ThreadPoolExecutor:
        """The side thread, started on first use (most engines never need it) with one OpenMP
        thread: a thread that runs a parallel region of torch's CPU kernels brings a team of
        OpenMP workers of its own, and with more of them than cores the engine's team stops
        spinning between regions, each of its ~200 kernel calls a step paying a wake-up; one
        row's sorting and drawing need no team. torch.set_num_threads also sets torch's default
        for threads that have not run a kernel yet, so the calling thread puts its own count
        back once the side thread has taken its one."""
        if self._executor is None:
            threads = torch.get_num_threads()
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvstream-decide", initializer=_start_thread)
            self._executor.submit(int).result()  # (the initializer has run)
            torch.set_num_threads(threads)
        return self._executor

    def close(self) -> None:
        """Let the thread end once its current decision does; queued ones are dropped."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
