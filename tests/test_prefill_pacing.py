"""PrefillPacer: a step that decodes prefills as much as keeps it near its target time,
learned from the steps; a step that decodes nothing aims at IDLE_STEPS times as long."""

from __future__ import annotations

from kvstream.hf.prefill_pacing import FIRST_TOKENS, IDLE_STEPS, LEAST_TOKENS, PrefillPacer


def test_a_step_without_decodes_aims_at_idle_steps_times_the_target():
    assert PrefillPacer(0.5, 2048).budget(decodes=0) == 2048  # nothing measured, nobody waiting
    off = PrefillPacer(0.0, 2048)
    off.observe(2048, 10.0)
    assert off.budget(decodes=0) == 2048 and off.budget(decodes=3) == 2045  # pacing off: max_num_batched_tokens
    paced = PrefillPacer(0.5, 2048)
    paced.observe(2048, 10.0)  # 205 tokens/s: a newcomer would wait 10 s for such a step
    assert paced.budget(decodes=0) == int(204.8 * 0.5 * IDLE_STEPS) == 409
    paced.observe(2048, 0.5)  # fast: the whole budget
    assert paced.budget(decodes=0) == 2048


def test_a_decoding_step_prefills_what_its_target_allows_at_the_rate_learned():
    pacer = PrefillPacer(0.5, 2048)
    assert pacer.budget(decodes=2) == FIRST_TOKENS  # nothing measured yet
    pacer.observe(256, 0.8)  # 320 tokens/s
    assert pacer.budget(decodes=2) == 160
    pacer.observe(160, 0.8)  # 200 tokens/s: deeper in the prompt, slower; smoothed
    assert pacer.budget(decodes=2) == 130
    fast = PrefillPacer(0.5, 2048)
    fast.observe(2048, 0.01)  # a GPU: the budget is max_num_batched_tokens
    assert fast.budget(decodes=5) == 2043


def test_a_prompt_always_moves_on_and_small_samples_say_nothing():
    pacer = PrefillPacer(0.5, 2048)
    pacer.observe(100, 10.0)  # 10 tokens/s: decodes alone take longer than the target
    assert pacer.budget(decodes=40) == LEAST_TOKENS
    rate = pacer.rate
    pacer.observe(1, 0.2)  # a prompt's last token beside the decodes
    pacer.observe(LEAST_TOKENS - 1, 5.0)
    assert pacer.rate == rate
    assert PrefillPacer(0.5, 100).budget(decodes=60) == 40  # never past the step's token budget


def test_steps_converge_on_the_target():
    """A step costs fixed decode time plus prompt tokens at a true rate: the budget settles
    where the step takes about the target."""
    pacer, decode_s, true_rate = PrefillPacer(0.5, 2048), 0.1, 400.0
    for _ in range(12):
        tokens = pacer.budget(decodes=8)
        pacer.observe(tokens, decode_s + tokens / true_rate)
    step = decode_s + pacer.budget(decodes=8) / true_rate
    assert 0.45 <= step <= 0.55


def test_the_summary_shows_the_aim_the_rate_and_what_a_step_takes_now():
    pacer = PrefillPacer(0.5, 2048)
    assert pacer.summary() == {"step_ms": 500, "tokens_per_s": None, "tokens_beside_decodes": FIRST_TOKENS}
    pacer.observe(300, 1.0)
    assert pacer.summary() == {"step_ms": 500, "tokens_per_s": 300.0, "tokens_beside_decodes": 150}
