"""llama-server's per-answer telemetry, for the routes the in-process engine answers itself:
``timings`` (what the prompt and the generation took, in its own terms) and the
``prompt_progress`` reports a streamed request asks for with ``return_progress``.

Its definitions, which its own tests check: the prompt's time runs from the request's
admission to its first token; the generation's from the first token to the last, its rate over
the steps after the first (the first token came with the prompt), 0 with one token.
``cache_n`` prompt tokens were found cached, ``prompt_n`` computed. The times are those the
engine stamps on the generation, so the answers' timings and the ``llamacpp:`` series agree.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvstream.types import PromptProgress

if TYPE_CHECKING:
    from kvstream.engine import Generation


def wants(body: dict[str, Any], name: str) -> bool:
    """Whether the body turns llama-server's flag ``name`` on (``timings_per_token``,
    ``return_progress``); a value that is not ``true`` leaves it off, as there."""
    return body.get(name) is True


def timings(cached: int, prompt_n: int, prompt_ms: float, predicted_n: int, predicted_ms: float) -> dict[str, Any]:
    """The ``timings`` object: ``prompt_n`` tokens computed (the cached ones apart)."""
    steps = max(0, predicted_n - 1)
    return {
        "cache_n": cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / max(1, prompt_n),
        "prompt_per_second": prompt_n / (prompt_ms / 1000) if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
        "predicted_per_second": 1000 / predicted_ms * steps if steps and predicted_ms > 0 else 0.0,
    }


def progress_timings(progress: PromptProgress) -> dict[str, Any]:
    """The timings a progress report carries: the prompt so far, nothing generated yet."""
    return timings(progress.cache, progress.processed - progress.cache, progress.time_ms, 0, 0.0)


def of_generation(gen: Generation) -> dict[str, Any]:
    """The timings of ``gen`` now: its prompt from admission to the first token, its tokens
    as the engine counted them (once it ended, as its usage says)."""
    now = time.monotonic()
    first = gen.first_token_at or now
    admitted = gen.seq.admitted_at if gen.seq.admitted_at is not None else gen.submitted_at
    usage = gen.usage
    prompt = usage.prompt_tokens if usage is not None else len(gen.seq.prompt_token_ids)
    cached = (usage.cached_tokens or 0) if usage is not None else gen.seq.num_cached_tokens
    predicted = usage.completion_tokens if usage is not None else gen.num_tokens
    ended = gen.last_token_at if usage is not None and gen.last_token_at is not None else now
    return timings(cached, prompt - cached, max(0.0, first - admitted) * 1000, predicted, max(0.0, ended - first) * 1000)
