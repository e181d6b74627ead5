"""The engine asks its pacer how many prompt tokens a step that decodes may take, and tells
it what each step computed and how long it took (prefill_pacing.py holds the policy)."""

from __future__ import annotations

from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from kvstream.hf.sampling import SamplingParams  # noqa: E402
from kvstream.scheduler import Sequence  # noqa: E402


class FixedPacer:
    """32 prompt tokens a step while anything decodes; records what the engine reports."""

    def __init__(self, most: int) -> None:
        self.most, self.observed = most, []

    def budget(self, decodes: int) -> int:
        return 32 if decodes else self.most - decodes

    def observe(self, prompt_tokens: int, seconds: float) -> None:
        self.observed.append((prompt_tokens, seconds))


def test_a_long_prompt_is_prefilled_in_paced_chunks_while_another_decodes(smollm2):
    engine = ModelRunner(smollm2[0], smollm2[2], RunnerConfig(block_size=8, num_blocks=64, num_cpu_blocks=0,
                                                             max_num_batched_tokens=512, debug_invariants=True))
    engine.pacer = pacer = FixedPacer(512)
    events: list = []
    engine.add_request(Sequence(list(range(300, 310)), 12), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                       events.extend)
    engine.step()  # its 10-token prompt, alone: the whole budget
    assert pacer.observed[-1][0] == 10
    engine.add_request(Sequence(list(range(400, 600)), 4), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       events.extend)
    chunks = []
    while engine.has_work():
        before = engine.counters.prefill_tokens
        engine.step()
        chunks.append(engine.counters.prefill_tokens - before)
    assert engine.is_idle()
    # The 200-token prompt: 32 tokens a step beside the decoding request (the budget without
    # decodes is 512: the whole prompt in one step), the rest in the last.
    prefills = [tokens for tokens in chunks if tokens]
    assert prefills == [32] * 6 + [8]
    assert [tokens for tokens, _ in pacer.observed[1:8]] == [32] * 6 + [8]
    assert all(seconds > 0 for _, seconds in pacer.observed)


def test_a_short_prompt_admitted_behind_a_long_one_is_computed_in_the_next_step(smollm2):
    """Prompts that finish within half the step's budget go before the chunks of a long one
    admitted earlier (which keeps the rest of every step): the short one's first token comes
    in a step, not after the whole long prompt."""
    engine = ModelRunner(smollm2[0], smollm2[2], RunnerConfig(block_size=8, num_blocks=96, num_cpu_blocks=0,
                                                             max_num_batched_tokens=64, debug_invariants=True))
    events: dict[str, list] = {"long": [], "short": []}
    engine.add_request(Sequence(list(range(400, 700)), 2), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                       events["long"].extend)
    engine.step()  # the long prompt's first 64 tokens
    engine.add_request(Sequence(list(range(300, 320)), 2), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                       events["short"].extend)
    before = engine.counters.prefill_tokens
    asked, budget = [], engine.pacer.budget
    engine.pacer.budget = lambda decodes: asked.append(decodes) or budget(decodes)
    engine.step()
    assert asked == [0, 1]  # nothing decodes; then the short prompt counts as one decoding
    # The short prompt's 20 and the long one's next 43: the short one's first token waits on
    # this step, which is paced as a decoding one (a lane less: 63 tokens at most).
    assert engine.counters.prefill_tokens - before == 63
    assert [e.kind for e in events["short"]] == ["admitted", "token"] and not any(e.kind == "token" for e in events["long"])
    while engine.has_work():
        engine.step()
    assert engine.is_idle() and sum(e.kind == "token" for e in events["long"]) == 2
