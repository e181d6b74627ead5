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

from kvstream.hf.call_streams import ArgumentsCallStream, JsonCallStream
from kvstream.hf.tool_calls import ForcedNames, cut_call_name, forced_call_schema, forced_names
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
    # A named function: its arguments alone (the name is the request's, as vLLM serves it).
    named = forced_call_schema([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named == TIME["function"]["parameters"]
    assert forced_names([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}) == ForcedNames(("get_time",), True)
    assert forced_names([WEATHER, TIME], "required") == ForcedNames(("get_weather", "get_time"), False)
    required = forced_call_schema([WEATHER, TIME], "required")
    assert [o["properties"]["name"]["const"] for o in required["anyOf"]] == ["get_weather", "get_time"]
    assert forced_call_schema([WEATHER], "auto") is None and forced_call_schema([WEATHER], "none") is None
    assert forced_call_schema(None, None) is None
    # A pydantic model's nested definitions move to the root, where its "#/$defs/..." point.
    tool = openai.pydantic_function_tool(Person)
    schema = forced_call_schema([tool], "required")
    assert "Address" in schema["$defs"] and "$defs" not in schema["properties"]["arguments"]
    assert "Address" in forced_call_schema([tool], {"type": "function", "function": {"name": "Person"}})["$defs"]  # already at the root
    for tools, choice in (
        ([], "required"),  # nothing to call
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}),
        ([WEATHER], "always"),
        ([{"type": "function", "function": {}}], "required"),  # a tool without a name
    ):
        with pytest.raises(BackendRejected):
            forced_call_schema(tools, choice)
    # A choice that is no choice is said to be one, tools or none (not "'tools' lists none").
    for tools in ([WEATHER], None):
        with pytest.raises(BackendRejected) as caught:
            forced_names(tools, 5)
        assert caught.value.message.startswith("Invalid value for 'tool_choice': 'none', 'auto', 'required'")


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
    # A named call's body is its arguments alone: a call from its first token.
    [header] = ArgumentsCallStream(0, name="get_weather").feed("{")
    assert header["function"] == {"name": "get_weather", "arguments": "{"}
    [whole] = ArgumentsCallStream(0, name="get_weather").close(' {"city": "Paris"} ')
    assert whole["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    [cut] = ArgumentsCallStream(0, name="f").cut("")
    assert cut["function"] == {"name": "f", "arguments": ""}
    # "required", cut before the arguments: the call where its name so far says which.
    assert cut_call_name('{\n"name": "get_w', ("get_weather", "get_time")) == "get_weather"
    assert cut_call_name('{"name": "get_', ("get_weather", "get_time")) is None
    assert cut_call_name("{", ("only",)) == "only" and cut_call_name("", ("a", "b")) is None


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
    """A named call is a call from its first token: cut anywhere, its arguments go as far as
    they went (as OpenAI's do). "required" with two tools, cut before the name says which:
    the text so far."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = await oa.chat.completions.create(model="smollm2", messages=MESSAGES, tools=[WEATHER], max_tokens=60,
                                             temperature=0, tool_choice=named)
    arguments = whole.choices[0].message.tool_calls[0].function.arguments
    for max_tokens in (1, 3, 6, 10):
        reply = await oa.chat.completions.create(
            model="smollm2", messages=MESSAGES, tools=[WEATHER], max_tokens=max_tokens, temperature=0, tool_choice=named)
        choice = reply.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and arguments.startswith(call.function.arguments)  # greedy
        with pytest.raises(ValueError):
            json.loads(call.function.arguments)
    cut = await oa.chat.completions.create(model="smollm2", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=1,
                                           temperature=0, tool_choice="required")
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert cut.choices[0].message.content.lstrip() == "{"


async def test_a_forced_call_of_a_tool_with_bounds_is_held_to_the_rest(oa):
    """``minimum`` and ``pattern`` in a tool that is not ``strict``: the call is forced and held
    to everything else in its schema (a 400 before; strict, it still is: below)."""
    bounded = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z]"}, "days": {"type": "integer", "minimum": 1}}, "required": ["city", "days"]}}}
    reply = await oa.chat.completions.create(model="smollm2", messages=MESSAGES, tools=[bounded], max_tokens=100, temperature=0,
                                             tool_choice="required")
    [call] = reply.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(arguments) == {"city", "days"} and isinstance(arguments["days"], int)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tool_choice": "required", "tools": [WEATHER], "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$"}}}}}]}, "tools"),
    ],
)
async def test_calls_that_cannot_be_forced_are_400s_naming_the_field(oa, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        await oa.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, **kwargs)
    assert err.value.param == param


async def test_auto_is_refused_where_the_template_drops_the_tools_and_generic_calls_are_off(smollm2, start_proxy):
    """``tool_call_syntax: none``: no generic calls (generic_calls.py) for SmolLM2's chat-only
    template either, so tools it would never see are a 400, as Ollama answers."""
    from openai import AsyncOpenAI

    from kvstream.hf import HFBackend
    from kvstream.hf.loader import LoadedModel

    model, _, tokenizer = smollm2
    backend = HFBackend(None, None, preloaded=LoadedModel(model, tokenizer, "smollm2", "hf:test"), block_size=16,
                        num_gpu_blocks=64, num_cpu_blocks=8, max_batch_size=4, tool_call_syntax="none")
    proxy = await start_proxy(backend)
    await proxy.engine.start()
    try:
        async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as oa:
            with pytest.raises(openai.BadRequestError, match="does not support tools"):
                await oa.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=8, tools=[WEATHER])
    finally:
        await proxy.engine.close()


async def test_a_client_leaving_in_the_middle_of_a_streamed_call_frees_everything(hf_proxy, oa):
    """The client closes its stream after the call's first deltas (an agent cancelled while
    a long argument is written): the sequence is aborted, its blocks freed, nothing else
    disturbed; the next call streams whole."""
    import aiohttp

    from tests.hf.test_serving import wait_idle

    note = {"type": "function", "function": {"name": "write_note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Write a long note about the sea."}],
            "tools": [note], "tool_choice": {"type": "function", "function": {"name": "write_note"}},
            "max_tokens": 300, "temperature": 0, "stream": True}
    runner = hf_proxy.engine.backend.runner
    before = runner.counters.decode_tokens
    async with aiohttp.ClientSession() as http:
        resp = await http.post(hf_proxy.v1 + "/chat/completions", json=body)
        seen = 0
        async for line in resp.content:
            seen += b'"tool_calls"' in line
            if seen >= 3:  # the header and a couple of argument pieces
                break
        resp.close()
    await wait_idle(hf_proxy)
    assert runner.counters.decode_tokens - before < 300
    stream = await oa.chat.completions.create(**{**body, "max_tokens": 20})
    parts = [c.choices[0].delta.tool_calls[0] async for c in stream if c.choices and c.choices[0].delta.tool_calls]
    assert parts[0].function.name == "write_note" and parts[0].function.arguments.startswith("{")


async def test_a_chat_only_template_reads_an_earlier_call_as_text_and_its_result(hf_proxy, oa, smollm2):
    """SmolLM2's template renders chat only: an earlier call sent back with its result
    (content null, as OpenAI's clients send it) is written into the assistant's turn as text
    instead of failing the template."""
    from kvstream.hf.loader import chat_token_ids

    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."},
    ]
    answer = await oa.chat.completions.create(model="smollm2", messages=history, max_tokens=8)
    assert answer.choices[0].message.content
    for sent in (history, [{k: v for k, v in m.items() if v is not None} for m in history]):  # null, or left out
        prompt = smollm2[2].decode(chat_token_ids(smollm2[2], sent))
        assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]}' in prompt
        assert "Sunny, 21 degrees." in prompt


@pytest.mark.parametrize("content", ["{{ m.content or '' }}", "{{ m.content }}"])  # None as nothing, or as "None"
def test_a_template_that_ignores_calls_gets_them_as_text(smollm2, content):
    """A chat-only template that renders an assistant turn's content and silently skips its
    ``tool_calls``: the calls are written into the turn, as for a template that fails on
    them; a turn without calls renders exactly as the template does."""
    import copy

    from kvstream.hf.loader import chat_token_ids

    tokenizer = copy.copy(smollm2[2])
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n" + content + "<|im_end|>\n{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "Snow."}]
    prompt = tokenizer.decode(chat_token_ids(tokenizer, history))
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}' in prompt and "Snow." in prompt
    plain = tokenizer.decode(chat_token_ids(tokenizer, MESSAGES))
    assert plain == tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


async def test_an_image_for_a_text_only_model_is_a_400_that_says_so(oa):
    content = [{"type": "text", "text": "What is in it?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(openai.BadRequestError) as caught:
        await oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}], max_tokens=4)
    error = caught.value.body
    assert error["param"] == "messages" and error["code"] == "unsupported_content"
    assert "takes text only" in error["message"] and "image_url" in error["message"]
