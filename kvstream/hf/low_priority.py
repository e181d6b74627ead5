"""A worker thread for large requests' preparation, run at a lower CPU priority than the engine.

Tokenizing a few MB of prompt is seconds of a core in the Rust tokenizer, which lets go of
the interpreter's lock meanwhile (so turns, engine_turns.py, do not apply: it is the cores
that are shared, not the lock). The engine's torch threads meet at every parallel region of
a step; with one of them descheduled for the tokenizer, the step waits for it: beside a
3.5 MiB prompt being tokenized the other streams' gaps between tokens doubled and paused up
to half a second (benchmarks/loop_stall.py --kinds prompt turns). Requests that large
(``LARGE_CHARS``) are prepared here instead: on one thread of its own (they queue on it, one
at a time) whose Linux scheduling priority is lowered (``NICE``), so that the kernel gives
the cores to the engine's threads first and this work the time they leave. With the engine
idle it runs as fast as before; while it steps, the large request waits longer and the
streams do not. Elsewhere than Linux (where a thread has no priority of its own) the thread
runs at the normal priority, and only the one-at-a-time queue remains.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

NICE = 10  # added to the thread's niceness (Linux: at +10, weight 110 against the engine threads' 1024 when they want the same core)
LARGE_CHARS = 256 * 1024  # text in a request past which its preparation runs here (~64k tokens of English)


def lower_thread_priority() -> None:
    """Lower the calling thread's own scheduling priority (Linux: a thread id names one thread)."""
    if not sys.platform.startswith("linux"):
        return  # (elsewhere the id would name a process, or nothing)
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + NICE))
    except OSError as exc:  # (a sandbox that forbids it: the queue still serializes the work)
        logger.info("could not lower the priority of thread %s: %s", threading.current_thread().name, exc)


class LowPriorityWorker:
    """One thread, at a lower CPU priority, that runs the calls given to ``run`` in turn."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the worker thread (with the caller's context variables, as
        ``asyncio.to_thread``); cancelled before it starts, it never runs."""
        if self._executor is None:  # (made on first use: most servers never see such a request)
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvstream-large", initializer=lower_thread_priority)
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        """Let the thread end once its current call does; queued calls are dropped."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def text_chars(messages: list[dict] | None, prompt: object) -> int:
    """Characters of text a request carries: its prompt's, or its messages' string contents and
    text parts (what tokenizing takes long on)."""
    if isinstance(prompt, str):
        return len(prompt)
    total = 0
    for message in messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part.get("text") or "") for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total
