"""llama-server's lazy grammars (``grammar_lazy``, ``grammar_triggers``) and ``preserved_tokens``
on the in-process engine: the answer free until a trigger, held to the grammar from the
trigger's text on (lazy_grammar.py), first over a made-up vocabulary, then through
``/completion`` and the ``openai`` client, against what llama-server answered when asked the
same here (SmolLM2's Q4_1 GGUF, greedy; the texts quoted in each test)."""

from __future__ import annotations

import pytest

from tests.conftest import require_import

require_import("torch")

from kvstream.hf.grammar import read_gbnf  # noqa: E402
from kvstream.hf.lazy_grammar import LazyGrammar, Triggers  # noqa: E402
from kvstream.hf.pattern_constraint import PatternConstraint, compile_pattern  # noqa: E402
from kvstream.hf.request_options import lazy_triggers  # noqa: E402
from kvstream.types import BackendRejected  # noqa: E402

# A made-up vocabulary: 9 is a special token, 10 a byte token (half of "é").
SPELLED = {0: b"Say ", 1: b"hi", 2: b" <call>", 3: b"{", 4: b"1", 5: b"}", 6: b"<ca", 7: b"ll>", 8: b"x",
           9: b"<tool>", 10: b"\xc3", 11: b"\xa9", 12: b"<think>", 13: b"</think>", 14: b"</th", 15: b"ink>"}


def lazy(grammar: str, triggers: Triggers, references: dict[str, int] | None = None) -> LazyGrammar:
    read = read_gbnf(grammar)
    tokens = {(references or {})[spelling]: sentinel.encode() for spelling, sentinel in read.tokens}
    constraint = PatternConstraint(compile_pattern(read.pattern), SPELLED.__getitem__, (9,), tokens=tokens)
    return LazyGrammar(constraint, triggers, SPELLED.__getitem__)


def run(waiting: LazyGrammar, tokens: list[int]) -> tuple[int | None, PatternConstraint | None]:
    """Feed ``tokens`` until one fires the trigger: (its index, the constraint), or (None, None)."""
    for i, token in enumerate(tokens):
        held = waiting.advance(token)
        if held is not None or waiting.failed:
            return i, held
    return None, None


def test_a_word_trigger_holds_the_grammar_from_the_word_on_whatever_tokens_spell_it():
    grammar = 'root ::= "<call>" "{" [0-9]+ "}"'
    # The word inside one token, after a space the grammar does not take: from the word on.
    at, held = run(lazy(grammar, Triggers(words=("<call>",))), [0, 1, 2])
    assert at == 2 and held is not None and held.text == b"<call>"
    assert held.accepts(3) and not held.accepts(8) and not held.complete
    for token in (3, 4, 5):
        held.advance(token)
    assert held.done
    # Spelled across two tokens: found when the second comes, both replayed.
    at, held = run(lazy(grammar, Triggers(words=("<call>",))), [1, 6, 7])
    assert at == 2 and held is not None and held.text == b"<call>"
    # Never written: never held.
    assert run(lazy(grammar, Triggers(words=("<call>",))), [0, 1, 8, 3, 4]) == (None, None)


def test_a_patterns_first_group_says_where_the_grammar_begins():
    """llama.cpp: from the first capturing group that matched something, else the match;
    a whole pattern (``^...$``) must match everything generated."""
    at, held = run(lazy('root ::= "hi <call>" [a-z]*', Triggers(patterns=(r"Say (hi) <",))), [0, 1, 2])
    assert at == 2 and held is not None and held.text == b"hi <call>"
    at, held = run(lazy('root ::= "Say hi <call>" [a-z]*', Triggers(patterns=(r"^Say (x)?hi <call>$",))), [0, 1, 2])
    assert at == 2 and held is not None and held.text == b"Say hi <call>"  # group 1 matched nothing: the match
    at, held = run(lazy('root ::= [a-zA-Z <>]*', Triggers(patterns=("^Say hi$",))), [0, 1, 2])
    assert (at, held.text if held else None) == (1, b"Say hi")
    assert run(lazy('root ::= [a-z]*', Triggers(patterns=("^hi$",))), [0, 1, 2]) == (None, None)


def test_a_token_trigger_is_that_token_taken_whole_as_its_reference_or_its_text():
    """A special token's text stands in the trigger search as llama.cpp's piece; drawn as a
    token trigger it is the grammar's reference if it has one, else its text."""
    at, held = run(lazy('root ::= <tool> "{" [0-9]* "}"', Triggers(tokens=frozenset({9})), {"<tool>": 9}), [1, 9])
    assert at == 1 and held is not None and held.accepts(3) and not held.accepts(9)
    at, held = run(lazy('root ::= "<tool>{}"', Triggers(tokens=frozenset({9}))), [9])
    assert at == 0 and held is not None and held.accepts(3)
    at, held = run(lazy('root ::= "<tool>{}"', Triggers(patterns=("<tool>",))), [8, 9])
    assert at == 1 and held is not None and held.text == b"<tool>"


def test_a_word_inside_a_thinking_block_is_not_a_trigger():
    """With thinking tracked, a word counts outside ``<think>`` blocks only (a drafted call is
    not one), whole tags or tags split across tokens; the prompt may have opened the block."""
    grammar = 'root ::= "<call>" "{" [0-9]+ "}"'
    for opened, tokens, fires_at in (
        (False, [12, 2, 13, 6, 7], 4), (False, [12, 2, 14, 15, 1, 2], 5), (True, [2, 13, 2], 2),
        (False, [2, 12], 0), (None, [12, 2], 1), (False, [13, 12, 2, 13], None),
    ):
        waiting = lazy(grammar, Triggers(words=("<call>",), thinking=opened))
        at, held = run(waiting, tokens)
        assert at == fires_at and (held is None) == (fires_at is None), (opened, tokens, at)
        if held is not None:
            assert held.text == b"<call>"
    # A token trigger too: not inside a block.
    token_grammar = 'root ::= "<tool>{}"'
    assert run(lazy(token_grammar, Triggers(tokens=frozenset({9}), thinking=False)), [12, 9, 13, 1, 9])[0] == 4
    assert run(lazy(token_grammar, Triggers(tokens=frozenset({9}), thinking=True)), [9, 14, 15, 9])[0] == 3


def test_a_trigger_the_grammar_cannot_begin_with_fails_the_answer():
    """llama-server answers this case with a 500 ("Unexpected empty grammar stack"): the engine
    ends the request with an error naming the text."""
    waiting = lazy('root ::= "{" [0-9]+ "}"', Triggers(words=("<call>",)))
    assert run(waiting, [0, 2]) == (1, None)
    assert "<call>" in waiting.failed
    # Searching past the budget (a client's backtracking expression): the client's cost, a 400.
    costly = LazyGrammar(waiting.constraint.copy(), Triggers(patterns=("(x+)+y",)), SPELLED.__getitem__, budget_s=0.0)
    assert costly.advance(8) is None and costly.costly and "too long" in costly.failed
    # A hold KVStream adds itself (not strict): the answer goes on unheld.
    lenient = lazy('root ::= "{" [0-9]+ "}"', Triggers(words=("<call>",), strict=False))
    assert run(lenient, [0, 2, 3, 2]) == (None, None) and lenient.abandoned and lenient.failed is None


def test_a_trigger_inside_a_character_and_the_copy_of_a_fork():
    """Offsets are bytes: a trigger after half a character still begins where it does, and a
    fork's wait is its own."""
    waiting = lazy('root ::= "hi" [a-z]*', Triggers(patterns=("hi",)))
    waiting.advance(10)
    fork = waiting.copy()
    assert waiting.advance(11) is None
    held = waiting.advance(1)
    assert held is not None and held.text == b"hi"
    assert fork.advance(8) is None and fork.text == b"\xc3x"


@pytest.mark.parametrize(("extra", "complaint"), [
    ({"grammar_lazy": True}, "no triggers"),
    ({"grammar_lazy": True, "grammar_triggers": []}, "no triggers"),
    ({"grammar_lazy": "yes", "grammar_triggers": [{"type": 2, "value": "a"}]}, "boolean"),
    ({"grammar_lazy": True, "grammar_triggers": "a"}, "list"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 7, "value": "a"}]}, "'type'"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 2}]}, "'value'"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 0, "value": "a"}]}, "'token'"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 0, "value": "a", "token": 99}]}, "'token'"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "(["}]}, "does not compile"),
    # Seventeen characters the regex module's compile dies of (test_bounded_compile.py).
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "(?:ab|c){1000000}"}]}, "to compile"),
    ({"grammar_lazy": True, "grammar_triggers": [{"type": 1, "value": "<tool>"}]}, "preserved_tokens"),
])
def test_triggers_read_as_llama_server_reads_them_or_a_400(extra, complaint):
    """llama-server's words where it refuses (a word of one token not preserved, no triggers,
    a pattern that does not compile); where it crashes (an unknown type) or takes a token
    outside its vocabulary, a 400 too."""
    token_of = {"<tool>": 9, "hi": 1}.get
    with pytest.raises(BackendRejected) as err:
        lazy_triggers(extra, 12, token_of, frozenset())
    assert complaint in err.value.message and err.value.status == 400


def test_triggers_become_tokens_and_patterns():
    token_of = {"<tool>": 9, "hi": 1}.get
    triggers = lazy_triggers({"grammar_lazy": True, "grammar_triggers": [
        {"type": 1, "value": "<tool>"}, {"type": 1, "value": "a.b"}, {"type": 0, "value": "x", "token": 8},
        {"type": 2, "value": "x(y)"}, {"type": 3, "value": "z+"}, {"type": 3, "value": ""}]}, 12, token_of, frozenset({9}))
    assert triggers == Triggers(frozenset({9, 8}), ("a.b",), ("x(y)", "^z+$", "^$"))
    # Not lazy: read and checked, and the grammar holds from the first token.
    assert lazy_triggers({"grammar_triggers": [{"type": 2, "value": "x"}]}, 12, token_of, frozenset()) is None


PROMPT = "The capital of France is"


async def completion(http, hf_proxy, **fields) -> dict:
    async with http.post(hf_proxy.url + "/completion", json={
        "prompt": PROMPT, "n_predict": 12, "temperature": 0, "return_tokens": True, **fields,
    }) as response:
        body = await response.json()
        return {"status": response.status, **body}


async def test_lazy_grammars_through_completion_as_llama_server_answers_them(hf_proxy, http, smollm2):
    """Asked here, llama-server (greedy) answers ``PROMPT`` " Paris.\\n\\nThe United States has
    ..."; held from "is" (a pattern found inside " Paris") to ``"is" [0-9]+``: " Paris2017...";
    a grammar that cannot begin with its trigger's text: a 500; free text when nothing
    triggers."""
    tokenizer = smollm2[2]
    free = await completion(http, hf_proxy)
    assert free["status"] == 200 and free["content"].startswith(" Paris."), free
    held = await completion(http, hf_proxy, grammar='root ::= "is" [0-9]+', grammar_lazy=True,
                            grammar_triggers=[{"type": 2, "value": "is"}])
    assert held["status"] == 200 and held["content"].startswith(" Paris") and held["content"][6:].isdigit(), held
    assert held["tokens"][0] == free["tokens"][0] and held["generation_settings"]["grammar_lazy"] is True
    never = await completion(http, hf_proxy, grammar='root ::= [0-9]+', grammar_lazy=True,
                             grammar_triggers=[{"type": 2, "value": "Berlin"}])
    assert never["status"] == 200 and never["tokens"] == free["tokens"], never
    # Not lazy: the grammar holds from the first token, whatever the triggers.
    eager = await completion(http, hf_proxy, grammar='root ::= [0-9]+', grammar_triggers=[{"type": 2, "value": "x"}])
    assert eager["status"] == 200 and eager["content"].isdigit(), eager
    refused = await completion(http, hf_proxy, grammar='root ::= "capital" [0-9]+', grammar_lazy=True,
                               grammar_triggers=[{"type": 2, "value": "Par(is)"}])
    assert refused["status"] == 500 and "'is'" in refused["error"]["message"], refused
    # A word of one token must be preserved (llama-server's 400, in its words).
    assert tokenizer(" Paris", add_special_tokens=False).input_ids == free["tokens"][:1]
    one_token = await completion(http, hf_proxy, grammar='root ::= [a-zA-Z ]* [0-9]+', grammar_lazy=True,
                                 grammar_triggers=[{"type": 1, "value": " Paris"}])
    assert one_token["status"] == 400 and "preserved_tokens" in one_token["error"]["message"], one_token
    assert hf_proxy.engine.backend.runner.is_idle()


async def test_preserved_special_tokens_are_written_and_trigger_the_grammar(hf_proxy, http, smollm2):
    """SmolLM2's ``<file_sep>`` (id 5), made likely by a bias: llama-server leaves it out of
    the text (" Paris.\\n") unless preserved (" Paris.<file_sep>\\n<file_sep><file_sep>");
    as a trigger word (preserved), the grammar takes it and then digits: " Paris.<file_sep>001".
    """
    tokenizer = smollm2[2]
    assert tokenizer.convert_tokens_to_ids("<file_sep>") == 5
    bias = {"logit_bias": [[5, 14]], "n_predict": 6}
    plain = await completion(http, hf_proxy, **bias)
    kept = await completion(http, hf_proxy, preserved_tokens=["<file_sep>", "not one token"], **bias)
    assert plain["status"] == kept["status"] == 200 and plain["tokens"] == kept["tokens"] and 5 in plain["tokens"]
    assert "<file_sep>" not in plain["content"]
    assert kept["content"] == tokenizer.decode(kept["tokens"], skip_special_tokens=False), kept
    for grammar in ('root ::= "<file_sep>" [0-9]+', "root ::= <file_sep> [0-9]+"):
        held = await completion(http, hf_proxy, preserved_tokens=["<file_sep>"], grammar=grammar, grammar_lazy=True,
                                grammar_triggers=[{"type": 1, "value": "<file_sep>"}], **bias)
        tokens = held["tokens"]
        assert held["status"] == 200 and 5 in tokens, held
        after = tokenizer.decode(tokens[tokens.index(5) + 1:])
        assert after.isdigit() and held["content"].endswith("<file_sep>" + after), held
    assert hf_proxy.engine.backend.runner.is_idle()


async def test_a_lazy_grammar_through_the_openai_client_streamed(hf_proxy, oa):
    """The OpenAI routes take llama-server's fields as extra body: held from the trigger on,
    streamed, and n choices each wait for their own trigger."""
    stream = await oa.completions.create(
        model="m", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        extra_body={"grammar": 'root ::= "is" [0-9]+', "grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "is"}]})
    text = "".join([chunk.choices[0].text async for chunk in stream])
    assert text.startswith(" Paris") and text[6:].isdigit(), text
    answer = await oa.completions.create(  # (sampled, each choice " Paris." first)
        model="m", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=3, n=3,
        extra_body={"grammar": 'root ::= "." [0-9]+', "grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "[.]"}]})
    texts = [choice.text for choice in answer.choices]
    assert all(text.startswith(" Paris.") and text[7:].isdigit() for text in texts) and len(set(texts)) == 3, texts
    assert hf_proxy.engine.backend.runner.is_idle()
