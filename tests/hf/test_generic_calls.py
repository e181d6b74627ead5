"""Generic tool calls (generic_calls.py): SmolLM2's chat template shows it no tools, so with
``tool_call_syntax: auto`` the tools are described in the system message and the answer is
held to ``{"tool_calls": [...]}`` or ``{"response": "..."}``, read back as OpenAI's
``tool_calls`` or content, streamed as written; through the ``openai`` and ``ollama`` clients
and the Responses API."""

from __future__ import annotations

import json

import pytest

from kvstream.hf.generic_calls import GenericAnswerScanner, answer_schema, tools_prompt, with_tools_prompt
from tests.conftest import require_import

require_import("torch")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# Greedy SmolLM2-135M answers the first with text and the last with calls (checked below: the
# tests hold the mechanics, whichever the model picks, and that both forms come back).
ASKED = ["What is the weather in Paris?", "Hi! How are you?", "Tell me a joke."]


def scanned(chunks: list[str]) -> tuple[str, list[dict], int]:
    """The content, the call deltas and the call count a scanner gives for ``chunks``."""
    scanner, pieces = GenericAnswerScanner(), []
    for chunk in chunks:
        pieces += scanner.feed(chunk)
    pieces += scanner.finish()
    return "".join(p.text for p in pieces if p.call is None), [p.call for p in pieces if p.call is not None], scanner.calls


def split_everywhere(text: str):
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)


def test_a_response_streams_as_its_decoded_string_however_it_is_split():
    text = json.dumps({"response": 'Say "hi" \\ tab\there\nand \u00e9 \U0001F600 done'}, ensure_ascii=True)
    for chunks in split_everywhere(text):
        content, calls, count = scanned(chunks)
        assert content == 'Say "hi" \\ tab\there\nand \u00e9 \U0001F600 done' and not calls and count == 0, chunks


def test_calls_stream_however_they_are_split_and_the_closing_brace_is_not_content():
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]}'
    for chunks in split_everywhere(text):
        content, calls, count = scanned(chunks)
        assert content == "" and count == 2, chunks
        names = [c["function"]["name"] for c in calls if "id" in c]
        assert names == ["get_weather", "f"]
        arguments = "".join(c["function"].get("arguments", "") for c in calls if c["index"] == 0)
        assert json.loads(arguments) == {"city": "Paris"}


def test_text_that_is_neither_form_is_content_and_a_cut_response_gives_what_it_had():
    assert scanned(["Plain ", "text"])[0] == "Plain text"
    assert scanned(['{"other": "x"}'])[0] == '{"other": "x"}'
    assert scanned(['{"response": "cut sh', "ort \\u00"])[0] == "cut short "  # an escape never finished is dropped


def test_an_answer_cut_before_it_said_anything_has_no_content():
    """max_tokens ending the answer inside the object's opening, or inside the calls' list
    before a call's arguments began: no content (the held form's text, and the scanner's own
    mark, came back as content), no call; a call whose arguments began is the call as far
    as it went."""
    for cut in ['{\n  "tool_calls', '{"resp', '{', '{"tool_calls": [', '{"tool_calls": [{"name": "get_',
                '{"tool_calls": [{"name": "get_weather", "arg']:
        assert scanned([cut]) == ("", [], 0), cut
    content, calls, count = scanned(['{"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b",'])
    assert content == "" and count == 1 and [c["function"]["name"] for c in calls if "id" in c] == ["a"]
    content, calls, count = scanned(['{"tool_calls": [{"name": "a", "arguments": {"x": 1'])
    assert content == "" and count == 1 and "".join(c["function"].get("arguments", "") for c in calls) == '{"x": 1'
    assert scanned(['{"oth'])[0] == '{"oth'  # not the opening of either form: text as written


def test_the_prompt_and_schema_name_every_tool_and_one_call_when_parallel_calls_are_off():
    text = tools_prompt([WEATHER], single_call=False)
    assert '"name": "get_weather"' in text and '"description": "The current weather in a city."' in text
    assert '{"tool_calls": [' in text and '{"response": ' in text
    merged = with_tools_prompt([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}], [WEATHER], False)
    assert merged[0]["content"].startswith("Be brief.\n\nYou can call these tools:") and len(merged) == 2
    assert with_tools_prompt([{"role": "user", "content": "x"}], [WEATHER], False)[0]["role"] == "system"
    calls = answer_schema([WEATHER], single_call=True)["anyOf"][0]["properties"]["tool_calls"]
    assert (calls["minItems"], calls["maxItems"]) == (1, 1)
    assert "maxItems" not in answer_schema([WEATHER], single_call=False)["anyOf"][0]["properties"]["tool_calls"]


async def test_the_model_calls_or_answers_as_the_constraint_allows_whole_and_streamed(hf_proxy, oa, smollm2):
    """Each question: the prompt is the chat with the tools' description in its system
    message; the answer is text or well-formed calls of the tool, the same streamed; the
    greedy model gives both forms over the three questions."""
    from kvstream.hf.loader import chat_token_ids

    tokenizer = smollm2[2]
    assert hf_proxy.engine.backend.describe()["tool_call_syntax"] == "generic"
    forms = set()
    for question in ASKED:
        messages = [{"role": "user", "content": question}]
        reply = await oa.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=60,
                                                 temperature=0)
        assert reply.usage.prompt_tokens == len(chat_token_ids(tokenizer, with_tools_prompt(messages, [WEATHER], False)))
        message = reply.choices[0].message
        stream = await oa.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=60,
                                                  temperature=0, stream=True)
        content, arguments, names = "", {}, {}
        async for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            content += (delta.content or "") if delta else ""
            for call in (delta.tool_calls or []) if delta else []:
                names[call.index] = names.get(call.index) or call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
        if message.tool_calls:
            forms.add("calls")
            assert reply.choices[0].finish_reason in ("tool_calls", "length") and not message.content
            for call in message.tool_calls:
                assert call.function.name == "get_weather" and call.id.startswith("call_")
                if reply.choices[0].finish_reason == "tool_calls":
                    assert isinstance(json.loads(call.function.arguments)["city"], str)
            assert [names[i] for i in sorted(names)] == [c.function.name for c in message.tool_calls]
            assert [arguments[i] for i in sorted(arguments)] == [c.function.arguments for c in message.tool_calls]
        else:
            forms.add("text")
            assert message.content and content == message.content and not names
            assert not message.content.lstrip().startswith("{")  # the response's string, not the object
    assert forms == {"calls", "text"}


async def test_a_call_sent_back_with_its_result_is_in_the_prompt_as_the_object_the_model_writes(oa, smollm2):
    from kvstream.hf.loader import chat_token_ids

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "user", "content": ASKED[0]}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."}]
    reply = await oa.chat.completions.create(model="smollm2", messages=history, tools=[WEATHER], max_tokens=40, temperature=0)
    ids = chat_token_ids(smollm2[2], with_tools_prompt(history, [WEATHER], False))
    prompt = smollm2[2].decode(ids)
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in prompt
    assert "Sunny, 21 degrees." in prompt and reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls


async def test_parallel_calls_off_gives_one_call_at_most(oa):
    reply = await oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": ASKED[2]}], tools=[WEATHER],
                                             max_tokens=60, temperature=0, parallel_tool_calls=False)
    assert len(reply.choices[0].message.tool_calls or []) == 1  # the same question calls twice without the flag


async def test_the_ollama_client_and_the_responses_api_get_calls_too(hf_proxy, oa):
    import ollama

    tool = {"type": "function", "function": WEATHER["function"]}
    reply = await ollama.AsyncClient(host=hf_proxy.url).chat(
        model="smollm2", messages=[{"role": "user", "content": ASKED[2]}], tools=[tool], options={"temperature": 0, "num_predict": 60})
    assert reply.message.tool_calls and reply.message.tool_calls[0].function.name == "get_weather"
    assert isinstance(reply.message.tool_calls[0].function.arguments, dict)
    response = await oa.responses.create(model="smollm2", input=ASKED[2], max_output_tokens=60, temperature=0,
                                         tools=[{"type": "function", **WEATHER["function"]}])
    assert [item.type for item in response.output][:1] == ["function_call"] and response.output[0].name == "get_weather"


@pytest.mark.parametrize("parameters", [{"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]$"}}}])
async def test_strict_tools_whose_parameters_cannot_be_held_are_a_400_naming_tools(oa, parameters):
    import openai

    tool = {"type": "function", "function": {"name": "f", "parameters": parameters, "strict": True}}
    with pytest.raises(openai.BadRequestError) as err:
        await oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], tools=[tool], max_tokens=4)
    assert err.value.param == "tools"


async def test_a_tools_bounds_the_hold_cannot_enforce_are_left_to_the_model(oa):
    """A tool that is not ``strict`` with ``minimum`` and ``pattern`` (as real tools have: a
    400 before) is offered and its call held to the rest of its schema."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": WEATHER["function"]["description"],
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                                 "required": ["city"]}}}
    reply = await oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": ASKED[0]}], tools=[tool],
                                             max_tokens=120, temperature=0, parallel_tool_calls=False)
    calls = reply.choices[0].message.tool_calls
    assert calls and reply.choices[0].finish_reason == "tool_calls"
    for call in calls:
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and isinstance(arguments["city"], str)
        assert isinstance(arguments["days"], int)  # (every property is written, as in a JSON hold)


async def test_the_anthropic_client_gets_a_tool_use_block(hf_proxy):
    anthropic = pytest.importorskip("anthropic")
    async with anthropic.AsyncAnthropic(base_url=hf_proxy.url, api_key="unused", max_retries=0) as client:
        message = await client.messages.create(
            model="smollm2", max_tokens=60, extra_body={"temperature": 0}, messages=[{"role": "user", "content": ASKED[2]}],
            tools=[{"name": "get_weather", "description": WEATHER["function"]["description"],
                    "input_schema": WEATHER["function"]["parameters"]}])
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and isinstance(uses[0].input, dict)
    assert message.stop_reason in ("tool_use", "max_tokens")
