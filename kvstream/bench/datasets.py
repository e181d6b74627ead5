"""Workloads: seeded and reproducible lists of chat requests (or conversations)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# Short common words: about 1.3 tokens each for typical BPE tokenizers.
_WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by word but what some we can "
    "out other were all there when up use your how said an each she which do their time if will way about many then "
    "them write would like so these her long make thing see him two has look more day could go come did number sound "
    "no most people my over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give our under name very"
).split()
WORDS_PER_TOKEN = 0.75


@dataclass
class BenchRequest:
    """One request of a workload; multi-turn turns are filled in as the replay runs."""

    messages: list[dict[str, Any]]
    max_tokens: int
    conversation: int | None = None
    turn: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Conversation:
    """A multi-turn replay: the system prompt and the user turns; replies come from the server."""

    system: str
    user_turns: list[str]
    max_tokens: int


def words(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, int(tokens * WORDS_PER_TOKEN))))


def random_dataset(n: int, prompt_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Independent prompts of about ``prompt_len`` tokens."""
    rng = random.Random(seed)
    return [BenchRequest([{"role": "user", "content": words(rng, prompt_len)}], output_len) for _ in range(n)]


def prefix_repetition_dataset(n: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """``num_prefixes`` shared prefixes of ``prefix_len`` tokens, each request one of them
    plus its own suffix (what apps with a system prompt send)."""
    rng = random.Random(seed)
    prefixes = [words(rng, prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(n):
        prefix = prefixes[i % num_prefixes]
        out.append(BenchRequest([{"role": "system", "content": prefix}, {"role": "user", "content": words(rng, suffix_len)}], output_len))
    rng.shuffle(out)
    return out


def multi_turn_dataset(conversations: int, turns: int, system_len: int, turn_len: int, output_len: int, seed: int) -> list[Conversation]:
    """Chat sessions whose history grows every turn (the server's replies are replayed)."""
    rng = random.Random(seed)
    return [Conversation(words(rng, system_len), [words(rng, turn_len) for _ in range(turns)], output_len) for _ in range(conversations)]


def file_dataset(path: Path, n: int | None, output_len: int) -> list[BenchRequest]:
    """A JSONL file of OpenAI request bodies ({"messages": ...} or {"prompt": ...}) or
    ShareGPT conversations ({"conversations": [{"from": "human", "value": ...}, ...]})."""
    out = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}:{line_no}: not JSON") from None
        if "messages" in obj:
            messages = obj["messages"]
        elif "prompt" in obj:
            messages = [{"role": "user", "content": obj["prompt"]}]
        elif "conversations" in obj:
            human = [t.get("value", "") for t in obj["conversations"] if t.get("from") in ("human", "user")]
            if not human:
                continue
            messages = [{"role": "user", "content": human[0]}]
        else:
            raise ValueError(f"{path}:{line_no}: expected messages, prompt or conversations")
        out.append(BenchRequest(messages, int(obj.get("max_tokens") or output_len)))
        if n is not None and len(out) >= n:
            break
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def marked(items: list[BenchRequest] | list[Conversation], marker: str) -> list[BenchRequest] | list[Conversation]:
    """A copy of a workload in which every prompt opens with ``marker`` (the first message of
    a request, the system prompt of a conversation). Two servers compared in front of one
    runtime each get their own marker, so that neither finds the other's prompts in the
    runtime's cache: the second would otherwise be served the prefixes the first computed.
    Markers of equal length keep the two copies the same size in tokens."""
    out: list = []
    for item in items:
        if isinstance(item, Conversation):
            out.append(replace(item, system=marker + item.system, user_turns=list(item.user_turns)))
            continue
        messages = [dict(m) for m in item.messages]
        if messages:
            first = messages[0]
            content = first.get("content")
            if isinstance(content, list):  # content parts: a text part goes first
                first["content"] = [{"type": "text", "text": marker}, *content]
            else:
                first["content"] = marker + (content or "")
        out.append(replace(item, messages=messages, extra=dict(item.extra)))
    return out
