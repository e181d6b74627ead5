"""Anthropic's Messages API on the in-process engine, driven by the official ``anthropic``
client (``messages.create``, ``messages.stream``): text, a system prompt, thinking, forced and
the model's own tool uses, a conversation continued with ``tool_result`` blocks, structured
output, and errors in Anthropic's shape; the same answers and token counts as the chat route
gives the same request. (This client version sends no temperature of its own: it goes in
``extra_body``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import require_import
from tests.hf.conftest import templated_proxy

require_import("torch")
anthropic = require_import("anthropic")

FIXTURES = Path(__file__).parent.parent / "fixtures"
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                 "parameters": WEATHER["input_schema"]}}


@pytest.fixture
async def claude(hf_proxy):
    async with anthropic.AsyncAnthropic(base_url=hf_proxy.url, api_key="unused", max_retries=0) as client:
        yield client


async def test_text_whole_and_streamed_as_the_chat_route_answers_it(claude, oa):
    chat = await oa.chat.completions.create(model="smollm2", messages=[{"role": "system", "content": "Answer briefly."},
                                                                        {"role": "user", "content": "What is 2+2?"}],
                                            max_tokens=40, temperature=0)
    message = await claude.messages.create(model="smollm2", system="Answer briefly.", max_tokens=40,
                                           messages=[{"role": "user", "content": "What is 2+2?"}], **GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert message.stop_reason == ("end_turn" if chat.choices[0].finish_reason == "stop" else "max_tokens")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens

    async with claude.messages.stream(model="smollm2", system=[{"type": "text", "text": "Answer briefly."}], max_tokens=40,
                                      messages=[{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}],
                                      **GREEDY) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()
    assert text == block.text == final.content[0].text and final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == chat.usage.prompt_tokens


async def test_a_stop_sequence_ends_the_message_and_is_named(claude):
    """stop_reason "stop_sequence" and the sequence that matched (the first in the text, not
    the first listed), whole and streamed; the text ends before it."""
    ask = {"model": "smollm2", "max_tokens": 40, "messages": [{"role": "user", "content": "What is the capital of France?"}],
           **GREEDY}
    free = await claude.messages.create(**ask)
    words = free.content[0].text.split()
    assert len(words) >= 4, free.content[0].text
    first, later = words[1], words[3]
    stops = [later, first] if later != first else [first]
    message = await claude.messages.create(stop_sequences=stops, **ask)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == first
    assert message.content[0].text == free.content[0].text[: free.content[0].text.index(first)]
    async with claude.messages.stream(stop_sequences=stops, **ask) as stream:
        deltas = [event async for event in stream if event.type == "message_delta"]
        final = await stream.get_final_message()
    assert [(d.delta.stop_reason, d.delta.stop_sequence) for d in deltas] == [("stop_sequence", first)]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == first
    assert final.content[0].text == message.content[0].text


async def test_cut_by_max_tokens(claude):
    message = await claude.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "Tell a story."}],
                                           **GREEDY)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4


async def test_a_forced_tool_use_streams_its_input_as_written(claude):
    choice = {"type": "tool", "name": "get_weather"}
    message = await claude.messages.create(model="smollm2", max_tokens=40, tools=[WEATHER], tool_choice=choice,
                                           messages=[{"role": "user", "content": "Weather in Paris?"}], **GREEDY)
    [use] = message.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_") and "city" in use.input
    assert message.stop_reason == "tool_use"
    async with claude.messages.stream(model="smollm2", max_tokens=40, tools=[WEATHER], tool_choice=choice,
                                      messages=[{"role": "user", "content": "Weather in Paris?"}], **GREEDY) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    partial = [event.delta.partial_json for event in events if event.type == "content_block_delta"]
    assert len(partial) >= 3 and json.loads("".join(partial)) == use.input == final.content[0].input


async def test_the_models_own_tool_use_and_the_conversation_continued_with_its_result(smollm2, start_proxy):
    """Under a Hermes-style template: the model's call comes back as a tool_use block; sent
    back with a tool_result block, the prompt is the chat route's for that conversation,
    token for token."""
    from kvstream.hf.loader import chat_token_ids

    history = [{"role": "user", "content": "What is the weather in London?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_0", "name": "get_weather",
                                                  "input": {"city": "London"}}]},
               {"role": "user", "content": "What is the weather in Paris?"}]
    async with templated_proxy(smollm2, start_proxy, (FIXTURES / "hermes_tools.jinja").read_text()) as (proxy, tokenizer):
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0) as claude:
            message = await claude.messages.create(model="smollm2", max_tokens=40, tools=[WEATHER], messages=history, **GREEDY)
            [use] = [block for block in message.content if block.type == "tool_use"]
            assert use.name == "get_weather" and use.input == {"city": "Paris"} and message.stop_reason == "tool_use"
            following = history + [
                {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"temp_c": 18}'},
                                             {"type": "text", "text": "And tomorrow?"}]}]
            after = await claude.messages.create(model="smollm2", max_tokens=20, tools=[WEATHER], messages=following, **GREEDY)
    messages = [history[0],
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "toolu_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "London"}'}}]},
                history[2],
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
                {"role": "tool", "tool_call_id": use.id, "content": '{"temp_c": 18}'},
                {"role": "user", "content": "And tomorrow?"}]
    expected = len(chat_token_ids(tokenizer, messages, tools=[CHAT_WEATHER]))
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens == expected


async def test_thinking_comes_back_as_a_thinking_block_before_the_text(smollm2, start_proxy):
    from tests.hf.test_reasoning import ASK, TEMPLATE

    async with templated_proxy(smollm2, start_proxy, TEMPLATE) as (proxy, _):
        async with anthropic.AsyncAnthropic(base_url=proxy.url, api_key="unused", max_retries=0) as claude:
            message = await claude.messages.create(model="smollm2", max_tokens=60, messages=ASK, **GREEDY)
            async with claude.messages.stream(model="smollm2", max_tokens=60, messages=ASK, **GREEDY) as stream:
                events = [event async for event in stream]
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking and text.type == "text" and text.text
    deltas = "".join(event.delta.thinking for event in events if event.type == "content_block_delta"
                     and event.delta.type == "thinking_delta")
    assert deltas == thinking.thinking


async def test_structured_output(claude):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    message = await claude.messages.create(model="smollm2", max_tokens=40, messages=[{"role": "user", "content": "A name."}],
                                           output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    assert isinstance(json.loads(message.content[0].text)["name"], str)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"messages": []}, {"messages": [{"role": "system", "content": "x"}]},
    {"extra_body": {"temperature": 5}}, {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
    {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
    {"thinking": {"type": "sometimes"}}, {"stop_sequences": ["a"] * 9},
])
async def test_errors_are_anthropics_shape_and_status(claude, kwargs):
    body = {"model": "smollm2", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]} | kwargs
    with pytest.raises(anthropic.BadRequestError) as err:
        await claude.messages.create(**body)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"


async def test_count_tokens_is_the_prompt_a_message_would_have(claude):
    """``messages.count_tokens`` (no max_tokens) counts the prompt exactly as the message
    that follows it is charged, tools included."""
    request = {"model": "smollm2", "system": "Answer briefly.", "messages": [{"role": "user", "content": "What is 2+2?"}]}
    counted = await claude.messages.count_tokens(**request)
    message = await claude.messages.create(max_tokens=4, **request, **GREEDY)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    forced = await claude.messages.count_tokens(**request, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert forced.input_tokens == counted.input_tokens  # SmolLM2's template shows no tools: the same prompt
    with pytest.raises(anthropic.BadRequestError):
        await claude.messages.count_tokens(model="smollm2", messages=[])
