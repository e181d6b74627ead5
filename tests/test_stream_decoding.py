"""The upstream stream decoder (EventReader), burst marking, the lock-free metrics and the
model alias map: the pieces of the proxy's hot path, checked against their slow equivalents."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvstream.api.routes_openai import model_aliases
from kvstream.types import BackendError, ModelInfo, Token, as_burst
from kvstream.backends.http import DONE, EventReader, decode_ndjson_line
from kvstream.metrics import LocalCounter, LocalHistogram


class Chunks:
    """A response whose body arrives in the given pieces (what readany() returns)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.content = self
        self._pieces = list(pieces)

    async def readany(self) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)]) if data[a:b]]


async def read_all(reader: EventReader) -> list:
    events = []
    while batch := await reader.read():
        events.extend(batch)
    return events


SSE = b"".join(
    [b": keep-alive\n\n", b"event: message\n"]
    + [b"data: " + json.dumps({"choices": [{"delta": {"content": f"t\xe9{i} \\n"}}]}).encode() + b"\r\n\r\n" for i in range(6)]
    + [b"data: [DONE]\n\n", b"data: {\"after\": \"done is never read\"}\n\n"]
)
EXPECTED = [{"choices": [{"delta": {"content": f"t\xe9{i} \\n"}}]} for i in range(6)] + [DONE]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
async def test_any_chunking_gives_the_same_events(cuts):
    assert await read_all(EventReader(Chunks(split(SSE, cuts)))) == EXPECTED  # type: ignore[arg-type]


async def test_a_burst_in_one_read_is_one_batch_and_stops_at_done():
    reader = EventReader(Chunks([SSE]))  # type: ignore[arg-type]
    assert await reader.read() == EXPECTED
    assert reader.ended and await reader.read() == []


async def test_events_before_a_failure_are_delivered_before_it_raises():
    body = b'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\ndata: {"error": {"message": "boom"}}\n\n'
    reader = EventReader(Chunks([body]))  # type: ignore[arg-type]
    assert await reader.read() == [{"choices": [{"delta": {"content": "Hi"}}]}]
    with pytest.raises(BackendError, match="boom"):
        await reader.read()


async def test_malformed_event_and_ndjson_last_line_without_newline():
    with pytest.raises(BackendError, match="malformed"):
        await read_all(EventReader(Chunks([b"data: {nope\n\n"])))  # type: ignore[arg-type]
    ndjson = b'{"response": "a"}\n\n{"response": "b", "done": true}'  # no final newline
    events = await read_all(EventReader(Chunks([ndjson[:7], ndjson[7:]]), decode_ndjson_line))  # type: ignore[arg-type]
    assert events == [{"response": "a"}, {"response": "b", "done": True}]


def test_as_burst_marks_all_but_the_last():
    tokens = as_burst([Token(text="a"), Token(text="b"), Token(text="c")])
    assert [t.more for t in tokens] == [True, True, False]
    assert as_burst([]) == []


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=200, allow_nan=False), max_size=60))
def test_local_histogram_exports_what_prometheus_client_would(values):
    buckets = (0.005, 0.01, 0.025, 0.5, 1.0, 30.0, 120.0)
    ours, registry = LocalHistogram("x_seconds", "doc", buckets), CollectorRegistry()
    reference = Histogram("x_seconds", "doc", buckets=buckets, registry=registry)
    for v in values + list(buckets):  # the bounds themselves fall in their own bucket ("le")
        ours.observe(v)
        reference.observe(v)
    mine = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in ours.family().samples}
    theirs = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in next(iter(registry.collect())).samples
        if not s.name.endswith("_created")
    }
    assert mine.keys() == theirs.keys()
    assert all(mine[k] == pytest.approx(theirs[k]) for k in mine)
    assert generate_latest(registry)  # the reference really rendered


def test_local_counter_counts_per_label_set():
    counter = LocalCounter("kvstream_requests", "doc", ["route", "code"])
    for _ in range(3):
        counter.inc("chat", "200")
    counter.inc("chat", "502")
    samples = {tuple(s.labels.values()): s.value for s in counter.family().samples}
    assert samples == {("chat", "200"): 3, ("chat", "502"): 1}


def test_model_aliases_prefer_exact_ids_over_file_names():
    models = [ModelInfo(id="/models/qwen.gguf"), ModelInfo(id="qwen"), ModelInfo(id="llama-3.gguf")]
    aliases = model_aliases(models)
    assert aliases["qwen"] == "qwen"  # an exact id, although it is also the first one's stem
    assert aliases["qwen.gguf"] == "/models/qwen.gguf"
    assert aliases["llama-3"] == aliases["llama-3.gguf"] == "llama-3.gguf"
    assert "nope" not in aliases
    # Ollama's names: no tag is ":latest" (as Ollama takes it); a dot in a name is no extension.
    ollama = model_aliases([ModelInfo(id="llama3.2:latest"), ModelInfo(id="qwen2.5:7b")])
    assert ollama["llama3.2"] == "llama3.2:latest" and "llama3" not in ollama and "qwen2" not in ollama
    assert "qwen2.5" not in ollama  # only :latest is the default tag
    # ...and apps written for Ollama add it to a name that has no tag (LM Studio's, a GGUF's)
    assert aliases["qwen:latest"] == "qwen" and aliases["llama-3:latest"] == "llama-3.gguf"
    assert "qwen2.5:7b:latest" not in ollama and "llama3.2:latest:latest" not in ollama


def test_dumps_takes_what_orjson_refuses():
    from kvstream.jsonfast import dumps

    assert json.loads(dumps({"seed": 2**70, "text": "é"})) == {"seed": 2**70, "text": "é"}


def test_nesting_past_1024_levels_is_refused_whatever_the_recursion_limit():
    """The stdlib's depth limit follows sys.getrecursionlimit(), which torch.compile raises in
    the process (the in-process engine compiles its attention kernel): the rule must not."""
    import sys

    import pytest

    from kvstream.jsonfast import loads

    deep = b'{"x": ' + b"[" * 1100 + b"]" * 1100 + b"}"
    limit = sys.getrecursionlimit()
    try:
        for raised in (limit, 100_000):
            sys.setrecursionlimit(raised)
            with pytest.raises(ValueError, match="nested too deeply"):
                loads(deep)
    finally:
        sys.setrecursionlimit(limit)
    shallow = loads(b'{"x": ' + b"[" * 1000 + b"]" * 1000 + b"}")
    assert isinstance(shallow["x"], list)
