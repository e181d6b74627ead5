"""Anthropic's Messages API (``POST /v1/messages``) in terms of a chat completion, both ways.

``chat_body`` turns a Messages body into the chat-completions body that says the same
(``system`` as the system message, content blocks as chat content, ``tool_use`` blocks as an
assistant's tool calls and ``tool_result`` blocks as tool messages, ``tools`` with their
``input_schema``, ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none``, ``stop_sequences``,
``thinking`` as the template's ``enable_thinking`` switch (its ``budget_tokens`` as
``thinking_token_budget``), ``output_config.format`` as structured output), so that it is
validated and served on the one request path the chat route uses. ``MessageAnswer`` turns the tokens that come back
into Anthropic's message: content blocks (``thinking``, ``text``, ``tool_use``), ``stop_reason``,
``usage``, and, streamed, its events (``message_start``, ``content_block_start`` /
``_delta`` / ``_stop``, ``message_delta``, ``message_stop``).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from kvstream.api.cache_control import too_many, ttl
from kvstream.api.errors import APIError
from kvstream.api.schemas import is_prefill
from kvstream.types import Token, Usage

# A chat field named in an error -> the Messages field the client sent.
PARAMS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "stop": "stop_sequences"}
# Anthropic's error type for each status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class MessagesError(APIError):
    """An error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def messages_error(error: APIError) -> MessagesError:
    """Any APIError as Anthropic's (its ``param`` renamed to the Messages field)."""
    if isinstance(error, MessagesError):
        return error
    param = error.param
    if param is not None:
        head, _, rest = param.partition(".")
        param = PARAMS.get(head, head) + (f".{rest}" if rest else "")
    return MessagesError(error.status, error.message, code=error.code, param=param, retry_after=error.retry_after)


def _invalid(message: str, param: str) -> MessagesError:
    return MessagesError(400, message, param=param, code="invalid_value")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body that asks what the Messages body ``body`` asks;
    MessagesError (400) for what cannot be said so."""
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool) or body["max_tokens"] < 1:
        raise _invalid("max_tokens: a positive integer is required.", "max_tokens")
    messages: list[dict[str, Any]] = []
    marks = 0  # cache_control breakpoints, counted as Anthropic counts them (blocks)
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _text(system, "system")})
        for mark in _cache_marks(system, "system"):
            messages[-1]["cache_control"], marks = mark, marks + 1
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _invalid("messages: a non-empty list is required.", "messages")
    for i, message in enumerate(raw):
        messages += _message(message, i)
        for mark in _cache_marks(message.get("content"), f"messages.{i}.content"):
            if messages:  # the prefix kept ends with this message's last chat message
                messages[-1]["cache_control"] = mark
            marks += 1
    tools = body.get("tools")
    marks += len(_cache_marks(tools, "tools"))  # (a tools value that is not a list is _tools' 400)
    if (refusal := too_many(marks)) is not None:
        raise _invalid(refusal, "cache_control")
    chat: dict[str, Any] = {"messages": messages, "max_completion_tokens": body["max_tokens"]}
    if is_prefill(messages):  # the answer continues the assistant's text (Anthropic's prefill), as vLLM is told
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    for key in ("model", "temperature", "top_p", "top_k", "stream"):
        if key in body:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        chat.update(_tool_choice(choice))
    output = body.get("output_config")
    if output is not None:  # structured output: {"format": {"type": "json_schema", "schema": ...}}
        fmt = output.get("format") if isinstance(output, dict) else None
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise _invalid("output_config.format: {'type': 'json_schema', 'schema': {...}} is required.", "output_config.format")
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise _invalid("thinking.type: 'enabled', 'disabled' or 'adaptive'.", "thinking.type")
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
        budget = thinking.get("budget_tokens")
        if thinking["type"] == "enabled" and budget is not None:
            max_tokens = body.get("max_tokens")
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1 or (
                    isinstance(max_tokens, int) and budget >= max_tokens):
                raise _invalid("thinking.budget_tokens: a count of tokens, at least 1 and less than max_tokens.",
                               "thinking.budget_tokens")
            chat["thinking_token_budget"] = budget  # the in-process engine holds the thinking to it
    return chat


def _cache_marks(blocks: Any, param: str, offset: int = 0) -> list[dict[str, Any]]:
    """The ``cache_control`` values of ``blocks`` (a list of content blocks, or anything
    else: none), checked and in the chat body's form."""
    marks = []
    for j, block in enumerate(blocks if isinstance(blocks, list) else []):
        if isinstance(block, dict) and "cache_control" in block:
            where = f"{param}.{j + offset}.cache_control"
            try:
                ttl(block["cache_control"], where)
            except ValueError as exc:
                raise _invalid(f"{exc}.", where) from None
            marks.append({"type": "ephemeral", "ttl": block["cache_control"].get("ttl", "5m")})
    return marks


def _text(value: Any, param: str) -> str:
    """A system prompt or tool result: a string, or text blocks joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
                                       for b in value):
        return "\n".join(block["text"] for block in value)
    raise _invalid(f"{param}: a string or a list of text blocks is required.", param)


def _message(message: Any, i: int) -> list[dict[str, Any]]:
    """One Messages message as chat messages: a user turn's tool results come first, as
    tool messages (each answers the call before it), then its other content."""
    param = f"messages.{i}"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise _invalid(f"{param}.role: 'user' or 'assistant' is required.", f"{param}.role")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _invalid(f"{param}.content: a string or a list of content blocks is required.", f"{param}.content")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"{param}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and isinstance(block.get("source"), dict):
            source = block["source"]
            url = source.get("url") if source.get("type") == "url" else f"data:{source.get('media_type')};base64,{source.get('data')}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("id"), str) and isinstance(block.get("name"), str):
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": _text(block.get("content") or "", f"{where}.content")})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # an earlier answer's thinking: templates drop it from the history
        else:
            raise _invalid(f"{where}.type: {kind!r} blocks are not supported here.", f"{where}.type")
    out: list[dict[str, Any]] = results
    if role == "assistant" and calls:
        text = "".join(part.get("text", "") for part in parts)
        out.append({"role": "assistant", "content": text or None, "tool_calls": calls})
    elif parts:
        text_only = all(part["type"] == "text" for part in parts)
        out.append({"role": role, "content": "\n".join(p["text"] for p in parts) if text_only else parts})
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _invalid("tools: a list is required.", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
            raise _invalid(f"tools.{i}: only custom tools (name, input_schema) are supported here.", f"tools.{i}")
        # (In OpenAI's order: templates render the tool as JSON, keys in the order given.)
        function = {"name": tool["name"]} | ({"description": tool["description"]} if isinstance(tool.get("description"), str) else {})
        out.append({"type": "function", "function": function | {"parameters": tool.get("input_schema") or {"type": "object"}}}
                   | {"cache_control": mark for mark in _cache_marks([tool], "tools", offset=i)})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    out: dict[str, Any] = {}
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise _invalid("tool_choice.type: 'auto', 'any', 'tool' (with a name) or 'none'.", "tool_choice.type")
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


class MessageAnswer:
    """One message built from the tokens of its generation: content blocks in the order they
    are written (thinking, text, tool uses), each started and stopped in turn, and the
    streamed events that say so."""

    def __init__(self, model: str) -> None:
        self.id = "msg_" + secrets.token_hex(12)
        self.model = model
        self.content: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the block being written
        self._arguments: dict[int, str] = {}  # a tool use's input as JSON text, by block index

    def started(self, prompt_tokens: int) -> list[dict[str, Any]]:
        """The events before the first token (the prompt's size known, its cached share not yet:
        the last event has both)."""
        return [{"type": "message_start", "message": self.message(None, Usage(prompt_tokens, 0))}]

    def error_event(self, error: APIError) -> dict[str, Any]:
        """The event that ends a stream the runtime failed."""
        return messages_error(error).body()

    def add(self, token: Token) -> list[dict[str, Any]]:
        """The events one token makes."""
        delta = token.chat_delta()
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            events += self._write("thinking", "thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._write("text", "text", delta["content"])
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id") is not None:
                events += self._close()
                events += self._begin({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                                       "name": function.get("name") or "", "input": {}})
                self._arguments[len(self.content) - 1] = ""
            if function.get("arguments") and self._open is not None and self._open["type"] == "tool_use":
                index = len(self.content) - 1
                self._arguments[index] += function["arguments"]
                events.append({"type": "content_block_delta", "index": index,
                               "delta": {"type": "input_json_delta", "partial_json": function["arguments"]}})
        return events

    def finish(self, last: Token, usage: Usage | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The whole message and the events that end the stream (``last``: the stream's last
        token: why it ended, and the stop sequence that ended it where the backend says)."""
        events = self._close()
        for index, text in self._arguments.items():
            self.content[index]["input"] = _input(text)
        reason = "stop_sequence" if last.stop_sequence is not None else STOP_REASONS.get(last.finish_reason or "", "end_turn")
        message = self.message(reason, usage, last.stop_sequence)
        events.append({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": last.stop_sequence},
                       "usage": message["usage"]})
        events.append({"type": "message_stop"})
        return message, events

    def message(self, stop_reason: str | None, usage: Usage | None, stop_sequence: str | None = None) -> dict[str, Any]:
        # Anthropic's split: read from the cache, written to it (a marked prefix computed
        # now), and the rest; the three add up to the prompt.
        cached = (usage.cached_tokens or 0) if usage else 0
        written = (usage.cache_write_tokens or 0) if usage else 0
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [dict(block) for block in self.content], "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": (usage.prompt_tokens - cached - written) if usage else 0,
                      "output_tokens": usage.completion_tokens if usage else 0,
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": written},
        }

    def _write(self, kind: str, field: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._begin({"type": kind, field: ""} | ({"signature": ""} if kind == "thinking" else {}))
        assert self._open is not None
        self._open[field] += text
        events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                       "delta": {"type": f"{kind}_delta", field: text}})
        return events

    def _begin(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.content.append(block)
        self._open = block
        return [{"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]


def _input(arguments: str) -> Any:
    """A tool use's input: the call's JSON arguments as an object (as far as they parse)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
