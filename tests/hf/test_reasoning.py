"""A reasoning model's thinking split from its answer (``reasoning_content``; Ollama's
``thinking``): the scanner in any split, then end to end with SmolLM2 under a Qwen3-style
template (tests/fixtures/thinking.jinja), checked against plain transformers' own text."""

from __future__ import annotations

import json

from pathlib import Path

import openai
import pytest

from kvstream.hf.answer_reading import AnswerReading
from kvstream.hf.reasoning import ThinkingScanner, opened_in_prompt, thinks
from kvstream.hf.tool_call_syntax import CallReading
from tests.conftest import require_import
from tests.hf.conftest import templated_proxy

require_import("torch")

TEMPLATE = (Path(__file__).parent.parent / "fixtures" / "thinking.jinja").read_text()
# Two worked examples make SmolLM2 open its answers with a <think> block (greedy).
EXAMPLES = [
    {"role": "user", "content": "What is 3+5?"},
    {"role": "assistant", "content": "<think>\nThree plus five: count up five from three, 4, 5, 6, 7, 8.\n</think>\n\n3 + 5 = 8."},
    {"role": "user", "content": "What is 6+1?"},
    {"role": "assistant", "content": "<think>\nSix plus one is the number after six: 7.\n</think>\n\n6 + 1 = 7."},
]
ASK = EXAMPLES + [{"role": "user", "content": "What is 2+2?"}]


def split(text: str, step: int, opened: bool = False) -> tuple[str, str]:
    scanner, pieces = ThinkingScanner(opened), []
    for start in range(0, len(text), step):
        pieces += scanner.feed(text[start:start + step])
    pieces += scanner.finish()
    return "".join(p.text for p in pieces if p.reasoning), "".join(p.text for p in pieces if not p.reasoning)


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_thinking_and_answer_split_the_same_in_any_split(step):
    assert split("<think>\nLet me see: 2 and 2.\n</think>\n\nIt is 4.", step) == ("Let me see: 2 and 2.", "It is 4.")
    assert split("\nLet me see.\n</think>\n\nIt is 4.", step, opened=True) == ("Let me see.", "It is 4.")
    assert split("<think>cut short by max_tok", step) == ("cut short by max_tok", "")  # never closed: all thinking
    for plain in ("It is 4.", "<thi", "  indented", "Tags <think>inside</think> an answer stay."):
        assert split(plain, step) == ("", plain), plain


def test_the_template_and_the_prompt_say_whether_to_read_thinking():
    assert thinks(TEMPLATE) and not thinks("{{ messages }}") and thinks({"default": TEMPLATE})
    assert opened_in_prompt("<|im_start|>assistant\n<think>\n")
    assert not opened_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking turned off
    assert not opened_in_prompt("<|im_start|>assistant\n")


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_thinking_then_a_tool_call(step):
    """The calls are read in what follows the thinking (a <tool_call> while thinking is thought)."""
    reader = AnswerReading(CallReading("hermes"), thinking_opened=False).reader()
    text = ('<think>I could use <tool_call> here.</think>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    pieces = []
    for start in range(0, len(text), step):
        pieces += reader.read(None, text[start:start + step])
    pieces += reader.read(None, "", end=True)
    assert "".join(p.text for p in pieces if p.reasoning) == "I could use <tool_call> here."
    call, *more = [p.call for p in pieces if p.call]  # (its arguments stream in pieces)
    assert call["function"]["name"] == "get_weather" and reader.calls == 1
    arguments = call["function"]["arguments"] + "".join(m["function"]["arguments"] for m in more)
    assert json.loads(arguments) == {"city": "Paris"}
    assert not any(p.text for p in pieces if not p.reasoning and p.call is None)


# ------------------------------------------------------------- end to end, SmolLM2 under the template
@pytest.fixture
async def thinking_proxy(smollm2, start_proxy):
    async with templated_proxy(smollm2, start_proxy, TEMPLATE) as served:
        yield served


@pytest.fixture
async def thinking_oa(thinking_proxy):
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=thinking_proxy[0].v1, api_key="unused", max_retries=0) as client:
        yield client


def reference_split(smollm2, tokenizer, messages, max_tokens: int, **template_kwargs) -> tuple[int, str, str]:
    """(prompt tokens, thinking, answer) by plain transformers on the same template, the raw
    text split at ``</think>`` by hand."""
    ids, generated = reference_tokens(smollm2, tokenizer, messages, max_tokens, **template_kwargs)
    text = tokenizer.decode(generated, skip_special_tokens=True)
    thought, _, answer = text.removeprefix("<think>").partition("</think>")
    return len(ids), thought.strip(), answer.strip()


def reference_tokens(smollm2, tokenizer, messages, max_tokens: int, **template_kwargs) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) by plain transformers' greedy generate."""
    import torch

    from kvstream.hf.loader import chat_token_ids

    ids = chat_token_ids(tokenizer, messages, template_kwargs=template_kwargs or None)
    out = smollm2[1].generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    return ids, out[0][len(ids):].tolist()


def thinking_tokens(tokenizer, generated: list[int]) -> int:
    """How many of ``generated`` make the thinking block: up to the token that completes
    ``</think>``, included."""
    return next(n for n in range(1, len(generated) + 1) if "</think>" in tokenizer.decode(generated[:n]))


async def test_the_thinking_comes_back_as_reasoning_content(thinking_oa, thinking_proxy, smollm2):
    _, tokenizer = thinking_proxy
    prompt_tokens, thought, answer = reference_split(smollm2, tokenizer, ASK, 60)
    assert thought and answer  # the model did think, then answer (the premise of the test)
    reply = await thinking_oa.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == thought and message.content == answer
    assert reply.usage.prompt_tokens == prompt_tokens and reply.choices[0].finish_reason == "stop"
    # usage.completion_tokens_details.reasoning_tokens: the block's tokens, tags included.
    _, generated = reference_tokens(smollm2, tokenizer, ASK, 60)
    assert reply.usage.completion_tokens_details.reasoning_tokens == thinking_tokens(tokenizer, generated)

    stream = await thinking_oa.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0,
                                                       stream=True, logprobs=True)
    chunks = [c async for c in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    # Log-probabilities go with the answer's tokens; the thinking reports none.
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or ()]
    assert "".join(e.token for e in entries).strip() == answer


async def test_a_block_the_prompt_opens_and_thinking_turned_off(thinking_oa, thinking_proxy, smollm2):
    _, tokenizer = thinking_proxy
    # chat_template_kwargs reach the template: this one opens the block in the prompt.
    _, thought, answer = reference_split(smollm2, tokenizer, ASK, 60, open_thinking=True)
    opened = await thinking_oa.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0,
                                                       extra_body={"chat_template_kwargs": {"open_thinking": True}})
    assert opened.choices[0].message.model_extra["reasoning_content"] == thought
    assert opened.choices[0].message.content == answer
    # enable_thinking false: the template closes an empty block, the model answers at once.
    prompt_tokens, _, _ = reference_split(smollm2, tokenizer, ASK, 1, enable_thinking=False)
    off = await thinking_oa.chat.completions.create(model="smollm2", messages=ASK, max_tokens=30, temperature=0,
                                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == prompt_tokens
    assert not off.choices[0].message.model_extra.get("reasoning_content") and "</think>" not in off.choices[0].message.content


@pytest.mark.parametrize("kwargs", [["not", "an", "object"], {"add_generation_prompt": False}, {"bad name": 1}])
async def test_template_arguments_the_engine_sets_or_cannot_pass_are_400s(thinking_oa, kwargs):
    with pytest.raises(openai.BadRequestError) as err:
        await thinking_oa.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4,
                                                  extra_body={"chat_template_kwargs": kwargs})
    assert err.value.param == "chat_template_kwargs"


async def test_the_ollama_client_gets_thinking_and_can_turn_it_off(thinking_proxy, smollm2):
    import ollama

    proxy, tokenizer = thinking_proxy
    _, thought, answer = reference_split(smollm2, tokenizer, ASK, 60)
    client = ollama.AsyncClient(host=proxy.url)
    reply = await client.chat(model="smollm2", messages=ASK, options={"temperature": 0, "num_predict": 60})
    assert reply.message.thinking == thought and reply.message.content == answer
    streamed = [part async for part in await client.chat(model="smollm2", messages=ASK, stream=True,
                                                          options={"temperature": 0, "num_predict": 60})]
    assert "".join(p.message.thinking or "" for p in streamed) == thought
    assert "".join(p.message.content or "" for p in streamed) == answer
    off = await client.chat(model="smollm2", messages=ASK, think=False, options={"temperature": 0, "num_predict": 30})
    assert not off.message.thinking and off.prompt_eval_count == reference_split(
        smollm2, tokenizer, ASK, 1, enable_thinking=False)[0]


async def test_an_ollama_think_that_is_not_a_switch_is_a_400(thinking_proxy, http):
    proxy, _ = thinking_proxy
    for think in ({"on": True}, "extreme", 1):
        body = {"model": "smollm2", "messages": ASK, "stream": False, "think": think}
        async with http.post(proxy.url + "/api/chat", json=body) as resp:
            assert resp.status == 400 and "think" in (await resp.json())["error"], think


async def test_ollamas_show_names_the_capabilities_the_template_gives(thinking_proxy, smollm2, start_proxy):
    """Apps read /api/show's capabilities to offer thinking and tools: a template with
    <think> blocks says thinking, one that renders tools says tools."""
    import ollama

    from tests.hf.conftest import templated_proxy

    shown = await ollama.AsyncClient(host=thinking_proxy[0].url).show("smollm2")
    assert "thinking" in shown.capabilities and "embedding" in shown.capabilities
    hermes = (Path(__file__).parent.parent / "fixtures" / "hermes_tools.jinja").read_text()
    async with templated_proxy(smollm2, start_proxy, hermes) as (proxy, _):
        shown = await ollama.AsyncClient(host=proxy.url).show("smollm2")
        assert "tools" in shown.capabilities and "thinking" not in shown.capabilities


# ------------------------------------------------------------- the thinking budget
def _budget(budget: int, opened: bool = False):
    from kvstream.hf.thinking_budget import ThinkingBudget, ThinkTokens

    spelled = {1: b"<th", 2: b"ink>", 3: b" a", 4: b" b", 5: b"</think>", 6: b"\xe2\x82", 7: b"\xac", 8: b"ok", 9: b"  "}
    return ThinkingBudget(budget, ThinkTokens((90, 91)), spelled.__getitem__, opened)


def _run(budget, tokens: list[int]) -> list[str]:
    states = []
    for token in tokens:
        budget.advance(token)
        states.append(budget.state)
    return states


def test_the_budget_counts_inside_the_block_then_forces_its_end():
    b = _budget(2)
    assert _run(b, [9, 1, 2]) == ["idle", "idle", "counting"]  # whitespace, then the tag over two tokens
    assert _run(b, [3]) == ["counting"] and b.forced() is None
    assert _run(b, [4]) == ["forcing"] and b.forced() == 90
    assert _run(b, [90]) == ["forcing"] and b.forced() == 91
    assert _run(b, [91, 3]) == ["done", "done"] and b.forced() is None


def test_the_budget_stands_aside_when_the_model_closes_the_block_or_never_opens_one():
    assert _run(_budget(5), [1, 2, 3, 5, 3, 3, 3, 3, 3, 3]) [-1] == "done"  # closed after one token
    assert _run(_budget(5), [8]) == ["done"]  # an answer with no block
    assert _run(_budget(1, opened=True), [5]) == ["done"]


def test_a_spent_budget_finishes_the_character_it_is_in_and_zero_forces_at_once():
    b = _budget(1, opened=True)
    assert _run(b, [6]) == ["waiting"] and b.forced() is None  # the first two bytes of "€"
    assert _run(b, [7]) == ["forcing"]
    assert _budget(0, opened=True).forced() == 90
    assert _budget(0).state == "idle"  # zero, but the answer has not opened a block yet


def _budgeted_reference(smollm2, tokenizer, messages, budget: int, max_tokens: int, **template_kwargs) -> tuple[str, str]:
    """(thinking, answer) as transformers' greedy generate gives them with the budget applied
    by hand: the block's tokens up to the budget, the closing text, then generate on."""
    import torch

    from kvstream.hf.thinking_budget import FORCED

    ids, generated = reference_tokens(smollm2, tokenizer, messages, max_tokens, **template_kwargs)
    opened = bool(template_kwargs.get("open_thinking"))
    start = 0 if opened else next(n for n in range(1, len(generated)) if tokenizer.decode(generated[:n]).lstrip().startswith("<think>"))
    kept = generated[:start + budget] + tokenizer.encode(FORCED, add_special_tokens=False)
    assert "</think>" not in tokenizer.decode(generated[:start + budget])  # the model would have thought longer
    out = smollm2[1].generate(torch.tensor([ids + kept]), max_new_tokens=max_tokens - len(kept), do_sample=False)
    return split(tokenizer.decode(kept + out[0][len(ids) + len(kept):].tolist(), skip_special_tokens=True), 1000, opened)


@pytest.mark.parametrize("opened", [False, True])
async def test_thinking_token_budget_ends_the_block_where_transformers_with_it_forced_does(thinking_oa, thinking_proxy,
                                                                                          smollm2, opened):
    """The engine's text is plain transformers' greedy text with the budget applied by hand,
    whether the answer opened the block or the prompt did; the thinking reported is the
    budget's tokens and the closing text's."""
    _, tokenizer = thinking_proxy
    kwargs = {"open_thinking": True} if opened else {}
    thought, answer = _budgeted_reference(smollm2, tokenizer, ASK, 3, 60, **kwargs)
    reply = await thinking_oa.chat.completions.create(
        model="smollm2", messages=ASK, max_tokens=60, temperature=0,
        extra_body={"thinking_token_budget": 3, "chat_template_kwargs": kwargs})
    message = reply.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (thought, answer)
    assert answer  # the model answered after the forced end
    assert reply.usage.completion_tokens_details.reasoning_tokens <= 3 + len(tokenizer.encode("\n</think>\n\n")) + 2


async def test_the_messages_api_budget_tokens_and_the_400s(thinking_proxy, smollm2):
    import anthropic

    proxy, tokenizer = thinking_proxy
    thought, answer = _budgeted_reference(smollm2, tokenizer, ASK, 4, 60)
    async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0) as client:
        message = await client.messages.create(model="smollm2", messages=ASK, max_tokens=60, extra_body={"temperature": 0},
                                               thinking={"type": "enabled", "budget_tokens": 4})
        assert [(block.type, getattr(block, "thinking", None) or getattr(block, "text", None)) for block in message.content] == [
            ("thinking", thought), ("text", answer)]
        for budget in (0, 60, "x"):
            with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
                await client.messages.create(model="smollm2", messages=ASK, max_tokens=60,
                                             thinking={"type": "enabled", "budget_tokens": budget})
    async with openai.AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
        for budget in (-1, 2.5, "many", True):
            with pytest.raises(openai.BadRequestError) as err:
                await oa.chat.completions.create(model="smollm2", messages=ASK, max_tokens=8,
                                                 extra_body={"thinking_token_budget": budget})
            assert err.value.param == "thinking_token_budget"
