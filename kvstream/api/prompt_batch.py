"""Several prompts in one completions request (the API's batch form: ``prompt`` as a list of
texts or of token-id lists), served for a backend that translates the request.

Each prompt is its own generation in the engine: queued, admitted, scheduled and counted as
any request, so a batch shares the runtime with everyone else on the same terms. The
response numbers the choices prompt by prompt, as OpenAI does (prompt i's choice j is
``i * n + j``), and ends when the last prompt's last choice ends, with the usage summed.
A runtime that speaks OpenAI itself gets the batch as the client sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kvstream.engine import Generation
from kvstream.scheduler import SchedulerError
from kvstream.types import BackendError, Token, Usage


class PromptBatch:
    """The generations of a batch's prompts, seen by the route as one generation of
    ``len(gens) * n`` choices: ``admitted()``, the merged token stream, ``usage`` once it
    ends, ``close()``."""

    def __init__(self, gens: list[Generation], n: int) -> None:
        self.gens = gens
        self.n = n
        self.usage: Usage | None = None

    async def admitted(self) -> None:
        """The first prompt admitted (the response may begin). The others are admitted as
        slots free, some perhaps only when earlier prompts finish: the stream waits for each."""
        await self.gens[0].admitted()

    @property
    def queue_ms(self) -> float:
        return max(gen.queue_ms for gen in self.gens)

    def verified_hit(self) -> tuple[int, str]:
        hits = [gen.verified_hit() for gen in self.gens]
        sources = {source for _, source in hits}
        return sum(hit for hit, _ in hits), sources.pop() if len(sources) == 1 else "kvstream"

    def __aiter__(self) -> AsyncIterator[Token]:
        return self._merged()

    async def _merged(self) -> AsyncIterator[Token]:
        """The prompts' tokens as they come, their choices renumbered; a prompt's end is the
        end of its last choice, and the last prompt's ends the stream."""
        queue: asyncio.Queue[tuple[int, Token | BaseException]] = asyncio.Queue()

        async def pump(i: int, gen: Generation) -> None:
            try:
                if i:  # the first is admitted before the stream is read
                    try:
                        await gen.admitted()
                    except SchedulerError as exc:  # its queue deadline: the route answers it as a runtime error
                        raise BackendError(str(exc), exc.status, code=exc.code, retryable=exc.status >= 429) from None
                async for token in gen:
                    queue.put_nowait((i, token))
            except Exception as exc:  # handed to the reader, which raises it for the route
                queue.put_nowait((i, exc))
            else:
                gen.close()  # its slot is free now: a later prompt of the batch may be waiting for it

        tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(self.gens)]
        usages: list[Usage] = []
        try:
            while len(usages) < len(self.gens):
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                index = i * self.n + item.index
                if item.finish_reason is None:
                    item.index = index
                    item.more = not queue.empty()
                    yield item
                    continue
                usages.append(self.gens[i].usage or item.usage or Usage(0, 0))
                if len(usages) < len(self.gens):
                    yield Token(index=index, choice_finish_reason=item.finish_reason, more=not queue.empty())
                    continue
                self.usage = Usage.summed(usages)
                yield Token(finish_reason=item.finish_reason, usage=self.usage, index=index)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def close(self, outcome: str | None = None) -> None:
        """Release every prompt's slot and blocks; a prompt that finished counts as finished."""
        for gen in self.gens:
            gen.close(None if gen.finish_reason else outcome)
