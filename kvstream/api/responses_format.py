"""OpenAI's Responses API (``POST /v1/responses``) in terms of a chat completion, both ways.

``chat_body`` turns a Responses body into the chat-completions body that says the same
(``input`` items as messages, ``instructions`` as the system message, function tools and
``tool_choice`` in chat's shape, ``text.format`` as ``response_format``,
``max_output_tokens`` as ``max_completion_tokens``), so that it is validated and served on the
one request path the chat route uses. ``ResponseAnswer`` turns the tokens that come back into
the Responses objects: output items (``reasoning``, a ``message`` with ``output_text``,
``function_call`` items) and, streamed, the typed events OpenAI sends
(``response.created`` ... ``response.completed``), each with its ``sequence_number``.

``continuation`` and ``stored_items`` are what a stored response needs (response_store.py):
the input a ``previous_response_id`` continues with, and the request's own input as the items
OpenAI lists for it (a ``conversation``'s items are read the same way). A ``background``
response is driven by background.py, with this answer's events.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from kvstream.api.errors import APIError
from kvstream.types import Token, Usage

# Request fields the response object repeats as the client sent them (or their defaults).
ECHOED = {"background": False, "truncation": "disabled", "previous_response_id": None, "conversation": None, "store": True, "instructions": None, "max_output_tokens": None, "metadata": {},
          "parallel_tool_calls": True, "temperature": None, "top_p": None, "tool_choice": "auto", "tools": [], "reasoning": None,
          "text": {"format": {"type": "text"}}, "user": None}
# Fields that change nothing about the answer here: accepted and not forwarded.
IGNORED = {"store", "include", "metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier",
           "truncation", "stream_options", "max_tool_calls", "top_logprobs", "reasoning", "text", "input",
           "instructions", "max_output_tokens", "tools", "tool_choice",
           "previous_response_id", "conversation", "background"}
# A chat field named in an error -> the Responses field the client sent.
PARAMS = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def _invalid(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def response_param(chat_param: str | None) -> str | None:
    """The Responses field a chat field in an error stands for."""
    if chat_param is None:
        return None
    head, _, rest = chat_param.partition(".")
    return PARAMS.get(head, head) + (f".{rest}" if rest else "")


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body that asks what the Responses body ``body`` asks; APIError
    (400, naming the Responses field) for what cannot be said so."""
    if body.get("prompt") is not None:
        raise _invalid("'prompt' (a stored prompt template) is not supported here: send its text as 'instructions' or "
                       "'input'.", "prompt")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise _invalid("Invalid value for 'truncation': 'auto' or 'disabled'.", "truncation")
    if body.get("background") not in (None, True, False):
        raise _invalid("Invalid type for 'background': expected a boolean.", "background")
    for field in ("text", "reasoning"):
        if body.get(field) is not None and not isinstance(body[field], dict):
            raise _invalid(f"Invalid type for '{field}': expected an object.", field)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _invalid("Invalid type for 'instructions': expected a string.", "instructions")
        messages.append({"role": "system", "content": instructions})
    messages += _messages(body.get("input"))
    chat: dict[str, Any] = {key: value for key, value in body.items() if key not in IGNORED}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text_format = (body.get("text") or {}).get("format")
    if text_format is not None:
        chat["response_format"] = _response_format(text_format)
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.get("top_logprobs") is not None:
        chat["logprobs"], chat["top_logprobs"] = True, body["top_logprobs"]
    return chat


def continuation(body: dict[str, Any], conversation: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """``body`` continuing ``conversation`` (the stored items of the response it names as
    ``previous_response_id``): its input after them. Its own input is checked first, so that
    an error names the item the client sent."""
    _messages(body.get("input"))
    own = body["input"]
    return body | {"input": [*conversation, *([{"role": "user", "content": own}] if isinstance(own, str) else own)]}


def stored_items(items: str | list[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """A request's ``input`` (already checked by ``chat_body``) as the items OpenAI stores
    and lists for it: each with an ``id`` and a ``status``, a message's text as typed parts."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    stored = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            if isinstance(content, str):
                content = [{"type": "output_text" if item["role"] == "assistant" else "input_text", "text": content}]
            item = {key: item[key] for key in ("id",) if isinstance(item.get(key), str)} | {
                "type": "message", "role": item["role"], "content": content}
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[kind]
        stored.append({"id": _id(prefix), "status": "completed"} | item)
    return tuple(stored)


def _messages(items: Any) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of items) as chat messages: consecutive function calls
    become one assistant message's tool_calls, their outputs tool messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _invalid("'input' must be a string or a non-empty list of input items.", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _invalid(f"Invalid value for 'input[{i}]': expected an object.", f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _invalid(f"Invalid value for 'input[{i}].role': {role!r}.", f"input[{i}].role")
            messages.append({"role": role, "content": _content(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": _text_field(item, "call_id", i), "type": "function",
                    "function": {"name": _text_field(item, "name", i), "arguments": _text_field(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content(output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", i), "content": text})
        elif kind == "reasoning":
            continue  # an earlier answer's thinking: templates drop it from the history
        else:
            raise _invalid(f"Invalid value for 'input[{i}].type': {kind!r} items are not supported here.", f"input[{i}].type")
    return messages


def _text_field(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _invalid(f"Invalid value for 'input[{i}].{key}': expected a string.", f"input[{i}].{key}")
    return value


def _content(content: Any, param: str) -> Any:
    """A message's content: a string, or its parts in chat's shape (text and images)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(f"Invalid value for '{param}': expected a string or a list of content parts.", param)
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise _invalid(f"Invalid value for '{param}': content parts of type {kind!r} are not supported here.", param)
    return parts


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _invalid("'tools' must be a list.", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _invalid(f"Invalid type for 'tools[{i}]': expected an object.", f"tools[{i}]")
        if tool.get("type") != "function":
            kind = tool.get("type")
            raise _invalid(f"Invalid value for 'tools[{i}].type': {kind!r} tools are not supported here (function tools are).",
                           f"tools[{i}].type")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _invalid("Invalid value for 'tool_choice': 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}.",
                   "tool_choice")


def _response_format(text_format: Any) -> dict[str, Any]:
    kind = text_format.get("type") if isinstance(text_format, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        schema = {key: text_format[key] for key in ("name", "schema", "strict", "description") if key in text_format}
        return {"type": "json_schema", "json_schema": schema}
    raise _invalid("Invalid value for 'text.format.type': 'text', 'json_object' or 'json_schema'.", "text.format.type")


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponseAnswer:
    """One response built from the tokens of its generation: output items in the order they
    are written (thinking, text, calls), each opened and closed in turn, and the streamed
    events that say so."""

    def __init__(self, body: dict[str, Any], model: str) -> None:
        self.id = _id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.echo = {key: body.get(key, default) if body.get(key) is not None else default for key, default in ECHOED.items()}
        self.output: list[dict[str, Any]] = []
        self.reasoning_tokens = 0  # thinking pieces sent
        self._open: dict[str, Any] | None = None  # the item being written
        self._sequence = 0
        self._announced = False  # response.created sent

    # ------------------------------------------------------------------ events
    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def queued(self) -> list[dict[str, Any]]:
        """The events of a background response created and waiting for its turn."""
        self._announced = True
        snapshot = self.response("queued")
        return [self.event("response.created", response=snapshot), self.event("response.queued", response=snapshot)]

    def started(self, prompt_tokens: int) -> list[dict[str, Any]]:
        """The events before the first token (``response.created`` unless ``queued`` said it)."""
        snapshot = self.response("in_progress")
        created = [] if self._announced else [self.event("response.created", response=snapshot)]
        return created + [self.event("response.in_progress", response=snapshot)]

    def add(self, token: Token) -> list[dict[str, Any]]:
        """The events one token makes (a report of the prompt's progress: llama-server's
        ``response.in_progress`` carrying it)."""
        if token.progress is not None:
            return [self.event("response.in_progress", response=self.response("in_progress"),
                               prompt_progress=token.progress.as_json())]
        delta = token.chat_delta()
        events: list[dict[str, Any]] = []
        if delta.get("reasoning_content"):
            self.reasoning_tokens += 1
            events += self._write("reasoning", delta["reasoning_content"])
        text = delta.get("content")
        if text or (token.token_logprobs and text is not None):
            events += self._write("message", text or "", token.token_logprobs)
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("id") is not None:  # a new call
                events += self._close("completed")
                events += self._begin({"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                                       "name": function.get("name") or "", "arguments": "", "status": "in_progress"})
            if function.get("arguments") and self._open is not None and self._open["type"] == "function_call":
                self._open["arguments"] += function["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                         output_index=len(self.output) - 1, delta=function["arguments"]))
        return events

    def error_event(self, error: APIError) -> dict[str, Any]:
        """The event that ends a stream the runtime failed."""
        return self.event("error", code=error.code, message=error.message, param=error.param)

    def finish(self, last: Token, usage: Usage | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The whole response and the events that end the stream (``last``: the stream's last token)."""
        incomplete = last.finish_reason == "length"
        events = self._close("incomplete" if incomplete else "completed")
        response = self.response("incomplete" if incomplete else "completed", usage)
        events.append(self.event("response.incomplete" if incomplete else "response.completed", response=response))
        return response, events

    def response(self, status: str, usage: Usage | None = None) -> dict[str, Any]:
        """The response object as it stands."""
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model, "output": [dict(item) for item in self.output], **self.echo,
        }
        if usage is not None:
            out["usage"] = {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens or 0},
                "output_tokens": usage.completion_tokens,
                # The backend's count where it has one (the engine counts thinking tokens);
                # else the thinking pieces that went out, one per token from Ollama.
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens if usage.reasoning_tokens is None
                                          else usage.reasoning_tokens},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            }
        return out

    # ------------------------------------------------------------------ items
    def _write(self, kind: str, text: str, logprobs: list[Any] | None = None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            if kind == "reasoning":
                events += self._begin({"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"},
                                      part={"type": "reasoning_text", "text": ""})
            else:
                events += self._begin({"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                                       "content": []}, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        item = self._open
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "reasoning":
            events.append(self.event("response.reasoning_text.delta", **where, delta=text))
        else:
            entries = [_logprob(entry) for entry in logprobs or ()]
            part["logprobs"] += entries
            events.append(self.event("response.output_text.delta", **where, delta=text, logprobs=entries))
        return events

    def _begin(self, item: dict[str, Any], part: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        events = [self.event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))]
        if part is not None:
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                                     content_index=0, part=dict(part)))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
            else:
                events.append(self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                         logprobs=part["logprobs"]))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=dict(part)))
        events.append(self.event("response.output_item.done", output_index=len(self.output) - 1, item=_copy(item)))
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": [dict(part) for part in item["content"]]} if "content" in item else dict(item)


def _logprob(entry: Any) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": entry.bytes,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in entry.top]}
