"""Marks that ask for a prompt prefix to stay cached, as each API's body carries them into a
GenerateRequest (kvstream/api/cache_control.py): where the prefix ends, for how long, and
the marks gone from what reaches a template or a runtime. The engine's side (the blocks
kept) is tests/hf/test_cache_retention.py and tests/kv/."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvstream.api import messages_format, responses_format
from kvstream.api.schemas import ChatCompletionRequest, CompletionRequest
from kvstream.types import CacheBreakpoint

EPHEMERAL = {"type": "ephemeral"}


def generate(body: dict):
    return ChatCompletionRequest.model_validate(body).to_generate("r")


def test_chat_marks_on_messages_parts_and_tools_end_at_their_message():
    request = generate({
        "messages": [{"role": "system", "content": "S", "cache_control": EPHEMERAL},
                     {"role": "user", "content": "first"},
                     {"role": "user", "content": [{"type": "text", "text": "u", "cache_control": EPHEMERAL | {"ttl": "1h"}}]}],
        "tools": [{"type": "function", "function": {"name": "f"}, "cache_control": EPHEMERAL}],
    })
    assert request.cache_breakpoints == (CacheBreakpoint(300.0, 0), CacheBreakpoint(300.0, 1), CacheBreakpoint(3600.0, 3))
    assert "cache_control" not in str(request.messages) and "cache_control" not in str(request.extra)
    assert request.messages[2]["content"] == [{"type": "text", "text": "u"}]
    assert request.extra["tools"] == [{"type": "function", "function": {"name": "f"}}]


def test_prompt_cache_retention_keeps_the_whole_prompt_a_day_and_goes_on_to_openai_runtimes():
    chat = generate({"messages": [{"role": "user", "content": "Hi"}], "prompt_cache_retention": "24h"})
    assert chat.cache_breakpoints == (CacheBreakpoint(86400.0),) and chat.extra["prompt_cache_retention"] == "24h"
    assert generate({"messages": [{"role": "user", "content": "Hi"}], "prompt_cache_retention": "in_memory"}).cache_breakpoints == ()
    assert CompletionRequest.model_validate({"prompt": "Hi", "prompt_cache_retention": "24h"}).to_generate("r").cache_breakpoints == \
        (CacheBreakpoint(86400.0),)
    responses = generate(responses_format.chat_body({"input": "Hi", "prompt_cache_retention": "24h"}))
    assert responses.cache_breakpoints == (CacheBreakpoint(86400.0),)
    assert generate({"messages": [{"role": "user", "content": "Hi"}]}).cache_breakpoints == ()


@pytest.mark.parametrize("body, says", [
    ({"prompt_cache_retention": "7d"}, "prompt_cache_retention"),
    ({"messages": [{"role": "user", "content": "x", "cache_control": {"type": "persistent"}}]}, "messages.0.cache_control"),
    ({"messages": [{"role": "user", "content": "x", "cache_control": EPHEMERAL | {"ttl": "2h"}}]}, "messages.0.cache_control.ttl"),
    ({"messages": [{"role": "user", "content": "x", "cache_control": "yes"}]}, "messages.0.cache_control"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "cache_control": {}}]}, "tools.0.cache_control"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": EPHEMERAL}] * 5}]},
     "A maximum of 4 blocks with cache_control may be provided. Found 5."),
])
def test_malformed_marks_are_refused_naming_them(body, says):
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}]} | body)
    assert says in str(error.value)


def test_anthropic_blocks_become_message_marks_counted_as_anthropic_counts_them():
    body = {"max_tokens": 5, "system": [{"type": "text", "text": "S", "cache_control": EPHEMERAL | {"ttl": "1h"}}],
            "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": EPHEMERAL}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": EPHEMERAL}]},
                         {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r", "cache_control": EPHEMERAL}]}]}
    request = generate(messages_format.chat_body(body))
    # system (1h), tools (the tools alone), the first user turn, the tool result's turn
    assert request.cache_breakpoints == (CacheBreakpoint(300.0, 0), CacheBreakpoint(3600.0, 1), CacheBreakpoint(300.0, 2),
                                         CacheBreakpoint(300.0, 4))
    assert "cache_control" not in str(request.messages) + str(request.extra)
    body["messages"][2]["content"] *= 3  # five marks in all
    with pytest.raises(messages_format.MessagesError, match="A maximum of 4 blocks"):
        messages_format.chat_body(body)
    with pytest.raises(messages_format.MessagesError, match=r"messages\.0\.content\.1\.cache_control\.ttl"):
        messages_format.chat_body(body | {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": EPHEMERAL | {"ttl": "1d"}}]}]})


@pytest.mark.parametrize("tools", [5, "x", {"name": "f"}, None])
def test_a_messages_body_whose_tools_are_not_a_list_is_a_400_not_a_crash(tools):
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tools": tools}
    if tools is None:
        assert "tools" not in messages_format.chat_body(body)
        return
    with pytest.raises(messages_format.MessagesError, match="tools: a list is required"):
        messages_format.chat_body(body)
