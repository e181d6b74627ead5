"""Sampling parameters and incremental detokenizing with stop strings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf.detokenize import IncrementalDetokenizer, held_back  # noqa: E402
from kvstream.hf.sampling import UNDRAWN, History, NoTokenToDraw, SamplingParams, adjust, logprobs_of, sample  # noqa: E402


def logits(rows: int = 3, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))


def test_greedy_top_k_one_and_tiny_or_zero_top_p_all_take_the_argmax():
    x = logits(rows=4)
    best = x.argmax(-1).tolist()
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_p=0)]
    gens = [p.make_generator() for p in params]
    assert sample(x, params, gens) == best


def test_infinite_biases_are_numbers_not_nan():
    """(inf plus -inf summed is NaN: the NaN check looks at each value.)"""
    SamplingParams(logit_bias={1: float("inf"), 2: float("-inf")})


def test_a_temperature_too_small_for_float32_is_greedy():
    """1e-320 is 0 in float32: the logits over it were infinite, the distribution NaN, and
    torch's draw raised inside the step (every running request failed with it)."""
    x = logits(rows=3)
    tiny = [SamplingParams(temperature=t, seed=1) for t in (1e-320, 1e-38, 9e-6)]
    assert all(p.greedy for p in tiny) and not SamplingParams(temperature=1e-4).greedy
    assert sample(x, tiny, [p.make_generator() for p in tiny]) == x.argmax(-1).tolist()


def test_a_repeat_penalty_near_zero_leaves_a_distribution_of_the_repeated_tokens():
    """llama.cpp takes any penalty above 0: near 0 a repeated token's positive logit is
    infinite, kept the largest finite one, so the draw is among those tokens."""
    x = logits(rows=1)
    history = History(prompt=list(range(10)), output=[])
    repeated = {t for t in range(10) if x[0, t] > 0}
    for seed in range(5):
        p = SamplingParams(repeat_penalty=1e-300, temperature=0.8, seed=seed)
        assert sample(x, [p], [p.make_generator()], [history])[0] in repeated


def test_a_row_left_nothing_to_draw_fails_alone():
    x = logits(rows=3)
    x[1] = float("-inf")  # no token with any mass
    params = [SamplingParams(seed=1), SamplingParams(seed=2), SamplingParams(temperature=0)]
    gens = [p.make_generator() for p in params]
    failed: dict[int, Exception] = {}
    tokens = sample(x, params, gens, failed=failed)
    assert list(failed) == [1] and isinstance(failed[1], NoTokenToDraw) and "leave no token to draw" in str(failed[1])
    assert tokens[1] == UNDRAWN and tokens[0] >= 0 and tokens[2] == int(x[2].argmax())
    with pytest.raises(NoTokenToDraw):  # (asked alone: raised)
        sample(x[1:2], params[1:2], gens[1:2])


def test_a_row_whose_constraint_raises_fails_alone():
    class Broken:
        def accepts(self, token: int) -> bool:
            raise KeyError("its own state")

    x = logits(rows=2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0)]
    failed: dict[int, Exception] = {}
    tokens = sample(x, params, [None, None], constraints=[Broken(), None], failed=failed)
    assert isinstance(failed[0], KeyError) and tokens == [UNDRAWN, int(x[1].argmax())]


def test_seed_reproduces_a_draw_whatever_else_is_in_the_batch():
    x = logits(rows=2)
    alone = sample(x[:1], [SamplingParams(seed=3)], [SamplingParams(seed=3).make_generator()])
    mixed = sample(x, [SamplingParams(seed=3), SamplingParams(seed=9)], [SamplingParams(seed=3).make_generator(), SamplingParams(seed=9).make_generator()])
    assert mixed[0] == alone[0]


def test_top_k_never_draws_outside_the_k_best():
    x = logits(rows=1)
    allowed = set(torch.topk(x[0], 3).indices.tolist())
    p = SamplingParams(top_k=3, temperature=2.0, seed=0)
    gen = p.make_generator()
    assert all(sample(x, [p], [gen])[0] in allowed for _ in range(50))


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"top_p": -0.1}, {"top_p": 1.5}, {"top_k": -2}, {"max_tokens": -1}, {"prompt_logprobs": 21},
               # NaN (Python's json reads a client's) passes range checks: each named.
               {"temperature": float("nan")}, {"repeat_penalty": float("nan")}, {"presence_penalty": float("nan")},
               {"min_p": float("nan")}, {"logit_bias": {5: 1.0, 7: float("nan")}}]
)
def test_invalid_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_logit_bias_decides_a_greedy_choice_and_can_ban_a_token():
    x = logits(rows=1)
    best = int(x[0].argmax())
    third = int(x[0].argsort(descending=True)[2])
    assert sample(x, [SamplingParams(temperature=0, logit_bias={third: 100.0})], [None]) == [third]
    banned = SamplingParams(temperature=0, logit_bias={best: -100.0})
    assert sample(x, [banned], [None]) != [best]
    assert banned.adjusts_logits and not SamplingParams().adjusts_logits


def test_logit_bias_is_made_into_tensors_once_per_request_not_at_every_step():
    """The bias is the dict's, ids past the logits' width left out (padding rows), and its
    tensors are built at the first step and reused: built from a whole vocabulary's dict at
    every step they cost 7 ms of Python per row (benchmarks/logit_bias.py)."""
    x = torch.zeros(8)
    p = SamplingParams(logit_bias={1: 2.5, 6: float("-inf"), 9: 1.0})  # 9: past the logits
    out = adjust(x, p, None)
    assert out[1] == 2.5 and out[6] == float("-inf") and out[[0, 2, 3, 4, 5, 7]].eq(0).all()
    ids, values = p.bias_tensors(8, x.device)
    assert p.bias_tensors(8, x.device)[0] is ids  # the same tensors at the next step
    assert adjust(x, p, None).equal(out) and p.bias_tensors(8, x.device)[1] is values
    assert sorted(ids.tolist()) == [1, 6]
    assert sorted(p.bias_tensors(10, x.device)[0].tolist()) == [1, 6, 9]  # another width: made again


def test_a_large_logit_bias_map_is_read_once_per_request():
    """A request's fields are read on its worker thread and again for submit, on the event
    loop: a map of a whole vocabulary is read the first time only (by the identity of the
    client's map), and a map refused is refused every time."""
    from kvstream.hf import request_options
    from kvstream.types import BackendRejected

    extra = {"logit_bias": {str(i): -1.5 for i in range(5000)}}
    first = request_options.logit_bias(extra, 49152)
    assert first == {i: -1.5 for i in range(5000)}
    assert request_options.logit_bias(extra, 49152) is first  # read once
    assert id(extra["logit_bias"]) not in request_options._READ_BIASES  # the second reading took it: nothing held after
    assert request_options.logit_bias({"logit_bias": dict(extra["logit_bias"])}, 49152) is not first  # another map
    with pytest.raises(BackendRejected):
        request_options.logit_bias(extra, 4000)  # another vocabulary: read again, and past it
    bad = {"logit_bias": {**extra["logit_bias"], "7": True}}
    for _ in range(2):
        with pytest.raises(BackendRejected, match="expected a number"):
            request_options.logit_bias(bad, 49152)


def test_presence_and_frequency_penalties_follow_openais_formula():
    """logit[j] - count[j] * frequency - (count[j] > 0) * presence, counted over the output."""
    x = torch.zeros(6)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = adjust(x, p, History(prompt=[5, 5, 5], output=[1, 1, 2]))
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0, 0.0, 0.0]  # the prompt's 5 is not penalized
    assert x.tolist() == [0.0] * 6  # a new tensor: the batch's logits stay as computed


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits_over_the_last_n():
    x = torch.tensor([2.0, -2.0, 2.0, 2.0])
    p = SamplingParams(repeat_penalty=2.0, repeat_last_n=3)
    out = adjust(x, p, History(prompt=[3, 0], output=[1, 0]))  # the last 3: 0, 1, 0
    assert out.tolist() == [1.0, -4.0, 2.0, 2.0]
    everything = adjust(x, SamplingParams(repeat_penalty=2.0, repeat_last_n=-1), History(prompt=[3, 0], output=[1]))
    assert everything.tolist() == [1.0, -4.0, 2.0, 1.0]
    assert adjust(x, SamplingParams(repeat_penalty=2.0, repeat_last_n=0), History([3], [1])).tolist() == x.tolist()


def test_a_greedy_row_with_penalties_reads_its_own_history():
    x = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0, frequency_penalty=1.0), SamplingParams(temperature=0)]
    assert sample(x, params, [None, None], [History([], [0]), None]) == [1, 0]


def test_min_p_keeps_only_tokens_near_the_most_likely():
    x = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))
    p = SamplingParams(min_p=0.5, seed=0)
    gen = p.make_generator()
    assert {sample(x, [p], [gen])[0] for _ in range(60)} == {0, 1}


@pytest.mark.parametrize("mass", [0.0, 0.2, 0.5, 0.9, 0.99])
def test_typical_keeps_the_tokens_transformers_typical_warper_keeps(mass):
    """Locally typical sampling against transformers' own warper (min_tokens_to_keep 1) on
    random distributions, a peaked one and one with tokens already truncated to 0."""
    from transformers import TypicalLogitsWarper

    from kvstream.hf.sampling import typical

    torch.manual_seed(0)
    rows = [torch.randn(50) * 3, torch.tensor([8.0, 1.0, 0.5, 0.0, -1.0]), torch.randn(30)]
    rows[2][::3] = float("-inf")  # (top-k before it)
    for x in rows:
        probs = torch.softmax(x, dim=-1)
        kept = typical(probs, mass) > 0
        reference = TypicalLogitsWarper(mass if mass > 0 else 1e-9)(None, x[None].clone())[0] > float("-inf")
        assert kept.tolist() == reference.tolist(), (mass, x)
        assert torch.equal(typical(probs, mass)[kept], probs[kept])  # the kept keep their probability


def test_typical_p_samples_only_from_the_typical_set():
    x = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1]]))  # entropy 1.22 nats; -log p: 0.69, 1.61, 1.61, 2.30
    p = SamplingParams(typical_p=0.35, seed=0)
    gen = p.make_generator()
    assert {sample(x, [p], [gen])[0] for _ in range(60)} == {1, 2}  # the 0.2s are nearest the entropy


def test_logprobs_are_the_models_own_distribution_with_the_k_best():
    x = logits(rows=2)
    tokens = [3, 7]
    out = logprobs_of(x, [0, 1], tokens, [2, 0])
    reference = torch.log_softmax(x, dim=-1)
    assert out[0].logprob == pytest.approx(float(reference[0, 3]))
    best = reference[0].topk(2)
    assert [i for i, _ in out[0].top] == best.indices.tolist()
    assert [lp for _, lp in out[0].top] == pytest.approx(best.values.tolist())
    assert out[1].top == [] and out[1].logprob == pytest.approx(float(reference[1, 7]))
    assert logprobs_of(x, [], [], []) == []


@pytest.mark.parametrize(
    "kwargs", [{"min_p": 1.5}, {"typical_p": 1.5}, {"typical_p": -0.1}, {"repeat_penalty": 0}, {"repeat_last_n": -2},
               {"logprobs": 21}, {"logprobs": -1}]
)
def test_invalid_new_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[2]


def stream(tokenizer, text: str, stop: list[str]) -> tuple[str, bool]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    out = ""
    for token in tokenizer(text).input_ids:
        out += detok.add(token)
        if detok.stopped:
            return out, True
    return out + detok.flush(), False


def test_incremental_text_equals_decoding_everything(tokenizer):
    text = "Héllo wörld — naïve café 😀 résumé, twelve   spaces\nnew line"
    assert stream(tokenizer, text, [])[0] == tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True)


def test_stop_string_split_across_tokens_is_cut_and_never_leaked(tokenizer):
    out, stopped = stream(tokenizer, "alpha beta END_OF_TEXT gamma", ["END_OF"])
    assert stopped and out == "alpha beta "


def test_a_partial_stop_match_is_released_when_it_turns_out_not_to_be_one(tokenizer):
    out, stopped = stream(tokenizer, "alpha ENDING beta", ["END!"])
    assert not stopped and out == "alpha ENDING beta"


def test_the_stop_string_that_begins_first_ends_the_text_whatever_their_order(tokenizer):
    # " beta" is held back (it may begin "beta gamma"); " gamma" then completes both stops.
    detok = IncrementalDetokenizer(tokenizer, ["gamma", "beta gamma", "delta"])
    out = ""
    for token in tokenizer("alpha beta gamma").input_ids:
        out += detok.add(token)
        if detok.stopped:
            break
    assert detok.stopped and out == "alpha " and detok.matched_stop == "beta gamma"


def _held_back_by_every_length(text: str, stops: list[str]) -> int:
    """The definition: the largest n < len(stop) with text ending in stop's first n characters."""
    return max((n for stop in stops for n in range(1, min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:n])),
               default=0)


@given(st.text("ab\n", max_size=12), st.lists(st.text("ab\n", min_size=1, max_size=6), min_size=1, max_size=4))
def test_what_is_held_back_is_the_longest_end_that_begins_a_stop(text, stops):
    if any(stop in text for stop in stops):
        return  # (a whole stop string ends the text before anything is held)
    assert held_back(text, stops) == _held_back_by_every_length(text, stops)


def test_more_stop_strings_than_the_engine_takes_are_a_400_naming_stop():
    """Each stop string is looked for at every token on the engine's thread: past
    MAX_STOP_STRINGS (llama-server's /completion and Ollama's options take any number) the
    request is refused before it runs."""
    from kvstream.hf.request_options import MAX_STOP_STRINGS, sampling_params
    from kvstream.types import BackendRejected, GenerateRequest

    stops = [f"stop {i}" for i in range(MAX_STOP_STRINGS + 1)]
    assert sampling_params(GenerateRequest(None, prompt="x", stop=stops[:-1]), 8).stop == stops[:-1]
    with pytest.raises(BackendRejected) as err:
        sampling_params(GenerateRequest(None, prompt="x", stop=stops), 8)
    assert err.value.status == 400 and err.value.param == "stop" and f"{MAX_STOP_STRINGS + 1} stop strings" in err.value.message
