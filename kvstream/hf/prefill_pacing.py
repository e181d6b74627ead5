"""How many prompt tokens a step may prefill.

Decodes and prefill chunks share one forward (chunked prefill), so every decoding sequence's
next token waits for the whole step. A chunk of ``max_num_batched_tokens`` (2,048) deep in a
long prompt is seconds of a CPU: a 6,000-token prompt on SmolLM2 paused every other stream
for up to 9 s a token, while its own prefill ran no faster in chunks of 2,048 than of 256
(~310 tokens/s either way here: the matmuls of 256 rows already run at the machine's rate).

``PrefillPacer`` sizes the prefill of a step that decodes so that the step takes about
``target_s`` (Sarathi-Serve's token budget, set from the step time rather than profiled per
model): it learns the prefill rate from the steps themselves (prompt tokens over the step's
seconds, decodes included, so it errs short). A step with no decodes has nobody waiting on
it but the requests that may arrive meanwhile (a chat's first token waits for the step under
way): it aims at ``IDLE_STEPS`` times as long, chunks large enough to cost the prompt nothing
(~600 tokens deep in a long prompt here). On a GPU, where a 2,048-token step takes
milliseconds, the budget stays at ``max_num_batched_tokens``.
"""

from __future__ import annotations

LEAST_TOKENS = 64  # a step that decodes still prefills this much: a prompt always moves on
FIRST_TOKENS = 256  # before any step was measured
SMOOTHING = 0.5  # weight of the newest rate: a prompt's rate falls as its context grows
IDLE_STEPS = 4  # a step that decodes nothing aims at this many times the target


class PrefillPacer:
    """The prefill tokens a step may take (``budget``), from the rate steps ran at (``observe``)."""

    def __init__(self, target_s: float, most: int) -> None:
        """``target_s``: a decoding step's aim (0: no pacing, every step may take ``most``);
        ``most``: max_num_batched_tokens."""
        self.target_s = target_s
        self.most = most
        self.rate: float | None = None  # prompt tokens a second, smoothed over the steps

    def budget(self, decodes: int) -> int:
        """Prompt tokens a step may compute with ``decodes`` sequences waiting on it for a
        token (decoding ones, and prompts that finish in it: ModelRunner._plan_batch)."""
        room = self.most - decodes
        if self.target_s <= 0 or (decodes == 0 and self.rate is None):
            return room
        if self.rate is None:
            paced = FIRST_TOKENS
        else:
            paced = int(self.rate * self.target_s * (1 if decodes else IDLE_STEPS))
        return max(min(LEAST_TOKENS, room), min(paced, room))

    def summary(self) -> dict[str, float | int | None]:
        """What /status shows: the aim, the rate learned, and the prompt tokens a step beside
        one decode takes now."""
        return {"step_ms": round(self.target_s * 1000), "tokens_per_s": None if self.rate is None else round(self.rate, 1),
                "tokens_beside_decodes": self.budget(1)}

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        """A step computed ``prompt_tokens`` prompt tokens (and its decodes) in ``seconds``."""
        if prompt_tokens < LEAST_TOKENS or seconds <= 0:
            return  # (a prompt's last token beside the decodes says little of the rate)
        rate = prompt_tokens / seconds
        self.rate = rate if self.rate is None else SMOOTHING * rate + (1 - SMOOTHING) * self.rate
