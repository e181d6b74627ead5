"""Sending the workload: closed loop or Poisson arrivals, streaming or not, measured per request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvstream.bench.datasets import BenchRequest, Conversation
from kvstream.bench.metrics import RequestResult


@dataclass
class Target:
    """Where to send: base URL (without /v1), model, and an optional API key."""

    url: str
    model: str
    api_key: str | None = None
    stream: bool = True
    timeout: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)


async def discover_model(url: str, api_key: str | None) -> str:
    """The first model the server lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]


def _header_float(headers: Any, name: str) -> float | None:
    try:
        return float(headers[name]) if name in headers else None
    except ValueError:
        return None


@contextlib.asynccontextmanager
async def _post_once_more_if_stale(session: aiohttp.ClientSession, url: str, body: dict, timeout: float):
    """POST; a pooled keep-alive connection the server already closed (llama-server does
    this) fails before any byte comes back, and is retried once, as a real client would."""
    for attempt in (0, 1):
        try:
            resp = await session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout))
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            if attempt:
                raise
            continue
        async with resp:
            yield resp
        return


async def send(session: aiohttp.ClientSession, target: Target, req: BenchRequest) -> tuple[RequestResult, str]:
    """One chat request; returns its measurements and the reply text."""
    body = {"model": target.model, "messages": req.messages, "max_tokens": req.max_tokens, "stream": target.stream, **target.extra_body, **req.extra}
    if target.stream:
        body["stream_options"] = {"include_usage": True}
    result = RequestResult(success=False, turn=req.turn, started=time.perf_counter())
    text: list[str] = []
    start = result.started
    last = None
    try:
        async with _post_once_more_if_stale(session, target.url.rstrip("/") + "/v1/chat/completions", body, target.timeout) as resp:
            result.status = resp.status
            result.queue_ms = _header_float(resp.headers, "X-KVStream-Queue-Ms")
            hits = _header_float(resp.headers, "X-KVStream-Prefix-Hit-Tokens")
            result.prefix_hit_tokens = int(hits) if hits is not None else None
            if resp.status != 200:
                result.error = f"http {resp.status}: {(await resp.text())[:200]}"
                return result, ""
            usage = None
            if target.stream:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.error = f"stream_error: {event['error'].get('message', '')}"[:200]
                        return result, ""
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            now = time.perf_counter()
                            if result.ttft is None:
                                result.ttft = now - start
                            else:
                                result.itl.append(now - last)
                            last = now
                            text.append(content)
            else:
                payload = await resp.json()
                usage = payload.get("usage")
                text.append(payload["choices"][0]["message"].get("content") or "")
                result.ttft = time.perf_counter() - start  # without streaming, the whole answer
            result.latency = time.perf_counter() - start
            if usage:
                result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                result.output_tokens = int(usage.get("completion_tokens") or 0)
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            else:
                result.output_tokens = len(text)  # one chunk per token when usage is missing
            result.success = True
    except asyncio.TimeoutError:
        result.error = "timeout"
    except aiohttp.ClientError as exc:
        result.error = f"connection: {exc.__class__.__name__}"
    except ValueError as exc:
        result.error = f"malformed: {exc}"
    result.latency = result.latency or (time.perf_counter() - start)
    return result, "".join(text)


@dataclass
class Load:
    """How to send: concurrency, optional Poisson rate, and a stop rule."""

    concurrency: int = 8
    request_rate: float | None = None  # requests/s (Poisson); None = closed loop
    total_requests: int | None = None
    duration: float | None = None
    seed: int = 0


async def run_requests(target: Target, requests: list[BenchRequest], load: Load, results: list[RequestResult],
                       on_done: Callable[[RequestResult], None] = lambda r: None) -> float:
    """Send ``requests`` (cycled when a duration is given); results are appended as they
    finish, so a caller interrupted midway still has them. Returns the wall-clock duration."""
    rng = random.Random(load.seed)
    semaphore = asyncio.Semaphore(load.concurrency)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    start = time.perf_counter()
    total = load.total_requests if load.total_requests is not None else (None if load.duration else len(requests))

    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(req: BenchRequest) -> None:
            try:
                result, _ = await send(session, target, req)
                results.append(result)
                on_done(result)
            finally:
                semaphore.release()

        tasks: set[asyncio.Task] = set()
        i = 0
        try:
            while total is None or i < total:
                if load.duration is not None and time.perf_counter() - start >= load.duration:
                    break
                await semaphore.acquire()
                task = asyncio.create_task(one(requests[i % len(requests)]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                if load.request_rate:
                    await asyncio.sleep(rng.expovariate(load.request_rate))
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
    return time.perf_counter() - start


async def run_conversations(target: Target, conversations: list[Conversation], load: Load, results: list[RequestResult],
                            on_done: Callable[[RequestResult], None] = lambda r: None) -> float:
    """Replay chat sessions: each turn sends the whole history plus the new user turn."""
    semaphore = asyncio.Semaphore(load.concurrency)
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    start = time.perf_counter()
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def replay(index: int, conv: Conversation) -> None:
            async with semaphore:
                history: list[dict[str, Any]] = [{"role": "system", "content": conv.system}]
                for turn, user in enumerate(conv.user_turns):
                    history.append({"role": "user", "content": user})
                    result, reply = await send(session, target, BenchRequest(list(history), conv.max_tokens, index, turn))
                    results.append(result)
                    on_done(result)
                    if not result.success:
                        return
                    history.append({"role": "assistant", "content": reply})

        await asyncio.gather(*(replay(i, c) for i, c in enumerate(conversations)))
    return time.perf_counter() - start
