"""OpenAI's Responses API on the in-process engine, driven by the official client
(``responses.create``, ``responses.stream``, ``responses.parse``): text, thinking, forced and
the model's own function calls, a conversation continued with ``function_call_output``
items, structured output, and the 400s; the same answers and token counts as the chat
route gives the same request."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel

from tests.conftest import require_import
from tests.hf.conftest import templated_proxy

require_import("torch")

FIXTURES = Path(__file__).parent.parent / "fixtures"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


async def test_text_whole_and_streamed_as_the_chat_route_answers_it(oa):
    """``instructions`` is the system message, ``max_output_tokens`` the budget: the same
    greedy text and token counts as /v1/chat/completions; streamed, the events OpenAI sends,
    in order, numbered from 0, and the client's stream helper rebuilds the same response."""
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]
    chat = await oa.chat.completions.create(model="smollm2", messages=messages, max_tokens=40, temperature=0)
    reply = await oa.responses.create(model="smollm2", instructions="Answer briefly.", input="What is 2+2?",
                                      max_output_tokens=40, temperature=0)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == "smollm2"
    assert reply.output_text == chat.choices[0].message.content
    assert reply.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert reply.usage.total_tokens == chat.usage.total_tokens and reply.store is True

    async with oa.responses.stream(model="smollm2", instructions="Answer briefly.",
                                   input=[{"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]}],
                                   max_output_tokens=40, temperature=0) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == reply.output_text and final.usage.output_tokens == reply.usage.output_tokens


async def test_a_stored_response_continued_is_the_chat_routes_prompt_and_hits_the_cache(oa, hf_proxy):
    """``previous_response_id``: the second turn is prompted with the first turn's input and
    answer, token for token as the chat route prompts the same conversation, and the first
    turn's KV is found in the prefix cache; the stored response reads back as answered."""
    first = await oa.responses.create(model="smollm2", instructions="Answer briefly.", input="Name a colour.",
                                      max_output_tokens=12, temperature=0)
    assert (await oa.responses.retrieve(first.id)).model_dump() == first.model_dump()
    second = await oa.responses.create(model="smollm2", instructions="Answer briefly.", input="And another one?",
                                       previous_response_id=first.id, max_output_tokens=12, temperature=0)
    chat = await oa.chat.completions.create(model="smollm2", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And another one?"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16  # all but a partial block
    assert hf_proxy.engine.snapshot()["prefix_cache"]["hit_tokens"] > 0


async def test_cut_by_max_output_tokens_it_is_incomplete(oa):
    reply = await oa.responses.create(model="smollm2", input="Tell me a long story about the sea.", max_output_tokens=5,
                                      temperature=0)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 5 and reply.output[0].status == "incomplete"
    stream = await oa.responses.create(model="smollm2", input="Tell me a long story about the sea.", max_output_tokens=5,
                                       temperature=0, stream=True)
    events = [event async for event in stream]
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == reply.output_text


async def test_a_forced_call_is_a_function_call_item_streamed_as_written(oa):
    choice = {"type": "function", "name": "get_weather"}
    reply = await oa.responses.create(model="smollm2", input="Weather in Paris?", tools=[WEATHER], tool_choice=choice,
                                      max_output_tokens=40, temperature=0)
    [call] = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and "city" in json.loads(call.arguments) and reply.status == "completed"
    async with oa.responses.stream(model="smollm2", input="Weather in Paris?", tools=[WEATHER], tool_choice=choice,
                                   max_output_tokens=40, temperature=0) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    pieces = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    assert len(pieces) >= 3 and "".join(pieces) == done.arguments == call.arguments  # greedy both times
    assert final.output[0].arguments == call.arguments and final.output[0].status == "completed"


async def test_the_models_own_call_and_the_conversation_continued_with_its_output(smollm2, start_proxy):
    """Under a Hermes-style template: the model's call comes back as a function_call item;
    sent back with a function_call_output item, the prompt is the chat route's for the same
    conversation, token for token."""
    from openai import AsyncOpenAI

    from kvstream.hf.loader import chat_token_ids

    example = [{"role": "user", "content": "What is the weather in London?"},
               {"type": "function_call", "call_id": "call_0", "name": "get_weather", "arguments": '{"city": "London"}'},
               {"role": "user", "content": "What is the weather in Paris?"}]
    async with templated_proxy(smollm2, start_proxy, (FIXTURES / "hermes_tools.jinja").read_text()) as (proxy, tokenizer):
        async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
            reply = await oa.responses.create(model="smollm2", input=example, tools=[WEATHER], max_output_tokens=40,
                                              temperature=0)
            [call] = [item for item in reply.output if item.type == "function_call"]
            assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
            following = example + [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                                   {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}]
            after = await oa.responses.create(model="smollm2", input=following, tools=[WEATHER], max_output_tokens=20, temperature=0)
    messages = [example[0],
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "London"}'}}]},
                example[2],
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp_c": 18}'}]
    assert after.usage.input_tokens == len(chat_token_ids(tokenizer, messages, tools=[CHAT_WEATHER]))


async def test_thinking_comes_back_as_a_reasoning_item_before_the_message(smollm2, start_proxy):
    from openai import AsyncOpenAI

    from tests.hf.test_reasoning import ASK, TEMPLATE

    async with templated_proxy(smollm2, start_proxy, TEMPLATE) as (proxy, _):
        async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
            chat = await oa.chat.completions.create(model="smollm2", messages=ASK, max_tokens=60, temperature=0)
            reply = await oa.responses.create(model="smollm2", input=ASK, max_output_tokens=60, temperature=0)
            async with oa.responses.stream(model="smollm2", input=ASK, max_output_tokens=60, temperature=0) as stream:
                events = [event async for event in stream]
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content[0].text == chat.choices[0].message.reasoning_content
    assert message.content[0].text == chat.choices[0].message.content
    # The engine's count of thinking tokens, the same as the chat route reports.
    assert reply.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens > 0
    thought = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert thought == reasoning.content[0].text


class City(BaseModel):
    name: str
    country: str


async def test_structured_output_through_the_parse_helper(oa):
    reply = await oa.responses.parse(model="smollm2", input="Paris as JSON with its country.", text_format=City,
                                     max_output_tokens=60, temperature=0)
    assert isinstance(reply.output_parsed, City) and reply.output_parsed.name


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"background": True, "store": False}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"max_output_tokens": -1}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": ["get_weather"]}, "tools[0]"),
        ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_unknown"}]}, "input[0].id"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ],
)
async def test_what_cannot_be_served_is_a_400_naming_the_responses_field(oa, kwargs, param):
    body = {"model": "smollm2", "input": "hi", "max_output_tokens": 5} | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        await oa.responses.create(**body)
    assert err.value.param == param, err.value.message


@pytest.mark.parametrize("body", [
    {"input": 5}, {"input": [None]}, {"input": [{"role": "user", "content": 5}]},
    {"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, {"input": [{"type": "function_call_output", "output": "x"}]},
    {"tools": "x"}, {"tools": [5]}, {"tool_choice": 5}, {"instructions": 5}, {"text": {"format": 5}},
    {"max_output_tokens": "x"}, {"top_logprobs": 50}, {"temperature": "hot"}, {"conversation": "conv_1"},
    {"text": "x"}, {"reasoning": ["high"]},
])
async def test_hostile_bodies_are_400s_never_500s(hf_proxy, body):
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.post(hf_proxy.v1 + "/responses", json={"input": "hi", "max_output_tokens": 4} | body) as resp:
            answer = await resp.json()
    assert resp.status == 400, answer
    assert set(answer["error"]) >= {"message", "type", "param", "code"}


@pytest.mark.parametrize("path", ["/responses", "/messages"])
async def test_a_client_leaving_a_stream_frees_everything(hf_proxy, path):
    """The Responses and Messages streams, closed by their client after the first events:
    the generation is cancelled and its blocks freed, as on the chat route."""
    import aiohttp

    from tests.hf.test_serving import wait_idle

    runner = hf_proxy.engine.backend.runner
    before = runner.counters.decode_tokens
    body = {"model": "smollm2", "stream": True, "temperature": 0}
    body |= {"input": "Tell me a long story.", "max_output_tokens": 300} if path == "/responses" else {
        "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 300}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(hf_proxy.v1 + path, json=body)
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"event:")
            if seen >= 4:
                break
        resp.close()
    await wait_idle(hf_proxy)
    assert runner.counters.decode_tokens - before < 50  # cancelled, not run to its 300


async def test_a_background_response_is_the_foreground_answer_and_cancels_cleanly(oa, hf_proxy):
    """``background: true`` on the engine: polled to the same greedy answer as the same
    request in the foreground; a long one cancelled while it decodes stops decoding and frees
    its blocks."""
    import asyncio

    from tests.hf.test_serving import wait_idle

    body = {"model": "smollm2", "instructions": "Answer briefly.", "input": "What is 2+2?", "max_output_tokens": 30,
            "temperature": 0}
    foreground = await oa.responses.create(**body)
    created = await oa.responses.create(**body, background=True)
    assert created.status == "queued"
    for _ in range(1000):
        polled = await oa.responses.retrieve(created.id)
        if polled.status not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.02)
    assert (polled.status, polled.output_text, polled.usage.output_tokens) == (
        foreground.status, foreground.output_text, foreground.usage.output_tokens)

    runner = hf_proxy.engine.backend.runner
    long = await oa.responses.create(model="smollm2", input="Tell me a long story.", max_output_tokens=400,
                                     temperature=0, background=True)
    for _ in range(1000):
        if (await oa.responses.retrieve(long.id)).output:
            break
        await asyncio.sleep(0.02)
    before = runner.counters.decode_tokens
    cancelled = await oa.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.output_text
    await wait_idle(hf_proxy)
    assert runner.counters.decode_tokens - before < 50  # stopped, not run to its 400


async def test_truncation_auto_keeps_the_latest_items_that_fit(oa, hf_proxy, smollm2):
    """A conversation past the pool (4,096 tokens here): a 400 by default; with ``truncation:
    "auto"`` the prompt is the instructions and the latest items whose exact token count
    (the model's template) fits with ``max_output_tokens``, one item more not fitting."""
    from kvstream.hf.loader import chat_token_ids

    _, _, tokenizer = smollm2
    long = "The quick brown fox jumps over the lazy dog. " * 45
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {long}"} for i in range(11)]
    items.append({"role": "user", "content": "Say hi."})
    body = {"model": "smollm2", "instructions": "Be brief.", "input": items, "max_output_tokens": 16, "temperature": 0}
    with pytest.raises(openai.BadRequestError) as err:
        await oa.responses.create(**body)
    assert err.value.code == "context_length_exceeded"

    def prompt(kept: int) -> int:
        return len(chat_token_ids(tokenizer, [{"role": "system", "content": "Be brief."}] + items[len(items) - kept:]))

    fitting = max(kept for kept in range(1, len(items)) if prompt(kept) + 16 <= 4096)
    reply = await oa.responses.create(**body, truncation="auto")
    assert reply.truncation == "auto" and reply.usage.input_tokens == prompt(fitting) and prompt(fitting + 1) + 16 > 4096


async def test_input_tokens_is_the_prompt_a_response_would_have(oa):
    counted = await oa.responses.input_tokens.count(model="smollm2", instructions="Answer briefly.", input="What is 2+2?")
    reply = await oa.responses.create(model="smollm2", instructions="Answer briefly.", input="What is 2+2?",
                                      max_output_tokens=4, temperature=0)
    assert counted.input_tokens == reply.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as err:
        await oa.responses.input_tokens.count(model="smollm2", input=[{"type": "web_search_call", "id": "x"}])
    assert err.value.param == "input[0].type"
