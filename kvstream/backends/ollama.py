"""Ollama through its native API: /api/chat and /api/generate (NDJSON), /api/tags, /api/ps.

The native routes are used rather than Ollama's /v1 layer because only they accept
``num_ctx``, ``keep_alive``, ``num_predict``, ``seed`` and ``stop`` as options, and report
``done_reason`` and token counts (protocols.md section 2.10).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import urllib.parse
from datetime import datetime, timezone
from collections.abc import AsyncIterator
from typing import Any

from kvstream.config import Settings
from kvstream.backends.base import BaseBackend
from kvstream.types import BackendError, GenerateRequest, ModelInfo, RuntimeLimits, Token, Usage
from kvstream.backends.gguf_tokenizer import GGUFTokenizer
from kvstream.backends.http import EventReader, UpstreamSession, cors_grant, decode_ndjson_line, raise_for_upstream_status
from kvstream.backends.openai_compat import logprobs_from

logger = logging.getLogger(__name__)

# A load_duration above this means Ollama (re)loaded the model for this request, so its
# prompt caches started empty (a model already loaded reports a few milliseconds).
RELOAD_S = 0.25
# Keeping the model (and its prompt caches) loaded while traffic flows: how often the lease
# is checked, how close to expiry it is renewed, and for how long it is.
KEEP_ALIVE_CHECK_S = 30.0
RENEW_WITHIN_S = 90.0
RENEWAL = "5m"

# OpenAI fields with an Ollama option of another name.
_OPTION_FIELDS = {
    "max_tokens": "num_predict",
    "max_completion_tokens": "num_predict",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "min_p": "min_p",
    "repeat_penalty": "repeat_penalty",
}


def _text_of(content: Any) -> tuple[str, list[str]]:
    """Ollama wants a plain string plus base64 images; OpenAI content may be a list of parts."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    texts, images = [], []
    for part in content:
        if not isinstance(part, dict):
            continue
        if part.get("type") == "text":
            texts.append(part.get("text") or "")
        elif part.get("type") == "image_url":
            url = (part.get("image_url") or {}).get("url", "")
            if url.startswith("data:") and "," in url:
                images.append(url.split(",", 1)[1])
    return "".join(texts), images


def to_ollama_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as Ollama's: string content, images apart, tool call arguments as
    objects (OpenAI sends a JSON string), tool results named."""
    out = []
    for message in messages:
        text, images = _text_of(message.get("content"))
        role = "system" if message.get("role") == "developer" else message.get("role")
        converted: dict[str, Any] = {"role": role, "content": text}
        if images:
            converted["images"] = images
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function") or {})
                args = function.get("arguments")
                if isinstance(args, str):
                    try:
                        function["arguments"] = json.loads(args) if args else {}
                    except ValueError:
                        function["arguments"] = {}
                calls.append({"function": function})
            converted["tool_calls"] = calls
        if role == "tool" and message.get("name"):
            converted["tool_name"] = message["name"]
        out.append(converted)
    return out


def thinking(extra: dict[str, Any]) -> bool | str | None:
    """Ollama's ``think`` for a request: its own (the Ollama front), ``chat_template_kwargs``'
    ``enable_thinking`` (vLLM's and llama-server's way), or OpenAI's ``reasoning_effort``
    (as Ollama's OpenAI layer maps it); None: the model's default."""
    if extra.get("think") is not None:
        return extra["think"]
    kwargs = extra.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and isinstance(kwargs.get("enable_thinking"), bool):
        return kwargs["enable_thinking"]
    effort = extra.get("reasoning_effort")
    return effort if effort in ("low", "medium", "high") else None


def _openai_tool_calls(calls: list[dict[str, Any]], start_index: int) -> list[dict[str, Any]]:
    result = []
    for offset, call in enumerate(calls):
        function = call.get("function") or {}
        args = function.get("arguments")
        result.append(
            {
                "index": start_index + offset,
                "id": f"call_{start_index + offset}",
                "type": "function",
                "function": {
                    "name": function.get("name", ""),
                    "arguments": args if isinstance(args, str) else json.dumps(args or {}),
                },
            }
        )
    return result


def ollama_host_url(value: str | None) -> str | None:
    """OLLAMA_HOST (``host``, ``host:port``, ``:port``, with or without a scheme) as the URL
    Ollama's CLI and clients connect to, read as Ollama reads it: http, 127.0.0.1 and port
    11434 where it leaves them out (80 or 443 when it names its scheme); a listen-everywhere
    host (0.0.0.0, set so that other machines reach the server) is reached on this one at
    127.0.0.1. None when unset, empty or not an address."""
    value = (value or "").strip()
    if not value:
        return None
    default_port = {"http": 80, "https": 443}.get(value.partition("://")[0], 11434) if "://" in value else 11434
    parts = urllib.parse.urlsplit(value if "://" in value else "http://" + value)
    try:
        port = parts.port or default_port
    except ValueError:
        return None
    host = parts.hostname or "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"  # an IPv6 address
    return f"{parts.scheme}://{host}:{port}"


class OllamaBackend(BaseBackend):
    """Adapter for an Ollama server (default http://127.0.0.1:11434, or OLLAMA_HOST)."""

    name = "ollama"
    may_keep_ollama_store = True
    default_url = "http://127.0.0.1:11434"
    serves_any_model_name = False  # Ollama answers 404 for a model it does not have

    @classmethod
    def default_base_url(cls) -> str | None:
        """OLLAMA_HOST where it is set, as Ollama's own CLI and clients read it."""
        return ollama_host_url(os.environ.get("OLLAMA_HOST")) or cls.default_url

    def __init__(
        self, base_url: str | None = None, model: str | None = None, settings: Settings | None = None, **overrides: Any
    ) -> None:
        super().__init__(base_url, model, settings, **overrides)
        self.session: UpstreamSession | None = None
        # Load-time options must stay constant per model or Ollama reloads it every request.
        config = self.settings.backend
        self.num_ctx: int | None = config.num_ctx
        self.keep_alive: str | int | None = config.keep_alive
        self.num_parallel: int = config.parallel or 1
        # Per model: the tokenizer rebuilt from /api/show (None: estimate), built once.
        self._tokenizers: dict[str, asyncio.Future[GGUFTokenizer | None]] = {}
        self._last_use: dict[str, float] = {}  # model -> when a request last used it
        self._keeper: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.session = self.open_session()
        if self.keep_alive is None:  # an operator's own keep_alive is left alone
            self._keeper = asyncio.get_running_loop().create_task(self._keep_loaded())

    async def close(self) -> None:
        tasks = [*self._tokenizers.values(), *([self._keeper] if self._keeper else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    async def _keep_loaded(self) -> None:
        """While traffic flows (a request in the last ``prefix_cache.ttl_seconds``), renew
        the lease of each model in use shortly before Ollama would unload it (5 minutes after
        its last request by default), so that a pause between bursts does not throw its
        prompt caches away. Only a lease about to lapse is renewed (``/api/ps``
        ``expires_at``), so a longer one set on the server (OLLAMA_KEEP_ALIVE) is never
        shortened; after the window, Ollama unloads as it would."""
        window = self.settings.prefix_cache.ttl_seconds
        while True:
            await asyncio.sleep(KEEP_ALIVE_CHECK_S)
            now = time.monotonic()
            for model in [m for m, at in self._last_use.items() if now - at > window]:
                del self._last_use[model]
            if not self._last_use:
                continue
            try:
                loaded = await self.http.get_json("/api/ps")
            except BackendError:
                continue
            for entry in loaded.get("models", []) if isinstance(loaded, dict) else []:
                name = entry.get("name") if isinstance(entry, dict) else None
                left = _seconds_until(entry.get("expires_at")) if name in self._last_use else None
                if left is not None and left < RENEW_WITHIN_S:
                    try:
                        await self.http.post_json("/api/generate", {"model": name, "keep_alive": RENEWAL})
                        logger.debug("ollama: renewed %s's keep_alive (%.0fs left)", name, left)
                    except BackendError as exc:
                        logger.debug("ollama: renewing %s's keep_alive failed: %s", name, exc.message)

    # ---------------------------------------------------------------- tokens
    async def tokenize(self, request: GenerateRequest) -> list[int] | None:
        """The chat's exact token ids, from the model's tokenizer and chat template (see
        gguf_tokenizer.py); None (estimate) for completions, content parts, or a model
        whose tokenizer cannot be rebuilt here."""
        if not self.settings.backend.exact_tokens or not request.is_chat or not request.messages:
            return None
        if not all(isinstance(m.get("content"), (str, type(None))) for m in request.messages):
            return None  # images and content parts: Ollama's template sees them differently
        tokenizer = await self._tokenizer(request.model or self.model)
        if tokenizer is None:
            return None
        return await asyncio.to_thread(tokenizer.encode_chat, request.messages)

    async def _tokenizer(self, model: str | None) -> GGUFTokenizer | None:
        if not model:
            return None
        pending = self._tokenizers.get(model)
        if pending is None:
            pending = self._tokenizers[model] = asyncio.ensure_future(self._build_tokenizer(model))
        # Shielded: a request that leaves does not cancel the build the others wait for.
        return await asyncio.shield(pending)

    async def _build_tokenizer(self, model: str) -> GGUFTokenizer | None:
        try:
            show = await self.http.post_json("/api/show", {"model": model, "verbose": True}, timeout=60)
        except BackendError:
            self._tokenizers.pop(model, None)  # Ollama down or busy: ask again next time
            return None
        info = show.get("model_info") if isinstance(show, dict) else None
        tokenizer = await asyncio.to_thread(GGUFTokenizer.build, info) if isinstance(info, dict) else None
        logger.info("ollama: prompt tokens of %s are %s", model, "counted exactly" if tokenizer else "estimated")
        return tokenizer

    def _check_count(self, request: GenerateRequest, evaluated: int) -> None:
        """Ollama renders chats with its own (Go) template: if it evaluated more prompt
        tokens than KVStream counted, the two templates differ for this model, and its
        counts go back to estimates. (Fewer is a cache hit, or a template difference the
        other way: not told apart, so not claimed as a hit.)"""
        counted = request.control.prompt_token_ids
        model = request.model or self.model
        if counted and evaluated > len(counted) and model:
            logger.warning(
                "ollama: %s evaluated %d prompt tokens where its tokenizer counted %d: its template "
                "differs from the model's own; estimating its prompt sizes from now on", model, evaluated, len(counted),
            )
            done: asyncio.Future[GGUFTokenizer | None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            self._tokenizers[model] = done

    def upstream(self) -> UpstreamSession | None:
        return self.session

    @property
    def http(self) -> UpstreamSession:
        if self.session is None:
            raise RuntimeError("ollama backend used before start()")
        return self.session

    def build_body(self, request: GenerateRequest) -> tuple[str, dict[str, Any]]:
        options: dict[str, Any] = {}
        for key in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
            value = getattr(request, key)
            if value is not None:
                options[_OPTION_FIELDS[key]] = value
        for key, value in request.extra.items():
            if key in _OPTION_FIELDS and value is not None:
                options.setdefault(_OPTION_FIELDS[key], value)
        if request.stop:
            options["stop"] = request.stop
        if self.num_ctx:
            options["num_ctx"] = self.num_ctx
        body: dict[str, Any] = {"model": request.model or self.model, "stream": True, "options": options}
        if self.keep_alive is not None:
            body["keep_alive"] = self.keep_alive
        if request.logprobs is not None:
            body |= {"logprobs": True, "top_logprobs": request.logprobs}
        response_format = request.extra.get("response_format")
        if isinstance(response_format, dict):
            if response_format.get("type") == "json_object":
                body["format"] = "json"
            elif response_format.get("type") == "json_schema":
                body["format"] = (response_format.get("json_schema") or {}).get("schema", "json")
        think = thinking(request.extra)
        if think is not None:
            body["think"] = think
        if request.is_chat:
            body["messages"] = to_ollama_messages(request.messages or [])
            if request.extra.get("tools"):
                body["tools"] = request.extra["tools"]
            return "/api/chat", body
        body["prompt"] = request.prompt or ""
        if request.extra.get("suffix"):  # fill-in-the-middle (code completion): OpenAI's field, and Ollama's
            body["suffix"] = request.extra["suffix"]
        return "/api/generate", body

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Token]:
        path, body = self.build_body(request)
        self._last_use[body["model"]] = time.monotonic()
        async with self.http.request("POST", path, json_body=body, headers=request.headers) as resp:
            request.control.runtime_grant = cors_grant(resp.headers)
            await raise_for_upstream_status(resp)
            tool_calls = 0
            objects = EventReader(resp, decode_ndjson_line)
            while batch := await objects.read():
                for obj in batch:
                    # Ollama's entries have OpenAI chat's keys (token, logprob, bytes, top_logprobs).
                    logprobs = logprobs_from({"content": obj["logprobs"]}, request.logprobs) if obj.get("logprobs") else None
                    if request.is_chat:
                        message = obj.get("message") or {}
                        text = message.get("content") or ""
                        delta: dict[str, Any] = {"content": text} if text else {}
                        if message.get("thinking"):
                            delta["reasoning_content"] = message["thinking"]
                        if message.get("tool_calls"):
                            delta["tool_calls"] = _openai_tool_calls(message["tool_calls"], tool_calls)
                            tool_calls += len(message["tool_calls"])
                        if delta or logprobs:
                            yield Token(text=text, delta=delta, token_logprobs=logprobs)
                    else:
                        text = obj.get("response") or ""
                        if text or logprobs:
                            yield Token(text=text, token_logprobs=logprobs)
                    if obj.get("done"):
                        reason = obj.get("done_reason") or "stop"
                        if reason not in ("stop", "length"):
                            reason = "stop"
                        if tool_calls and reason == "stop":
                            reason = "tool_calls"
                        load = obj.get("load_duration")
                        load_s = load / 1e9 if isinstance(load, (int, float)) else 0.0
                        if load_s > RELOAD_S:
                            self.runtime_reloaded(f"Ollama loaded {request.model} ({load_s:.1f}s)", request)
                        usage = None
                        if "prompt_eval_count" in obj or "eval_count" in obj:
                            # Ollama omits zero metrics (omitempty): absent means 0.
                            usage = Usage(int(obj.get("prompt_eval_count") or 0), int(obj.get("eval_count") or 0))
                            self._check_count(request, usage.prompt_tokens)
                        yield Token(finish_reason=reason, usage=usage)
                        return
            raise BackendError("Ollama ended the stream without a final done:true object")

    async def health(self) -> bool:
        try:
            await self.http.get_json("/api/version", timeout=3.0)
        except BackendError:
            return False
        return True

    async def identify(self) -> bool:
        """Ollama answers ``/api/version`` with its version and ``/api/tags`` with its models."""
        version = await self.http.probe_json("/api/version")
        tags = await self.http.probe_json("/api/tags") if isinstance(version, dict) and "version" in version else None
        return isinstance(tags, dict) and isinstance(tags.get("models"), list)

    async def models(self) -> list[ModelInfo]:
        payload = await self.http.get_json("/api/tags")
        models = []
        for m in payload.get("models", []) if isinstance(payload, dict) else []:
            if isinstance(m, dict) and m.get("name"):
                models.append(ModelInfo(id=m["name"], owned_by="ollama", created=_epoch(m.get("modified_at"))))
        return models

    async def limits(self) -> RuntimeLimits:
        """Context from /api/ps for the resident model, times OLLAMA_NUM_PARALLEL (which
        Ollama does not report: set backend.parallel, default 1)."""
        n_ctx = self.num_ctx
        if n_ctx is None:
            try:
                payload = await self.http.get_json("/api/ps")
            except BackendError:
                payload = {}
            for m in payload.get("models", []) if isinstance(payload, dict) else []:
                if isinstance(m, dict) and m.get("context_length") and (self.model in (None, m.get("name"), m.get("model"))):
                    n_ctx = int(m["context_length"])
                    break
        return RuntimeLimits(
            n_ctx_total=n_ctx * self.num_parallel if n_ctx else None,
            n_ctx_per_request=n_ctx,
            parallel=self.num_parallel,
        )


def _epoch(stamp: Any) -> int:
    if not isinstance(stamp, str):
        return 0
    from datetime import datetime

    try:
        # Ollama's timestamps carry nanoseconds; Python parses at most microseconds.
        head, _, rest = stamp.partition(".")
        tz = ""
        for sep in ("Z", "+", "-"):
            if sep in rest:
                tz = rest[rest.index(sep) :]
                break
        return int(datetime.fromisoformat(head + tz.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return int(time.time())


def _seconds_until(stamp: object) -> float | None:
    """Seconds from now to an RFC 3339 time as Ollama writes it (nanosecond fractions
    included); None when it is not one."""
    if not isinstance(stamp, str):
        return None
    text = re.sub(r"(\.\d{6})\d+", r"\1", stamp.replace("Z", "+00:00"))
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        return None
    return (when - datetime.now(timezone.utc)).total_seconds()
