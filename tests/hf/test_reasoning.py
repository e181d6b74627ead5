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
