"""JSON mode: the recognizer against Python's json module, the sampler under a constraint,
and the engine through the server with the openai and ollama clients."""

from __future__ import annotations

import json
import random

import pytest

from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf.json_constraint import MAX_WHITESPACE, JsonObjectConstraint, JsonPrefix  # noqa: E402
from kvstream.hf.sampling import SamplingParams, first_accepted, sample  # noqa: E402


def feeds(text: str | bytes) -> tuple[bool, bool]:
    """(every byte taken, the object complete)."""
    state = JsonPrefix()
    ok = state.feed(text.encode() if isinstance(text, str) else text)
    return ok, ok and state.done


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["obj", "arr", "str", "int", "float", "lit"] if depth < 3 else ["str", "int", "float", "lit"])
    if kind == "obj":
        return {f"k{rng.randint(0, 99)}\u00e9\"\\": random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if kind == "arr":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "str":
        return "".join(rng.choice("ab \n\t\"\\/\u00fc\u4e2d\U0001f600\x01") for _ in range(rng.randint(0, 6)))
    if kind == "int":
        return rng.randint(-10**6, 10**6)
    if kind == "float":
        return rng.uniform(-1e6, 1e6) * 10 ** rng.randint(-30, 30)
    return rng.choice([True, False, None])


def test_every_prefix_of_a_json_object_is_taken_and_only_the_whole_is_complete():
    rng = random.Random(0)
    for _ in range(200):
        value = {"root": random_value(rng)}
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False), json.dumps(value, indent=2)):
            data = text.encode()
            assert feeds(data) == (True, True), text
            for cut in range(len(data)):
                assert feeds(data[:cut]) == (True, False), (text, cut)


@pytest.mark.parametrize("text", [
    "[]", '"x"', "1", "{a:1}", '{"a":01}', '{"a":1,}', '{"a" 1}', '{"a":tru}', '{"a":"\x01"}', '{"a":1}}',
    '{"a":1} ', '{"a":-}', '{"a":1.}', '{"a":[1,]}', '{"a":"\\x"}', "{,}", '{"a":1e}', '{"a":"\\u12G4"}',
    '{"a":[}', '{"a":{]}', "\u00e9{}", '{"a"\u00e9:1}',
])
def test_what_is_not_one_json_object_is_refused_at_some_byte(text):
    """Not a JSON object, or more after one (the answer ends where the object closes)."""
    assert feeds(text) == (False, False)


def test_random_byte_strings_are_complete_only_when_they_are_a_json_object():
    rng = random.Random(1)
    alphabet = b'{}[]:,"\\ 0123456789.-+eEtrunlfas\n\xc3\xa9'
    complete = 0
    for _ in range(20000):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        ok, done = feeds(b"{" + data)
        if done:
            complete += 1
            assert isinstance(json.loads(b"{" + data), dict)
        elif ok:  # a valid prefix: some continuation completes it
            state = JsonPrefix()
            state.feed(b"{" + data)
            assert not state.done
    assert complete > 10


def test_whitespace_outside_strings_is_capped_and_inside_strings_is_not():
    assert feeds(b"{" + b" " * MAX_WHITESPACE + b"}") == (True, True)
    assert feeds(b"{" + b" " * (MAX_WHITESPACE + 1))[0] is False
    assert feeds(b'{"a": "' + b" " * 100 + b'"}') == (True, True)


def test_the_constraint_refuses_special_tokens_and_empty_tokens_and_copies_apart():
    spelled = {0: b"{", 1: b'"a"', 2: b":", 3: b"1", 4: b"}", 5: b"<|im_end|>", 6: b""}
    constraint = JsonObjectConstraint(spelled.__getitem__, banned={5})
    assert constraint.accepts(0) and not constraint.accepts(5) and not constraint.accepts(6) and not constraint.accepts(4)
    constraint.advance(0)
    other = constraint.copy()
    for token in (1, 2, 3):
        assert constraint.accepts(token)
        constraint.advance(token)
    assert constraint.accepts(4) and other.accepts(4)  # '{}' is an object too
    constraint.advance(4)
    assert constraint.done and not other.done


def test_a_constrained_row_takes_the_best_token_it_accepts_greedy_or_sampled():
    spelled = {i: bytes([b]) for i, b in enumerate(b'x{}"a:1 ')}
    constraint = JsonObjectConstraint(spelled.__getitem__, banned=())
    scores = torch.tensor([9.0, 1.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # 'x' best, then '}', then '{'
    assert first_accepted(scores, constraint) == 1  # '{': the best that can begin an object
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(20)]
    drawn = sample(scores.repeat(20, 1), params, [p.make_generator() for p in params], constraints=[constraint] * 20)
    assert set(drawn) <= {1, 7}  # '{' or leading whitespace, never 'x' or '}'
    greedy = sample(scores[None], [SamplingParams(temperature=0)], [None], constraints=[constraint])
    assert greedy == [1]


# ---------------------------------------------------------------------- through the server
@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_json_mode_answers_one_json_object_streamed_or_not(hf_proxy, oa, temperature):
    prompts = ["Describe a cat as JSON with name and age.", "hi", "List three colors."]
    for seed, prompt in enumerate(prompts):
        reply = await oa.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=200, temperature=temperature,
            seed=seed, response_format={"type": "json_object"})
        text = reply.choices[0].message.content
        if reply.choices[0].finish_reason == "stop":  # the object closed: the answer ends there
            assert isinstance(json.loads(text), dict), text
        else:  # cut by max_tokens: still a prefix of one
            assert reply.choices[0].finish_reason == "length" and JsonPrefix().feed(text.encode())
        stream = await oa.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": prompt}], max_tokens=200, temperature=temperature,
            seed=seed, response_format={"type": "json_object"}, stream=True)
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(pieces) == text  # the same seed, the same constrained draws


async def test_n_choices_each_follow_their_own_json_state(oa):
    reply = await oa.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "A JSON object about a dog."}], max_tokens=200,
        temperature=1.0, seed=3, n=3, response_format={"type": "json_object"})
    for choice in reply.choices:
        assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)


async def test_ollamas_format_json_is_json_mode_and_a_schema_is_refused(hf_proxy, http):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "A cat as JSON."}], "stream": False,
            "format": "json", "options": {"temperature": 0, "num_predict": 200}}
    async with http.post(hf_proxy.url + "/api/chat", json=body) as resp:
        reply = await resp.json()
    assert reply["done_reason"] == "length" or isinstance(json.loads(reply["message"]["content"]), dict)
    async with http.post(hf_proxy.url + "/api/chat", json=body | {"format": {"type": "object"}}) as resp:
        assert resp.status == 400 and "schema" in (await resp.json())["error"]
