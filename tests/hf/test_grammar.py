"""Grammars and expressions the answer is held to: llama-server's GBNF ``grammar`` and vLLM's
guided decoding, read into the engine's pattern constraint (grammar.py, guided.py,
pattern_constraint.py), then through the server with the ``openai`` client and llama-server's
``/completion``."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import regex

from tests.conftest import require_import

require_import("torch")

from kvstream.hf.grammar import GrammarError, gbnf_pattern, read_gbnf  # noqa: E402
from kvstream.hf.guided import guide  # noqa: E402
from kvstream.hf.pattern_constraint import PatternConstraint, compile_pattern  # noqa: E402
from kvstream.types import BackendRejected  # noqa: E402

# llama.cpp's grammars/json.gbnf, as it ships.
JSON_GBNF = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
'''


def matcher(grammar: str):
    return regex.compile(gbnf_pattern(grammar))


def test_gbnf_reads_literals_classes_escapes_and_repetitions():
    assert matcher('root ::= "a"{5,5}').fullmatch("aaaaa") and not matcher('root ::= "a"{5,5}').fullmatch("aaaaaa")
    bounded = matcher('root ::= "x"{2,} "y"{,2} "z"{1}')
    assert bounded.fullmatch("xxz") and bounded.fullmatch("xxxyyz") and not bounded.fullmatch("xyz")
    assert not bounded.fullmatch("xxyyyz")
    classes = matcher(r'root ::= [a-c]+ [^\n\]]* "\x41\u00e9\U0001F600" [\-] .')
    assert classes.fullmatch("cab q;A\u00e9\U0001F600-\n")
    assert not classes.fullmatch("cab q]A\u00e9\U0001F600-\n")  # ] is outside the negated class
    alternatives = matcher('root ::= ("yes" | "no") "!"?  # a comment\n')
    assert {t for t in ("yes", "no!", "maybe", "yes!!") if alternatives.fullmatch(t)} == {"yes", "no!"}
    multiline = matcher('root ::= item ("," item)*\nitem ::=\n  [0-9]+\n  | "n/a"')
    assert multiline.fullmatch("1,22,n/a") and not multiline.fullmatch("1,,2")


def test_gbnf_recursion_takes_what_the_grammar_says_and_partial_prefixes():
    json_like = matcher(JSON_GBNF)
    for text in ('{"a": [1, {"b": null}], "c": "\\u00e9x"}', '{}', '{"deep": [[[[{"x": -1.5e3}]]]]}'):
        assert json_like.fullmatch(text), text
        assert all(json_like.fullmatch(text[:cut], partial=True) for cut in range(len(text))), text
    for wrong in ('{"a" 1}', '[1, 2]', '{"a": tru}', '{"a": 01}x'):
        assert not json_like.fullmatch(wrong), wrong
    parens = matcher('root ::= "(" root* ")"')
    assert parens.fullmatch("(()(()))") and not parens.fullmatch("(()") and parens.fullmatch("((", partial=True)


@pytest.mark.parametrize(("grammar", "complaint"), [
    ('root ::= root "a" | "b"', "left-recursive"),
    ('root ::= x root "a" | "b"\nx ::= "y"?', "left-recursive"),  # through a rule that may match nothing
    ('root ::= x\nx ::= ""? y\ny ::= x "z"', "left-recursive"),
    ('a ::= "x"', "no 'root' rule"),
    ('root ::= foo', "'foo' is used but not defined (line 1, column 10)"),
    ('root ::= "a', "literal is not closed"),
    ('root ::= [z-a]', "runs backwards"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "\\x4"', "hexadecimal"),
    ('root ::= <[1a]>', "a token id reference is <[id]>"),
    ('root ::= <>', "names a token"),
    ('root ::= !"a"', "expected '<' after it"),
    ('root ::= <think\n"a"', "not closed with '>'"),
    ('root ::= "a"\nroot ::= "b"', "defined twice (line 2, column 1)"),
    ('root ::= ("a"', "expected ')'"),
    ('root ::= "a"{3,1}', "bounds"),
    ('root "a"', "expected '::='"),
    ("", "empty"),
    ("root ::= " + "(" * 5000 + '"a"' + ")" * 5000, "too deep"),
])
def test_gbnf_that_cannot_be_read_or_followed_says_where(grammar, complaint):
    with pytest.raises(GrammarError, match=regex.escape(complaint)):
        gbnf_pattern(grammar)


def _referencing(grammar: str, spelled: dict[int, bytes], references: dict[str, int],
                 incremental: bool = True) -> PatternConstraint:
    """A constraint for ``grammar`` over a made-up vocabulary, its token references resolved
    by ``references`` (as written -> token id), as the engine resolves them."""
    read = read_gbnf(grammar)
    tokens = {references[spelling]: sentinel.encode() for spelling, sentinel in read.tokens}
    return PatternConstraint(compile_pattern(read.pattern), spelled.__getitem__, (), tokens=tokens, incremental=incremental)


# With byte tokens (6-8), as a byte-level BPE vocabulary has: they could spell any character.
SPELLED = {0: b"a", 1: b"<end>", 2: b"b", 3: b"<", 4: b"end>", 5: b"ab", 6: b"\xf3", 7: b"\xb0", 8: b"\x80"}


@pytest.mark.parametrize("incremental", [True, False], ids=["machine", "regex module"])
def test_text_never_spells_a_token_reference(incremental):
    """The reference's character is fed for its token only: the bytes of that character,
    spelled by byte tokens, are refused where the reference is due (whole, or begun)."""
    constraint = _referencing('root ::= "a" <[1]> "b"', SPELLED, {"[1]": 1}, incremental)
    constraint.advance(0)
    assert constraint.accepts(1)
    if incremental:  # (the regex module judges an unfinished character as any one)
        assert not constraint.accepts(6)
    constraint.advance(6)
    constraint.advance(7)
    constraint.advance(8)
    assert not constraint.accepts(8) and not constraint.accepts(1)
    negated = _referencing('root ::= (!<[1]>)* <[1]>', SPELLED, {"[1]": 1}, incremental)
    for token in (6, 7, 8):
        negated.advance(token)
    assert not negated.accepts(8)  # it would be the reference's character, spelled


def test_a_token_reference_takes_that_token_and_never_its_text():
    """``<[1]>`` (or ``<end>``, resolved to id 1) is token 1 only: the same text spelled by
    other tokens is not it, and ``.`` or a negated class never takes the token."""
    for grammar, references in (('root ::= "a" <[1]> "b"', {"[1]": 1}), ('root ::= "a" <end> "b"', {"<end>": 1})):
        constraint = _referencing(grammar, SPELLED, references)
        assert constraint.accepts(0) and not constraint.accepts(1)
        constraint.advance(0)
        assert constraint.accepts(1) and not constraint.accepts(3) and not constraint.accepts(2)
        # (The mask is a superset by first byte: 6 begins a character there, and accepts refuses it.)
        assert constraint.candidates(9).tolist() == [False, True, False, False, False, False, True, False, False]
        constraint.advance(1)
        assert constraint.accepts(2) and not constraint.accepts(1) and not constraint.complete
        constraint.advance(2)
        assert constraint.complete and constraint.done
    text_only = _referencing('root ::= . [^a]* <[1]>', SPELLED, {"[1]": 1})
    assert not text_only.accepts(1) and text_only.accepts(3)  # "." is a character of text
    text_only.advance(3)
    assert text_only.accepts(1) and text_only.accepts(4) and not text_only.accepts(0)
    text_only.advance(4)  # "<" "end>": text, not the token
    assert not text_only.complete and text_only.accepts(1)
    text_only.advance(1)
    assert text_only.complete


def test_a_negated_token_reference_runs_until_that_token():
    """``(!<[1]>)* <[1]>``, as llama.cpp's grammars write "anything up to the token": every
    other token (text, or another referenced token) before it, nothing after it."""
    constraint = _referencing('root ::= (!<[1]>)* <[1]>', SPELLED, {"[1]": 1})
    assert not constraint.complete
    for token in (0, 3, 4, 5, 2):
        assert constraint.accepts(token)
        constraint.advance(token)
    assert constraint.accepts(1) and not constraint.complete
    constraint.advance(1)
    assert constraint.done and not any(constraint.accepts(t) for t in SPELLED)
    two = _referencing('root ::= (!<[1]> | <[2]>)+ <[1]>', {**SPELLED, 2: b"<think>"}, {"[1]": 1, "[2]": 2})
    two.advance(2)  # another referenced token is not the negated one
    assert two.accepts(2) and two.accepts(0) and two.accepts(1)


def test_a_right_recursive_or_nullable_grammar_is_not_left_recursive():
    assert matcher('root ::= "a" root | ""').fullmatch("aaa")
    assert matcher('root ::= x "b"\nx ::= "a" x | ""').fullmatch("aab")


def test_guided_fields_become_one_constraint_or_a_400_naming_the_field():
    assert guide({}) is None and guide({"grammar": ""}) is None
    choice = guide({"guided_choice": ["yes", "no (really)"]})
    assert choice.field == "guided_choice" and regex.fullmatch(choice.pattern, "no (really)")
    assert not regex.fullmatch(choice.pattern, "no really")
    assert guide({"guided_json": '{"type": "integer"}'}).schema == {"type": "integer"}
    assert guide({"structured_outputs": {"regex": "[0-9]{3}"}}).pattern == "[0-9]{3}"
    assert regex.fullmatch(guide({"grammar": 'root ::= "a"+'}).pattern, "aaa")
    for extra, field in (({"grammar": "root ::= oops"}, "grammar"), ({"guided_regex": "(unclosed"}, "guided_regex"),
                         ({"guided_choice": "yes"}, "guided_choice"), ({"guided_json": "{not json"}, "guided_json"),
                         ({"grammar": 'root ::= "a"', "guided_regex": "a"}, "guided_regex"),
                         ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
                         ({"guided_grammar": 5}, "guided_grammar")):
        with pytest.raises(BackendRejected) as err:
            guide(extra)
        assert err.value.param == field and err.value.status == 400, extra


def test_a_client_expression_past_the_length_limit_is_refused_before_it_is_compiled(monkeypatch):
    """The regex module compiles with the interpreter's lock held, every stream paused for as
    long: a client's own expression past MAX_EXPRESSION_CHARS is a 400 naming the field, never
    compiled; one at the limit is taken, and so is a longer list of literal answers given as
    ``guided_choice`` (an expression KVStream writes, which the machine follows)."""
    import kvstream.hf.guided as guided

    compiled, checked = [], []
    monkeypatch.setattr(guided, "compile_pattern", lambda text: compiled.append(len(text)))
    monkeypatch.setattr(guided, "check_pattern", lambda text: checked.append(len(text)))
    words = "|".join(f"w{i}" for i in range(10_000))
    for extra, field in (({"guided_regex": words}, "guided_regex"), ({"structured_outputs": {"regex": words}},
                                                                     "structured_outputs.regex")):
        with pytest.raises(BackendRejected) as err:
            guide(extra)
        assert err.value.status == 400 and err.value.param == field
        assert f"{len(words)} characters long" in err.value.message and "guided_choice" in err.value.message
    assert compiled == [] and checked == []
    at_limit = words[: guided.MAX_EXPRESSION_CHARS].rstrip("|")
    # (the machine holds it: compiled by the helper process alone, test_bounded_compile.py)
    assert guide({"guided_regex": at_limit}).pattern == at_limit and checked == [len(at_limit)] and compiled == []
    assert len(guide({"guided_choice": words.split("|")}).pattern) > guided.MAX_EXPRESSION_CHARS


def test_a_client_expression_the_machine_holds_is_not_compiled_in_this_process(monkeypatch):
    """The regex module compiles holding the interpreter's lock: a client's expression the
    machine follows is checked by the helper process alone (test_bounded_compile.py); one the
    machine cannot follow (a lookahead) is compiled here."""
    import regex

    compiled = []
    original = regex.compile
    monkeypatch.setattr(regex, "compile", lambda text, *a, **k: compiled.append(text) or original(text, *a, **k))
    held = r"(?:[0-9a-f]{2}:){5}[0-9a-f]{2} \d+"
    assert guide({"guided_regex": held}).pattern == held and held not in compiled
    ahead = "(?=x)x[a-z]+ \\d"
    assert guide({"guided_regex": ahead}).pattern == ahead and ahead in compiled


def test_an_expression_that_backtracks_without_end_fails_within_its_budget_not_the_engine():
    """A client's expression the regex module follows (here: one with a lookahead) may take
    exponential time on some text: its matches for one token share a budget, past which the
    constraint gives up (``failed``), refusing everything. The incremental machine follows
    the same expression without the lookahead in time linear in the token."""
    spelled = {0: b"x" * 8, 1: b"xz", 2: b"y"}
    constraint = PatternConstraint(compile_pattern("(?=[xy])(x|x|x)*y"), spelled.__getitem__, (), budget_s=0.05)
    assert constraint.machine is None
    for _ in range(3):  # 24 x's: a refused "z" after them backtracks 3**24 ways
        assert constraint.accepts(0)
        constraint.advance(0)
    assert not constraint.accepts(1) and constraint.failed
    assert not constraint.accepts(2)  # given up: nothing more is accepted
    assert not constraint.candidates(3).any()
    # Each token within its budget, but the answer past ten times it: given up too.
    cheap = PatternConstraint(compile_pattern("(?=x)x*"), spelled.__getitem__, (), budget_s=10.0, answer_budget_s=0.01)
    while not cheap.failed:
        assert cheap.accepts(0)
        cheap.advance(0)
    assert len(cheap.text) > 8 and not cheap.accepts(0)
    unbounded = PatternConstraint(compile_pattern("(?=[xy])(x|x|x)*y"), spelled.__getitem__, ())
    assert unbounded.accepts(2) and not unbounded.failed
    followed = PatternConstraint(compile_pattern("(x|x|x)*y"), spelled.__getitem__, (), budget_s=0.05)
    assert followed.machine is not None
    for _ in range(30):
        assert followed.accepts(0)
        followed.advance(0)
    assert not followed.accepts(1) and not followed.failed and followed.accepts(2)
    followed.advance(2)
    assert followed.complete and followed.done
    # Only matching counts: the time between one token's questions (the sampler building a
    # mask, other rows) does not.
    letters = {0: b"b", 1: b"c"}
    paused = PatternConstraint(compile_pattern('(?=a)a{5}|a{5}'), letters.__getitem__, (), budget_s=0.05)
    waits = PatternConstraint(compile_pattern('a{5}'), letters.__getitem__, (), budget_s=0.05)
    for constraint in (paused, waits):
        assert not constraint.accepts(0)
        time.sleep(0.1)
        assert not constraint.accepts(1) and not constraint.failed
    # The machine's questions count against the answer's budget too.
    spent = PatternConstraint(compile_pattern("x*"), spelled.__getitem__, (), budget_s=10.0, answer_budget_s=0.0005)
    assert spent.machine is not None
    for _ in range(100_000):
        if not spent.accepts(0):
            break
        spent.advance(0)
    assert spent.failed and not spent.candidates(3).any()


async def test_grammars_and_guided_decoding_through_the_openai_client_and_completion(hf_proxy, oa, http):
    from openai import BadRequestError

    ask = [{"role": "user", "content": "Does not matter what I say, does it?"}]

    async def chat(extra: dict, max_tokens: int = 24) -> tuple[str, str]:
        reply = await oa.chat.completions.create(model="smollm2", messages=ask, max_tokens=max_tokens, temperature=0,
                                                 extra_body=extra)
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    assert await chat({"grammar": 'root ::= "a"{5,5}'}, 6) == ("aaaaa", "stop")
    text, reason = await chat({"grammar": JSON_GBNF}, 60)
    assert matcher(JSON_GBNF).fullmatch(text, partial=True) and (reason == "length" or json.loads(text) is not None)
    assert (await chat({"guided_choice": ["yes", "no"]}))[0] in ("yes", "no")
    text, reason = await chat({"guided_regex": "[0-9]{3}-[0-9]{4}"})
    assert regex.fullmatch("[0-9]{3}-[0-9]{4}", text) and reason == "stop", text
    assert (await chat({"structured_outputs": {"choice": ["maybe"]}}))[0] == "maybe"
    # Streamed, the same text.
    stream = await oa.chat.completions.create(model="smollm2", messages=ask, max_tokens=6, temperature=0, stream=True,
                                              extra_body={"grammar": 'root ::= "a"{5,5}'})
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == "aaaaa"

    for extra, field in (({"grammar": "root ::= nowhere"}, "grammar"),
                         ({"guided_regex": "[0-9", "response_format": {"type": "json_object"}}, "guided_regex"),
                         ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar")):
        with pytest.raises(BadRequestError) as err:
            await chat(extra)
        assert err.value.param == field, (extra, err.value.message)

    async with http.post(hf_proxy.url + "/completion", json={
        "prompt": "Count: ", "n_predict": 8, "temperature": 0, "grammar": 'root ::= [1-3] ("," [1-3])*',
    }) as response:
        answer = await response.json()
    assert regex.fullmatch("[1-3](,[1-3])*", answer["content"], partial=True), answer["content"]
    assert answer["stop_type"] == "limit" or regex.fullmatch("[1-3](,[1-3])*", answer["content"])
    assert answer["generation_settings"]["grammar"] == 'root ::= [1-3] ("," [1-3])*'
    async with http.post(hf_proxy.url + "/completion", json={"prompt": "x", "grammar": "root ::= [z-a]"}) as response:
        assert response.status == 400 and "backwards" in (await response.json())["error"]["message"]


async def test_token_references_through_completion_as_llama_server_answers_them(hf_proxy, http, smollm2):
    """llama-server's token references on SmolLM2's vocabulary: ``<[28]>`` is ",", and
    ``<|im_start|>`` (id 1) a special token, which is in the tokens and not in the text (as
    llama-server answers, asked the same on the Q4_1 model: "Hix", tokens [56, 89, 1, 104, 2]).
    What cannot be resolved is a 400, where llama-server answers an id outside its vocabulary
    with a 500."""
    tokenizer = smollm2[2]
    im_start, comma = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.convert_tokens_to_ids(",")
    assert (im_start, comma) == (1, 28)

    async def completion(grammar: str) -> tuple[int, dict]:
        async with http.post(hf_proxy.url + "/completion", json={
            "prompt": "Say", "n_predict": 8, "temperature": 0, "grammar": grammar, "return_tokens": True,
        }) as response:
            return response.status, await response.json()

    status, answer = await completion('root ::= "Hi" <|im_start|> "x"')
    assert status == 200 and answer["content"] == "Hix" and answer["stop_type"] == "eos", answer
    assert im_start in answer["tokens"] and tokenizer.decode(answer["tokens"][: answer["tokens"].index(im_start)]) == "Hi"
    status, answer = await completion('root ::= "Hi" <[28]> "x"')
    assert status == 200 and answer["content"] == "Hi,x" and comma in answer["tokens"], answer
    # Anything but the comma token, then it: the answer ends at it (or runs out before it).
    status, answer = await completion('root ::= [0-9] (!<[28]>)* <[28]>')
    tokens = answer["tokens"]
    assert status == 200 and comma not in tokens[:-1] and (tokens[-1] == comma or answer["stop_type"] == "limit"), answer
    for grammar, complaint in (('root ::= <nothere>', "not one token"), ('root ::= "a" <[99999999]>', "outside the vocabulary")):
        status, answer = await completion(grammar)
        assert status == 400 and complaint in answer["error"]["message"], answer
    assert hf_proxy.engine.backend.runner.is_idle()


async def test_a_costly_expression_fails_its_request_and_the_others_go_on(oa, smollm2):
    """A hostile expression the regex module must follow (it has a lookahead) ends its own
    request with an error; a request sharing the steps gets its whole answer. (The model is
    made to want a space, which the expression refuses: after a run of x's, refusing it
    backtracks 3**n ways.) Without the lookahead the incremental machine follows it, at no
    such cost."""
    from openai import APIError

    space = smollm2[2](" ", add_special_tokens=False).input_ids[0]
    ask = [{"role": "user", "content": "Write the letter x forty times."}]

    def held(expression: str, max_tokens: int = 60):
        return oa.chat.completions.create(model="smollm2", messages=ask, max_tokens=max_tokens, temperature=0,
                                          logit_bias={str(space): 100}, extra_body={"guided_regex": expression})

    fine = oa.chat.completions.create(model="smollm2", messages=ask, max_tokens=30, temperature=0)
    results = await asyncio.gather(held("(?=[xy])(x|x|x)*y"), fine, held("(x|x|x)*y", 30), return_exceptions=True)
    assert isinstance(results[0], APIError), results[0].choices[0].message.content
    assert "too long" in str(results[0])
    assert results[1].usage.completion_tokens == 30 or results[1].choices[0].finish_reason == "stop"
    followed = results[2].choices[0]
    assert regex.fullmatch("(x|x|x)*y", followed.message.content, partial=True) and followed.finish_reason in ("stop", "length")
