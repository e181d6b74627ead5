"""JSON mode (the schema ``JSON_OBJECT`` on the incremental machine) against Python's json
module, the sampler under a constraint, and the engine through the server with the openai
and ollama clients."""

from __future__ import annotations

import json
import random
import re

import pytest

from tests.conftest import require_import

torch = require_import("torch")

from kvstream.hf.json_schema import JSON_OBJECT, MAX_INDENT, compile_schema  # noqa: E402
from kvstream.hf.pattern_constraint import PatternConstraint  # noqa: E402
from kvstream.hf.sampling import SamplingParams, first_accepted, sample  # noqa: E402


def json_mode(token_bytes=lambda token: bytes([token]), banned=()) -> PatternConstraint:
    """JSON mode's constraint, as the engine builds it; by default over a vocabulary of the
    256 single bytes."""
    return PatternConstraint(compile_schema(JSON_OBJECT), token_bytes, banned)


def feeds(text: str | bytes) -> tuple[bool, bool]:
    """(every byte taken, the object complete)."""
    constraint = json_mode()
    for byte in text.encode() if isinstance(text, str) else text:
        if not constraint.accepts(byte):
            return False, False
        constraint.advance(byte)
    return True, constraint.done


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


PADDING = re.compile(rb" [ \n]|\n\n")  # whitespace a JSON object may hold that the recognizer refuses


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
        elif not ok:  # refused: no JSON object begins so (Python's parser agrees on the whole), or padding does
            try:
                json.loads(b"{" + data + b"}")
            except ValueError:
                continue
            assert PADDING.search(data), data
    assert complete > 10


def test_whitespace_outside_strings_is_one_space_or_a_newline_and_an_indent_and_inside_strings_free():
    """llama.cpp's JSON grammars' rule: compact and pretty-printed JSON pass, padding does not."""
    assert feeds(b'{"a": 1, "b": [1, 2]}') == (True, True)
    assert feeds(b'{\n\t"a":\n' + b" " * MAX_INDENT + b"1\n}") == (True, True)
    for padded in (b"{  ", b"{\n\n", b"{ \n", b"{\t", b"{\r\n", b'{"a"  :', b'{"a":1 ,\n\n', b"{\n" + b" " * (MAX_INDENT + 1)):
        assert feeds(padded)[0] is False, padded
    assert feeds(b'{"a": "' + b" " * 100 + b'"}') == (True, True)


def test_the_constraint_refuses_special_tokens_and_empty_tokens_and_copies_apart():
    spelled = {0: b"{", 1: b'"a"', 2: b":", 3: b"1", 4: b"}", 5: b"<|im_end|>", 6: b""}
    constraint = json_mode(spelled.__getitem__, banned={5})
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
    constraint = json_mode(spelled.__getitem__)
    scores = torch.tensor([9.0, 1.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # 'x' best, then '}', then '{'
    assert first_accepted(scores, constraint) == 1  # '{': the best that can begin an object
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(20)]
    drawn = sample(scores.repeat(20, 1), params, [p.make_generator() for p in params], constraints=[constraint] * 20)
    assert set(drawn) == {1}  # '{', never 'x', '}' or leading whitespace
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
            assert reply.choices[0].finish_reason == "length" and feeds(text)[0]
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


async def test_ollamas_format_json_is_json_mode_and_a_schema_it_cannot_follow_is_refused(hf_proxy, http):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "A cat as JSON."}], "stream": False,
            "format": "json", "options": {"temperature": 0, "num_predict": 200}}
    async with http.post(hf_proxy.url + "/api/chat", json=body) as resp:
        reply = await resp.json()
    assert reply["done_reason"] == "length" or isinstance(json.loads(reply["message"]["content"]), dict)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}
    async with http.post(hf_proxy.url + "/api/chat", json=body | {"format": schema}) as resp:
        assert resp.status == 400 and "minimum" in (await resp.json())["error"]


# ------------------------------------------------------------------------ structured outputs
from pydantic import BaseModel  # noqa: E402

from kvstream.hf.json_schema import SchemaError, schema_pattern  # noqa: E402


class Pet(BaseModel):
    name: str
    age: int
    kind: str
    owner: str | None = None
    tags: list[str]


class Household(BaseModel):
    pets: list[Pet]
    city: str
    score: float
    indoor: bool


class Topic(BaseModel):
    """A self-referencing model: its schema's ``$ref`` is recursive."""

    title: str
    subtopics: list[Topic]


Topic.model_rebuild()


def test_a_schemas_expression_takes_what_it_admits_prefix_by_prefix_and_nothing_else():
    pattern = compile_schema(Household.model_json_schema())
    answers = [
        Household(pets=[Pet(name="Tom", age=3, kind="cat", tags=["a", 'b\\"c'])], city="Paris", score=1.5, indoor=True),
        Household(pets=[], city="", score=-2e-3, indoor=False),
        Household(pets=[Pet(name="Rex \u00e9", age=0, kind="dog", owner="Ann", tags=[])], city="Oslo", score=0, indoor=False),
    ]
    for answer in answers:
        for text in (answer.model_dump_json(), answer.model_dump_json(indent=2)):
            assert pattern.fullmatch(text) is not None, text
            assert all(pattern.fullmatch(text[:cut], partial=True) for cut in range(len(text)))
            Household.model_validate_json(text)
    for wrong in ('{"city": "x"}', '{"pets": [], "city": 1, "score": 1, "indoor": true}',
                  '{"pets": [{"name": "a"}], "city": "x", "score": 1, "indoor": true}',
                  '{"pets": [], "city": "x", "score": 1, "indoor": true, "more": 1}'):
        assert pattern.fullmatch(wrong) is None, wrong


@pytest.mark.parametrize(("schema", "complaint"), [
    ({"type": "string", "pattern": "^x"}, "'pattern' is not supported"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}, "'pattern' is not supported"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 3}}}, "'minimum' is not supported"),
    ({"type": "object", "properties": {"a": {"allOf": [{}]}}}, "'allOf' is not supported"),
    ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "refers to itself outside any object or array"),
    ({"type": "object", "properties": {"a": {"$ref": "https://x/y"}}}, "local references"),
])
def test_what_a_schema_asks_beyond_the_expression_is_refused_not_ignored(schema, complaint):
    with pytest.raises(SchemaError, match=complaint):
        schema_pattern(schema)


def test_a_recursive_schema_is_followed_and_one_no_value_can_satisfy_is_refused():
    """A tree of nodes (pydantic's self-referencing models), a linked list through ``#``: each
    reference a rule the expression calls. A node that must always hold a node cannot end:
    a 400 up front, not an answer cut at max_tokens."""
    tree = {"$defs": {"Node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}},
        "$ref": "#/$defs/Node"}
    nested = '{"name": "a", "children": [{"name": "b", "children": []}, {"name": "c", "children": [' \
             '{"name": "d", "children": []}]}]}'
    linked = {"type": "object", "properties": {"value": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    for schema, good, bad in ((tree, nested, '{"name": "a", "children": [{"name": "b"}]}'),
                              (linked, '{"value": 1, "next": {"value": 2, "next": null}}', '{"value": 1, "next": {"value": 2}}')):
        pattern = compile_schema(schema)
        assert pattern.fullmatch(good) and not pattern.fullmatch(bad)
        spelled = {i: bytes([b]) for i, b in enumerate(range(256))}
        constraint = PatternConstraint(pattern, spelled.__getitem__, ())
        assert constraint.machine is not None
        for byte in good.encode():
            assert constraint.accepts(byte), good
            constraint.advance(byte)
        assert constraint.done
    # A schema that says nothing: any JSON value, at any depth (one recursive rule).
    free = compile_schema({"type": "object", "properties": {"a": {}, "b": {"type": "object"}}})
    assert free.fullmatch('{"a": [[[[[{"x": [1, {"y": null}]}]]]]], "b": {"k": {"z": [[]]}}}')
    assert not free.fullmatch('{"a": [1,], "b": {}}') and not free.fullmatch('{"a": 1, "b": []}')
    # JSON pointer escapes in a reference: ~1 is "/", ~0 is "~".
    escaped = compile_schema({"$defs": {"a/b~c": {"enum": ["x"]}}, "type": "array", "items": {"$ref": "#/$defs/a~1b~0c"}})
    assert escaped.fullmatch('["x", "x"]') and not escaped.fullmatch('["y"]')
    with pytest.raises(SchemaError, match="does not resolve"):
        compile_schema({"$defs": {"a/b": {"enum": ["x"]}}, "$ref": "#/$defs/a/b"})
    endless = {"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}}}, "$ref": "#/$defs/N"}
    with pytest.raises(SchemaError, match="no JSON value satisfies"):
        compile_schema(endless)


def test_the_schema_constraint_spells_tokens_and_ends_at_the_root_objects_close():
    spelled = {0: b'{"a"', 1: b":", 2: b" 1", 3: b"}", 4: b'"x"', 5: b"\xc3", 6: b"\xa9", 7: b"<|im_end|>"}
    constraint = PatternConstraint(
        compile_schema({"type": "object", "properties": {"a": {"type": "integer"}}}), spelled.__getitem__, banned={7})
    assert constraint.accepts(0) and not constraint.accepts(4) and not constraint.accepts(7)
    for token in (0, 1, 2):
        constraint.advance(token)
    assert not constraint.done and not constraint.accepts(4) and constraint.accepts(3)
    constraint.advance(3)
    assert constraint.done and not constraint.accepts(2)
    spelled[8] = b'{"s": "'
    text = PatternConstraint(compile_schema({"type": "object", "properties": {"s": {"type": "string"}}}), spelled.__getitem__, ())
    text.advance(8)
    assert text.accepts(5)  # half of "é": a string may hold it
    text.advance(5)
    assert text.accepts(6) and not text.done


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_the_candidate_mask_holds_every_token_the_constraint_accepts(smollm2, kind):
    """Past the model's best tokens the choice looks only at the candidates (a first-byte
    mask): no token outside it is ever accepted, and the choice is the one a scan of the
    whole vocabulary in the model's order finds."""
    from kvstream.hf.token_bytes import TokenBytes

    model, _, tokenizer = smollm2
    spell, vocab = TokenBytes(tokenizer), model.config.vocab_size
    schema = {"type": "object", "properties": {"title": {"type": "string"}, "kind": {"enum": ["animal", "place"]},
                                               "facts": {"type": "array", "items": {"type": "integer"}}}}
    constraint = PatternConstraint(compile_schema(JSON_OBJECT if kind == "json_object" else schema), spell, ())
    text = '{"title": "Cats é", "kind": "animal", "facts": [4, 20]}'
    generator = torch.Generator().manual_seed(0)
    for step, token in enumerate(tokenizer(text).input_ids):
        mask = constraint.candidates(vocab)
        assert not any(constraint.accepts(t) for t in (~mask).nonzero().squeeze(1).tolist())
        assert mask[token]
        if step % 4 == 0:
            scores = torch.randn(vocab, generator=generator)
            scan = next(t for t in scores.argsort(descending=True).tolist() if constraint.accepts(t))
            assert first_accepted(scores, constraint) == scan
        constraint.advance(token)


def test_every_tokens_bytes_read_at_once_equal_each_read_alone(smollm2):
    """``spell_all`` (one tokenizer call for the vocabulary, what the first-byte table is read
    from) spells every id as the id alone is spelled, and the table is each id's first byte."""
    from kvstream.hf.token_bytes import TokenBytes, first_bytes

    model, _, tokenizer = smollm2
    vocab = model.config.vocab_size
    alone, at_once = TokenBytes(tokenizer), TokenBytes(tokenizer)
    at_once.spell_all(vocab)
    assert all(alone(i) == at_once(i) for i in range(vocab))
    table = first_bytes(at_once, vocab).tolist()
    assert table == [raw[0] if (raw := alone(i)) else 256 for i in range(vocab)]


async def test_a_started_backend_has_read_the_first_byte_table(smollm2):
    """Read at start on the engine's thread: at a request's first constrained step it paused
    every stream (0.13-0.4 s on SmolLM2's vocabulary)."""
    from kvstream.hf.token_bytes import _FIRST_BYTES
    from tests.hf.conftest import started_backend

    async with started_backend(smollm2) as backend:
        entry = _FIRST_BYTES.get(id(backend.runner.token_bytes))
        assert entry is not None and entry[1].numel() == smollm2[0].config.vocab_size


async def test_a_tokenizer_that_cannot_spell_every_id_does_not_fail_the_start(smollm2):
    """A slow tokenizer raises for ids past its own length (a model's padded vocabulary):
    those ids spell nothing (no constraint admits them), and the table is read at start."""
    import copy

    from kvstream.hf.backend import HFBackend
    from kvstream.hf.loader import LoadedModel
    from kvstream.hf.token_bytes import _FIRST_BYTES
    from tests.conftest import make_settings

    model, _, tokenizer = smollm2
    short = copy.copy(tokenizer)
    spell = tokenizer.convert_ids_to_tokens

    def convert(ids, *args, **kwargs):
        if max(ids if isinstance(ids, list) else [ids]) >= model.config.vocab_size - 8:
            raise IndexError("piece id is out of range.")
        return spell(ids, *args, **kwargs)

    short.convert_ids_to_tokens = convert
    backend = HFBackend(None, None, make_settings(memory={"num_gpu_blocks": 64}),
                        preloaded=LoadedModel(model, short, "smollm2", "hf:test"))
    await backend.start()
    try:
        entry = _FIRST_BYTES.get(id(backend.runner.token_bytes))
        assert entry is not None and entry[1][-8:].tolist() == [256] * 8 and entry[1][0] != 256
    finally:
        await backend.close()


async def test_the_openai_clients_parse_gets_its_pydantic_model(oa):
    """``client.chat.completions.parse(response_format=Model)``: the strict schema the client
    sends is honoured and every answer that closed validates as the model."""
    from openai import LengthFinishReasonError

    parsed = 0
    for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2), (0.7, 3)):
        try:
            reply = await oa.chat.completions.parse(
                model="smollm2", messages=[{"role": "user", "content": "Describe a household with two pets."}],
                response_format=Household, max_tokens=400, temperature=temperature, seed=seed)
        except LengthFinishReasonError as exc:  # cut by max_tokens (a 135M model likes long strings): a prefix
            text = exc.completion.choices[0].message.content
            assert compile_schema(Household.model_json_schema()).fullmatch(text, partial=True), text
            continue
        assert isinstance(reply.choices[0].message.parsed, Household)
        parsed += 1
    assert parsed >= 1, parsed


async def test_the_openai_clients_parse_gets_a_self_referencing_model(oa):
    """A recursive pydantic model (a topic and its subtopics) through ``parse``: followed, not
    refused; an answer that closed validates, one cut by max_tokens is a prefix of a match."""
    from openai import LengthFinishReasonError

    pattern = compile_schema(Topic.model_json_schema())
    for temperature, seed in ((0.0, 0), (0.8, 1)):
        try:
            reply = await oa.chat.completions.parse(
                model="smollm2", messages=[{"role": "user", "content": "Outline the topic 'cooking' with subtopics."}],
                response_format=Topic, max_tokens=160, temperature=temperature, seed=seed)
        except LengthFinishReasonError as exc:
            text = exc.completion.choices[0].message.content
            assert pattern.fullmatch(text, partial=True) and not pattern.fullmatch(text), text
            continue
        assert isinstance(reply.choices[0].message.parsed, Topic)


async def test_a_schema_the_engine_cannot_follow_is_a_400_and_ollamas_schema_format_works(hf_proxy, oa, http):
    from openai import BadRequestError

    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
    with pytest.raises(BadRequestError) as err:
        await oa.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert err.value.param == "response_format" and "pattern" in err.value.message
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "A pet."}], "stream": False,
            "format": Pet.model_json_schema(), "options": {"temperature": 0, "num_predict": 200}}
    async with http.post(hf_proxy.url + "/api/chat", json=body) as resp:
        reply = await resp.json()
    assert reply["done_reason"] == "length" or Pet.model_validate_json(reply["message"]["content"])


def test_maps_follow_additional_properties_and_malformed_bounds_are_schema_errors():
    pattern = compile_schema({"type": "object", "properties": {"m": {"type": "object", "additionalProperties": {"type": "integer"}}}})
    assert pattern.fullmatch('{"m": {"a": 1, "b": -2}}') and pattern.fullmatch('{"m": {}}')
    assert pattern.fullmatch('{"m": {"a": "x"}}') is None
    for bad in ({"type": "object", "properties": {"s": {"type": "string", "minLength": "x"}}},
                {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10**12}}}):
        with pytest.raises(SchemaError):
            compile_schema(bad)


def test_a_root_that_is_not_an_object_ends_when_whole_and_a_number_with_the_end_token():
    """A schema's root may be any value (llama-server and vLLM take them): a string, an
    array or a constant ends at its close; a number, whole at every digit, may go on or end
    with the model's end token, which the constraint otherwise refuses."""
    spelled = {0: b"4", 1: b"2", 2: b'"foo', 3: b'oooo"', 4: b"[", 5: b"]", 6: b" ", 7: b"<|im_end|>", 8: b"x"}
    number = PatternConstraint(compile_schema({"type": "integer"}), spelled.__getitem__, banned={7}, end_ids={7})
    assert not number.accepts(7) and not number.accepts(2) and number.accepts(0)
    number.advance(0)
    assert number.complete and not number.done and number.accepts(1) and number.accepts(7) and not number.accepts(8)
    assert number.candidates(9)[7] and not number.candidates(9)[8]
    copy = number.copy()
    number.advance(1)
    assert number.complete and number.accepts(7) and copy.text == b"4" and copy.accepts(7)
    const = PatternConstraint(compile_schema({"const": "foooooo"}), spelled.__getitem__, banned={7}, end_ids={7})
    assert const.accepts(2) and not const.accepts(0) and not const.accepts(7)
    const.advance(2)
    assert not const.complete and const.accepts(3)
    const.advance(3)
    assert const.done and not const.accepts(7)  # closed: it ends here, no end token asked
    items = PatternConstraint(compile_schema({"type": "array", "items": {"type": "integer"}}), spelled.__getitem__,
                              banned={7}, end_ids={7})
    for token in (4, 0, 5):
        assert items.accepts(token)
        items.advance(token)
    assert items.done
    for schema, text in (({"enum": ["yes", "no"]}, '"no"'), ({"type": "boolean"}, "true"), ({"type": "null"}, "null"),
                         ({"anyOf": [{"type": "string"}, {"type": "number"}]}, "-1.5e3")):
        assert compile_schema(schema).fullmatch(text), schema


async def test_non_object_roots_through_the_openai_client(oa, smollm2):
    """``response_format`` schemas whose root is a constant, a number or an enum: the answer
    is that value, ended by its close or, for the number, by the end token (made the model's
    favourite here: it may only come once a digit is written)."""
    ask = [{"role": "user", "content": "How many legs has a cat? Answer with a number."}]
    end = smollm2[2].convert_tokens_to_ids("<|im_end|>")

    async def answer(schema: dict, **kwargs) -> tuple[str, str]:
        reply = await oa.chat.completions.create(
            model="smollm2", messages=ask, max_tokens=24, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}, **kwargs)
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    assert await answer({"const": "foooooo"}) == ('"foooooo"', "stop")
    text, reason = await answer({"type": "integer"}, logit_bias={str(end): 100})
    assert reason == "stop" and re.fullmatch("-?[0-9]", text), text
    text, reason = await answer({"type": "integer"})  # the model's own choice: digits until it ends or the limit
    assert re.fullmatch("-?[0-9]+", text) and (reason == "stop" or len(text) >= 20), (text, reason)
    text, reason = await answer({"enum": ["three", "four"]})
    assert reason == "stop" and json.loads(text) in ("three", "four")


async def test_json_mode_with_a_schema_is_held_to_the_schema_as_llama_server_holds_it(oa):
    """llama-server's ``response_format: {"type": "json_object", "schema": ...}``: JSON mode
    held to the schema (an array of integers here, where plain JSON mode would write an
    object); a schema that is not one, or that the engine cannot follow, is a 400."""
    from openai import BadRequestError

    ask = [{"role": "system", "content": "You are a coding assistant."}, {"role": "user", "content": "Write an example"}]
    for schema, check in (({"type": "array", "items": {"type": "integer"}}, lambda v: all(isinstance(i, int) for i in v)),
                          ({"const": "42"}, lambda v: v == "42")):
        reply = await oa.chat.completions.create(model="smollm2", messages=ask, max_tokens=40, temperature=0,
                                                 response_format={"type": "json_object", "schema": schema})
        text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert compile_schema(schema).fullmatch(text) if reason == "stop" else compile_schema(schema).fullmatch(
            text, partial=True), (text, reason)
        assert reason == "length" or check(json.loads(text)), text
    for bad in (123, {"type": "hiccup"}, {"type": 123}):
        with pytest.raises(BadRequestError) as err:
            await oa.chat.completions.create(model="smollm2", messages=ask, max_tokens=4,
                                             response_format={"type": "json_object", "schema": bad})
        assert err.value.param == "response_format", bad


def test_tuples_write_each_listed_item_then_the_rest_as_the_schema_says():
    """``prefixItems`` (2020-12) and ``items`` as a list (older drafts, what llama.cpp's tests
    send): the listed items in order, each of them (as llama.cpp's converter writes a
    tuple), then more only where ``items`` / ``additionalItems`` allow; the counts bound the
    whole; bounds a tuple cannot meet are a SchemaError, not an expression that never ends."""
    def accepted(schema, *texts):
        pattern = compile_schema(schema)
        return [bool(pattern.fullmatch(text)) for text in texts]

    assert accepted({"items": [{"type": "integer"}]}, "[-3000]", "[ -3000 ]", "[]", "[1, 2]", '["x"]') == [
        True, True, False, False, False]
    assert accepted({"prefixItems": [{"type": "integer"}, {"type": "string"}], "items": {"type": "boolean"}},
                    '[1, "a"]', '[1, "a", true, false]', "[1]", '[1, "a", 2]') == [True, True, False, False]
    assert accepted({"prefixItems": [{"type": "integer"}]}, "[1]", "[1, 2]") == [True, False]
    assert accepted({"items": [{"type": "integer"}], "additionalItems": {"type": "null"}, "maxItems": 3},
                    "[1]", "[1, null, null]", "[1, null, null, null]") == [True, True, False]
    assert accepted({"prefixItems": [{"type": "integer"}], "items": True, "minItems": 2}, "[1]", '[1, {"a": []}]') == [
        False, True]
    assert accepted({"type": "array", "items": False}, "[]", "[1]") == [True, False]
    for bad in ({"prefixItems": [{}], "maxItems": 0}, {"prefixItems": [{}], "minItems": 2}, {"prefixItems": {}},
                {"prefixItems": [{}], "items": [{}]}, {"items": [{"type": "integer", "minimum": 0}]}):
        with pytest.raises(SchemaError):
            compile_schema(bad)
