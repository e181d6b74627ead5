"""Clients asking for a prompt prefix to stay cached: read from a chat body.

Two spellings reach the chat route:

* ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` on a message, on one of its
  content parts, or on a tool: Anthropic's breakpoints as OpenAI-speaking gateways carry them
  (OpenRouter on content parts, LiteLLM on messages and tools too); the Messages API's own
  blocks are translated to it (messages_format.py). The prefix kept ends with the message
  that carries it (a part's message, whole; a tool's: the tools alone). Default ttl 5m;
  at most 4 in one request, as Anthropic has it.
* ``prompt_cache_retention: "24h"`` (OpenAI's field): the whole prompt for 24 hours;
  ``"in_memory"`` is the cache as it is.

Each becomes a CacheBreakpoint; only the in-process engine keeps them (kvstream/kv:
retained blocks). The ``cache_control`` keys are taken out of the messages and tools that go
on, since templates render tools as JSON.
"""

from __future__ import annotations

from typing import Any

from kvstream.types import CacheBreakpoint

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
RETENTION_SECONDS = {"in_memory": None, "24h": 86400.0}
MAX_BREAKPOINTS = 4


def ttl(value: Any, param: str) -> float:
    """Seconds a ``cache_control`` value asks for; ValueError naming ``param`` otherwise."""
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise ValueError(f"{param}: {{'type': 'ephemeral'}} (with an optional 'ttl' of '5m' or '1h') is required")
    seconds = TTL_SECONDS.get(value.get("ttl", "5m"))  # type: ignore[arg-type]
    if seconds is None:
        raise ValueError(f"{param}.ttl: '5m' or '1h'")
    return seconds


def too_many(count: int) -> str | None:
    """Anthropic's refusal of more than four breakpoints, or None."""
    return f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {count}." if count > MAX_BREAKPOINTS else None


def chat_breakpoints(messages: list[dict[str, Any]], tools: Any, retention: str | None) -> tuple[CacheBreakpoint, ...]:
    """The breakpoints a chat body asks for (its messages and tools as dicts); ValueError
    for a malformed one or too many."""
    found: list[CacheBreakpoint] = []
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and "cache_control" in tool:
            found.append(CacheBreakpoint(ttl(tool["cache_control"], f"tools.{i}.cache_control"), 0))
    for i, message in enumerate(messages):
        marks = [(f"messages.{i}.cache_control", message["cache_control"])] if "cache_control" in message else []
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and "cache_control" in part:
                marks.append((f"messages.{i}.content.{j}.cache_control", part["cache_control"]))
        found += [CacheBreakpoint(ttl(value, where), i + 1) for where, value in marks]
    if (refusal := too_many(len(found))) is not None:
        raise ValueError(refusal)
    seconds = RETENTION_SECONDS[retention] if retention is not None else None
    return (*found, CacheBreakpoint(seconds)) if seconds is not None else tuple(found)


def without_cache_control(messages: list[dict[str, Any]], tools: Any) -> tuple[list[dict[str, Any]], Any]:
    """Copies of ``messages`` and ``tools`` without their ``cache_control`` keys (the
    others are the same objects)."""

    def clean(entry: Any) -> Any:
        return {k: v for k, v in entry.items() if k != "cache_control"} if isinstance(entry, dict) and "cache_control" in entry else entry

    out = []
    for message in messages:
        message = clean(message)
        if isinstance(message.get("content"), list) and any(isinstance(p, dict) and "cache_control" in p for p in message["content"]):
            message = message | {"content": [clean(part) for part in message["content"]]}
        out.append(message)
    return out, [clean(tool) for tool in tools] if isinstance(tools, list) else tools
