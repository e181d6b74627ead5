"""Forced tool calls on the in-process engine: ``tool_choice`` naming a function or
``"required"`` holds the answer to the call's JSON schema and returns it as OpenAI's
``tool_calls``; the official client's ``chat.completions.parse`` reads it into the pydantic
model the tool was made from."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from kvstream.hf.call_streams import JsonCallStream
from kvstream.hf.tool_calls import forced_call_schema
from kvstream.types import BackendRejected
from tests.conftest import require_import

require_import("torch")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 12}}}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    age: int
    role: Literal["admin", "user"]
    address: Address


def test_the_forced_call_schema():
    named = forced_call_schema([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named == {"type": "object", "properties": {"name": {"const": "get_time"},
                                                       "arguments": TIME["function"]["parameters"]}}
    required = forced_call_schema([WEATHER, TIME], "required")
    assert [o["properties"]["name"]["const"] for o in required["anyOf"]] == ["get_weather", "get_time"]
    assert forced_call_schema([WEATHER], "auto") is None and forced_call_schema([WEATHER], "none") is None
    assert forced_call_schema(None, None) is None
    # A pydantic model's nested definitions move to the root, where its "#/$defs/..." point.
    tool = openai.pydantic_function_tool(Person)
    schema = forced_call_schema([tool], "required")
    assert "Address" in schema["$defs"] and "$defs" not in schema["properties"]["arguments"]
    for tools, choice in (
        ([], "required"),  # nothing to call
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}),
        ([WEATHER], "always"),
        ([{"type": "function", "function": {}}], "required"),  # a tool without a name
    ):
        with pytest.raises(BackendRejected):
            forced_call_schema(tools, choice)


def test_a_call_is_read_whole_or_as_far_as_it_went():
    """A forced call's text, read by the stream that serves it (call_streams.py), given whole."""
    [call] = JsonCallStream(0).close('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}')
    assert call["type"] == "function" and call["id"].startswith("call_") and call["index"] == 0
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    [cut] = JsonCallStream(0).cut('{"name": "get_weather", "arguments": {"city": "Par')
    assert cut["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert JsonCallStream(0).cut('{"name": "get_wea') is None and JsonCallStream(0).cut("") is None
    assert JsonCallStream(0).close('{"name": "get_wea') is None and JsonCallStream(0).close("") is None


async def test_a_named_call_comes_back_as_tool_calls(oa):
    reply = await oa.chat.completions.create(
        model="smollm2", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert list(arguments) == ["city", "unit"] and arguments["unit"] in ("celsius", "fahrenheit")
    assert len(arguments["city"]) <= 20

    # Streamed: the role, then the call's id and name, its arguments as they are written, the finish.
    stream = await oa.chat.completions.create(
        model="smollm2", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, stream=True)
    chunks = [c async for c in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    first, *more = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert first.function.name == "get_weather" and first.id.startswith("call_") and len(more) >= 3
    assert all(m.id is None and m.function.name is None for m in more)
    streamed = first.function.arguments + "".join(m.function.arguments for m in more)
    assert json.loads(streamed) == arguments  # greedy both times
    assert not any(d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_required_picks_one_of_the_tools_for_every_choice(oa):
    reply = await oa.chat.completions.create(
        model="smollm2", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60, n=2, seed=3)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments), dict)


async def test_the_official_parse_helper_reads_the_call_into_its_model(oa):
    completion = await oa.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Alice, 30, an admin, lives at 1 Main St, Springfield."}],
        tools=[openai.pydantic_function_tool(Person)], tool_choice={"type": "function", "function": {"name": "Person"}},
        max_tokens=120, temperature=0)
    call = completion.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Person)
    assert call.function.parsed_arguments.role in ("admin", "user")


async def test_a_call_cut_by_max_tokens_is_partial_and_says_length(oa):
    """Cut before its name is whole, the answer is the text so far; after, a call whose
    arguments go as far as they went (as OpenAI's do). The full call takes 45 tokens."""
    partial_calls = 0
    for max_tokens in (12, 24, 30, 36):
        reply = await oa.chat.completions.create(
            model="smollm2", messages=MESSAGES, tools=[WEATHER], max_tokens=max_tokens, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = reply.choices[0]
        assert choice.finish_reason == "length"
        if choice.message.tool_calls is None:
            assert choice.message.content.lstrip().startswith('{') and "arguments" not in choice.message.content
            continue
        partial_calls += 1
        assert choice.message.tool_calls[0].function.name == "get_weather"
        with pytest.raises(ValueError):
            json.loads(choice.message.tool_calls[0].function.arguments)
    assert partial_calls


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tool_choice": "required", "tools": [WEATHER], "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}}}}]}, "tools"),
    ],
)
async def test_calls_that_cannot_be_forced_are_400s_naming_the_field(oa, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        await oa.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, **kwargs)
    assert err.value.param == param


async def test_auto_is_still_refused_where_the_template_drops_the_tools(oa):
    with pytest.raises(openai.BadRequestError, match="does not support tools"):
        await oa.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, tools=[WEATHER])
