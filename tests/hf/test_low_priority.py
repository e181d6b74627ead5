"""low_priority.py: large requests' preparation on one thread of its own, at a lower CPU
priority than the engine's threads (the request path through the engine: test_serving.py)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import sys
import threading

import pytest

from kvstream.hf.low_priority import NICE, LowPriorityWorker, text_chars

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own priority is Linux's")


def where() -> tuple[str, int]:
    """The calling thread's name and niceness."""
    return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux
async def test_calls_run_on_one_thread_whose_priority_is_lowered():
    worker = LowPriorityWorker()
    try:
        own = os.getpriority(os.PRIO_PROCESS, 0)
        first, second = await asyncio.gather(worker.run(where), worker.run(where))
        assert first == second  # one thread, the same for every call
        assert first[0].startswith("kvstream-large") and first[1] == min(19, own + NICE)
        assert os.getpriority(os.PRIO_PROCESS, 0) == own  # the caller's own is untouched
    finally:
        worker.close()


async def test_calls_run_one_at_a_time_and_one_cancelled_while_queued_never_runs():
    worker = LowPriorityWorker()
    release, ran = threading.Event(), []

    def blocking(name: str) -> str:
        ran.append(name)
        release.wait(10)
        return name

    try:
        first = asyncio.ensure_future(worker.run(blocking, "first"))
        queued = asyncio.ensure_future(worker.run(blocking, "queued"))
        await asyncio.sleep(0.1)
        assert ran == ["first"]  # the second waits for the thread
        queued.cancel()  # (its client left)
        release.set()
        assert await first == "first"
        assert await worker.run(blocking, "third") == "third"
        assert ran == ["first", "third"]
    finally:
        release.set()
        worker.close()


async def test_the_callers_context_variables_are_carried():
    request_id = contextvars.ContextVar("request_id", default=None)
    request_id.set("req-7")
    worker = LowPriorityWorker()
    try:
        assert await worker.run(request_id.get) == "req-7"
    finally:
        worker.close()


def test_text_chars_counts_what_tokenizing_reads():
    assert text_chars(None, "abc") == 3
    messages = [
        {"role": "system", "content": "abcd"},
        {"role": "user", "content": [{"type": "text", "text": "xy"}, {"type": "image_url", "image_url": {"url": "data:..."}}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    assert text_chars(messages, None) == 6
    assert text_chars(None, [1, 2, 3]) == 0  # token ids: nothing to tokenize
