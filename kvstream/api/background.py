"""Responses that run detached from their request: the Responses API's ``background: true``.

The request that creates one returns at once with the response ``queued`` or, streamed,
follows its events as they come; either way the generation runs on in a task of its own,
whether the client stays or not. The response is read as it stands (``queued``,
``in_progress``, then ``completed``, ``incomplete``, ``failed`` or ``cancelled``) and can be
cancelled while it runs; a run created with ``stream: true`` keeps every event it sent, so
that a client whose connection dropped streams it again from the event after the last it
saw, live while it runs. A finished run is handed to whoever keeps responses
(routes_responses.py puts it in the response store, its events with it). While it runs,
``BackgroundRuns.snapshot`` gives each run as it stands, for the responses file's periodic
writes (responses_file.py): a server that is killed leaves the runs it had in the file,
read back as failed.

A run keeps its API key's place among the generations in flight
(``server.max_concurrent_per_key``) until it ends: background work does not get round the
cap. Closing the registry (the server's shutdown) cancels what still runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvstream.api.errors import APIError, from_exception
from kvstream.api.response_store import StoredResponse
from kvstream.api.responses_format import ResponseAnswer
from kvstream.api.routes_openai import _next
from kvstream.api.state import KeyInFlight

if TYPE_CHECKING:
    from kvstream.engine import Generation

logger = logging.getLogger(__name__)

# What keeps a run's response once it ended: (the response, the events it streamed or None,
# whether it finished as the model ended it rather than failed or cancelled).
Keeper = Callable[[dict[str, Any], "tuple[dict[str, Any], ...] | None", bool], None]


class BackgroundRun:
    """One background response: its status, its answer as it grows, and (streamed) every
    event it sent, numbered from 0 by their ``sequence_number``."""

    def __init__(self, answer: ResponseAnswer, owner: str | None, streamed: bool,
                 context: tuple[dict[str, Any], ...], input_items: tuple[dict[str, Any], ...]) -> None:
        self.answer = answer
        self.owner = owner  # the cache salt of the key that made it
        self.streamed = streamed
        self.context = context  # the conversation it continued
        self.input_items = input_items  # its own input
        self.status = "queued"
        self.final: dict[str, Any] | None = None  # the whole response, once ended
        self.events: list[dict[str, Any]] = []
        self.task: asyncio.Task[None] | None = None
        self.changes = 0  # counts what it published (the responses file writes when it moved)
        self._changed = asyncio.Event()

    @property
    def id(self) -> str:
        return self.answer.id

    @property
    def items(self) -> tuple[dict[str, Any], ...]:
        """What it was made from: the conversation it continued, then its own input."""
        return self.context + self.input_items

    def response(self) -> dict[str, Any]:
        """The response as it stands: the output written so far while it runs."""
        return self.final if self.final is not None else self.answer.response(self.status)

    def publish(self, events: list[dict[str, Any]]) -> None:
        if self.streamed:
            self.events += events
        self._wake()

    def end(self, response: dict[str, Any]) -> None:
        self.final, self.status = response, response["status"]
        self._wake()

    def _wake(self) -> None:
        self.changes += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[list[dict[str, Any]]]:
        """The events after sequence number ``after``, a batch each time more are ready,
        until the run ends."""
        sent = max(after + 1, 0)
        while True:
            changed = self._changed
            if sent < len(self.events):
                batch, sent = self.events[sent:], len(self.events)
                yield batch
            elif self.final is not None:
                return
            else:
                await changed.wait()


async def drive(run: BackgroundRun, gen: Generation, keep: Keeper) -> None:
    """Run ``gen`` to its end as ``run``'s answer, then hand the response to ``keep``."""
    answer = run.answer
    stream = aiter(gen)
    outcome = "cancelled"
    try:
        await gen.admitted()
        run.status = "in_progress"
        token = await _next(stream)
        run.publish(answer.started(len(gen.seq.prompt_token_ids)))
        while token.finish_reason is None:
            run.publish(answer.add(token))
            token = await _next(stream)
        run.publish(answer.add(token))
        whole, ending = answer.finish(token, gen.usage)
        outcome = "finished"
    except asyncio.CancelledError:
        whole, ending = answer.response("cancelled"), []
    except Exception as exc:
        outcome = "failed"
        error = from_exception(exc)
        logger.warning("background response %s failed: %s", run.id, error.message)
        whole = answer.response("failed") | {"error": {"code": _error_code(error), "message": error.message}}
        ending = [answer.event("response.failed", response=whole)]
    finally:
        try:
            await stream.aclose()
        finally:
            gen.close(outcome)
    # Kept before its last event goes out: a client continuing at once finds it.
    keep(whole, tuple(run.events + ending) if run.streamed else None, outcome == "finished")
    run.publish(ending)
    run.end(whole)


def _error_code(error: APIError) -> str:
    """The Responses API's error code for why a run failed."""
    return "rate_limit_exceeded" if error.status == 429 else "server_error"


class BackgroundRuns:
    """The background responses still running, by id."""

    def __init__(self) -> None:
        self._runs: dict[str, BackgroundRun] = {}
        self._ended_changes = 0  # the changes of runs no longer here (so that ``changes`` never goes back)

    def __len__(self) -> int:
        return len(self._runs)

    @property
    def changes(self) -> int:
        """Counts every change of a run (begun, published, ended): it moved when a snapshot
        would differ."""
        return self._ended_changes + sum(run.changes for run in self._runs.values())

    def snapshot(self) -> list[StoredResponse]:
        """Each run still running as it stands (``queued`` or ``in_progress``, the output
        written so far, a streamed one's events so far), as the response store keeps a
        response (``size`` not counted: 0). An ended run is in the store already."""
        return [StoredResponse(run.response(), run.context, run.input_items, run.owner, 0,
                               tuple(run.events) if run.streamed else None)
                for run in self._runs.values() if run.final is None]

    def start(self, run: BackgroundRun, gen: Generation, keep: Keeper, held: KeyInFlight | None) -> None:
        """Drive ``gen`` as ``run`` in a task of its own; ``held``, the requester's key's
        count of generations in flight, counts the run until it ends."""
        if held is not None:
            held.keep()
        run.task = asyncio.get_running_loop().create_task(drive(run, gen, keep), name=f"background {run.id}")
        self._runs[run.id] = run

        def ended(task: asyncio.Task[None]) -> None:
            self._runs.pop(run.id, None)
            self._ended_changes += run.changes + 1
            if held is not None:
                held.give()
            if run.final is not None:
                return
            # Cancelled before it began (or, a bug, it raised): still released and kept.
            gen.close("cancelled")
            if not task.cancelled() and task.exception() is not None:
                logger.error("background response %s ended badly", run.id, exc_info=task.exception())
            whole = run.answer.response("cancelled")
            keep(whole, tuple(run.events) if run.streamed else None, False)
            run.end(whole)

        run.task.add_done_callback(ended)

    def get(self, owner: str | None, response_id: str) -> BackgroundRun | None:
        """``owner``'s run ``response_id`` while it runs, else None (once ended, its response
        is wherever it was kept)."""
        run = self._runs.get(response_id)
        return run if run is not None and run.owner == owner and run.final is None else None

    async def cancel(self, run: BackgroundRun) -> None:
        """Stop ``run`` and wait until its response is kept as cancelled."""
        assert run.task is not None
        run.task.cancel()
        await asyncio.wait({run.task})

    async def close(self) -> None:
        """Cancel every run (the server is stopping)."""
        tasks = [run.task for run in self._runs.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


BACKGROUND = web.AppKey("background_runs", BackgroundRuns)
