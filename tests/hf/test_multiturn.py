"""Multi-turn reuse in the in-process engine: generated tokens' KV is kept, so the next turn
of a conversation (history + reply + new message) reuses everything up to the first token
that differs, matched on token ids (the reply re-encoded inside the chat template need not
split into the tokens that were generated)."""

from __future__ import annotations


from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf.model_runner import RunnerConfig, ModelRunner  # noqa: E402
from kvstream.hf.loader import chat_token_ids  # noqa: E402
from kvstream.hf.sampling import SamplingParams  # noqa: E402
from kvstream.scheduler import Sequence  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0)
QUESTIONS = ["Name a large city.", "Why is it famous?", "Name a river there.", "How long is it?", "Thank you!"]


def template(tokenizer, messages) -> list[int]:
    return chat_token_ids(tokenizer, messages)


def run_turn(engine: ModelRunner, prompt: list[int]) -> tuple[list[int], int]:
    """(generated ids, prompt tokens served from the cache)."""
    seq = Sequence(prompt, GREEDY.max_tokens)
    out: list[int] = []
    engine.add_request(seq, GREEDY, lambda events: out.extend(e.token_id for e in events if e.kind == "token"))
    while engine.has_work():
        engine.step()
    return out, seq.num_cached_tokens


def test_each_turn_reuses_the_previous_one_and_answers_exactly_as_without_reuse(smollm2):
    model, _, tokenizer = smollm2
    block = 16
    cached = ModelRunner(model, tokenizer, RunnerConfig(block_size=block, num_blocks=2048, num_cpu_blocks=0, debug_invariants=True))
    plain = ModelRunner(model, tokenizer, RunnerConfig(block_size=block, num_blocks=2048, num_cpu_blocks=0, enable_prefix_caching=False))
    messages = [{"role": "system", "content": "You are a concise travel guide. " * 6}]
    previous: list[int] = []  # the last turn's prompt plus its generated tokens
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        prompt = template(tokenizer, messages)
        reply, reused = run_turn(cached, prompt)
        assert reply == run_turn(plain, prompt)[0], f"turn {turn}: reuse changed the answer"
        # By hand: the longest common token prefix with what the last turn computed (its
        # prompt and every generated token but the final one), leaving at least one prompt
        # token to compute: token for token when it reaches the last turn's partial last
        # block (kept when that turn finished), else in whole blocks.
        common = 0
        for a, b in zip(previous, prompt):
            if a != b:
                break
            common += 1
        usable = min(common, len(prompt) - 1)
        reaches_tail = usable >= len(previous) // block * block
        assert reused == (usable if reaches_tail else usable // block * block), f"turn {turn}"
        if turn >= 2:
            assert reused / len(prompt) >= 0.85, f"turn {turn}: only {reused}/{len(prompt)} reused"
        previous = prompt + reply[:-1]
        messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
    assert cached.is_idle()
