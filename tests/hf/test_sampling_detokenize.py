"""Sampling parameters and incremental detokenizing with stop strings."""

from __future__ import annotations

import pytest

from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf.detokenize import IncrementalDetokenizer  # noqa: E402
from kvstream.hf.sampling import SamplingParams, sample  # noqa: E402


def logits(rows: int = 3, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))


def test_greedy_top_k_one_and_tiny_or_zero_top_p_all_take_the_argmax():
    x = logits(rows=4)
    best = x.argmax(-1).tolist()
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_p=0)]
    gens = [p.make_generator() for p in params]
    assert sample(x, params, gens) == best


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
    "kwargs", [{"temperature": -1}, {"top_p": -0.1}, {"top_p": 1.5}, {"top_k": -2}, {"max_tokens": 0}]
)
def test_invalid_parameters_are_refused(kwargs):
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
