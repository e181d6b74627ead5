"""``--backend hf``: the in-process engine behind the same API as every other backend.

Unlike the remote backends, this one owns the KV: the proxy's engine hands each request's
Sequence to it (``request.hints["sequence"]``) and reads the real pool through
``backend.scheduler`` for /status and /metrics, while admission, batching and preemption
happen inside the engine's step loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from kvstream.backends.base import (
    BackendError,
    BackendRejected,
    BackendUnavailable,
    BaseBackend,
    Capabilities,
    GenerateRequest,
    ModelInfo,
    RuntimeLimits,
    Token,
    Usage,
)
from kvstream.backends.hf.loader import chat_token_ids
from kvstream.scheduler import Scheduler, SchedulerError, Sequence

logger = logging.getLogger(__name__)



class HFBackend(BaseBackend):
    """A HuggingFace causal LM run in-process by KVStream's paged engine."""

    name = "hf"
    capabilities = Capabilities(token_ids=True, exact_prompt_tokens=True, preemptible=True, owns_kv=True)

    def __init__(self, base_url: str | None = None, model: str | None = None, **options: Any) -> None:
        super().__init__(None, model, **options)
        self.engine: Any = None  # PagedEngine once started
        self.model_name: str | None = None
        self._start_lock = asyncio.Lock()
        self._error: str | None = None

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        async with self._start_lock:
            if self.engine is not None:
                return
            try:
                self.engine = await asyncio.to_thread(self._build)
            except (OSError, ValueError) as exc:
                self._error = str(exc)
                raise RuntimeError(f"hf backend: {exc}") from exc
            self.engine.start()

    def _build(self) -> Any:
        import torch

        from kvstream.backends.hf.engine import EngineConfig, PagedEngine
        from kvstream.backends.hf.kv_cache import auto_num_blocks
        from kvstream.backends.hf.loader import load_model

        opts = self.options
        if opts.get("threads"):
            torch.set_num_threads(int(opts["threads"]))
        # ``preloaded``: a LoadedModel to serve instead of loading one (tests, embedding).
        loaded = opts.get("preloaded") or load_model(
            self.model, opts.get("gguf_file"), opts.get("dtype", "auto"), opts.get("device", "auto")
        )
        self.model_name = loaded.name
        block_size = int(opts.get("block_size", 16))
        context = int(getattr(loaded.model.config, "max_position_embeddings", 0) or 0) or None
        num_blocks = opts.get("num_gpu_blocks", "auto")
        if num_blocks in (None, "auto"):
            num_blocks = auto_num_blocks(loaded.model, block_size, opts.get("kv_cache_bytes"))
        config = EngineConfig(
            block_size=block_size,
            num_blocks=int(num_blocks),
            num_cpu_blocks=int(opts.get("num_cpu_blocks", 256)),
            max_num_seqs=int(opts.get("max_batch_size", 16)),
            max_num_batched_tokens=int(opts.get("max_num_batched_tokens", 2048)),
            preemption_mode=opts.get("preemption_policy", "swap"),
            policy=opts.get("priority", "fcfs"),
            enable_prefix_caching=bool(opts.get("prefix_cache", True)),
            max_queue_size=int(opts.get("max_queue_size", 256)),
            max_model_len=context,
            model_identity=loaded.identity,
            attention="eager" if opts.get("attention") == "eager" else "sdpa",
            kv_cache_bits=opts.get("kv_cache_bits"),
            host_cache_bytes=int(opts.get("host_cache_bytes") or 0),
            disk_cache_dir=opts.get("disk_cache_dir"),
            disk_cache_bytes=int(opts.get("disk_cache_bytes") or 4 * 1024**3),
        )
        engine = PagedEngine(loaded.model, loaded.tokenizer, config)
        logger.info(
            "hf engine: %s on %s, KV pool %d blocks x %d tokens (%.0f MiB), host swap %d blocks, batch %d",
            loaded.name, engine.device, config.num_blocks, block_size,
            engine.cache.device_bytes / 2**20, config.num_cpu_blocks, config.max_num_seqs,
        )
        return engine

    async def close(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.close)

    @property
    def scheduler(self) -> Scheduler | None:
        """The engine's scheduler (the real pool), once started."""
        return self.engine.scheduler if self.engine is not None else None

    # ----------------------------------------------------------------- info
    async def health(self) -> bool:
        return self.engine is not None

    async def models(self) -> list[ModelInfo]:
        if self.engine is None:
            raise BackendUnavailable(self._error or "the model is still loading")
        return [ModelInfo(self.model_name or "hf", context_length=self.engine.config.max_model_len)]

    async def limits(self) -> RuntimeLimits:
        if self.engine is None:
            return RuntimeLimits()
        config = self.engine.config
        return RuntimeLimits(config.num_blocks * config.block_size, config.max_model_len, config.max_num_seqs)

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"type": self.name, "url": "in-process", "model": self.model_name or self.model}
        if self.engine is not None:
            engine = self.engine
            info |= {
                "device": str(engine.device),
                "dtype": str(engine.kv_dtype).removeprefix("torch."),
                "kv_device_bytes": engine.cache.device_bytes,
                "kv_host_bytes": engine.cache.host_bytes,
                "steps": engine.counters.steps,
                "forward_tokens": engine.counters.forward_tokens,
                "prefill_tokens": engine.counters.prefill_tokens,
                "decode_tokens": engine.counters.decode_tokens,
            }
        return info

    # ------------------------------------------------------------ requests
    async def tokenize(self, request: GenerateRequest) -> list[int] | None:
        if self.engine is None:
            raise BackendUnavailable(self._error or "the model is still loading")
        tokenizer = self.engine.tokenizer
        if request.is_chat:
            try:
                # A warm-up prefills the conversation's prefix: no assistant header after it,
                # which later requests would not share.
                return chat_token_ids(tokenizer, request.messages or [], generation_prompt=not request.hints.get("prefix_only"))
            except Exception as exc:  # a template that rejects these messages (roles, tools...)
                raise BackendRejected(f"the model's chat template rejected the messages: {exc}", param="messages") from None
        return list(tokenizer(request.prompt or "").input_ids) or [tokenizer.bos_token_id or 0]

    def _blend_params(self, request: GenerateRequest) -> Any:
        """BlendParams when the request (or the configured default) asks for blend reuse."""
        from kvstream.backends.hf.blend import BlendParams

        if request.hints.get("reuse", self.options.get("reuse", "exact")) != "blend":
            return None
        ratio = request.hints.get("blend_ratio", self.options.get("blend_ratio", 0.15))
        return BlendParams(blend_ratio=float(ratio))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Token]:
        from kvstream.backends.hf.sampling import SamplingParams

        if self.engine is None:
            raise BackendUnavailable(self._error or "the model is still loading")
        seq: Sequence | None = request.hints.get("sequence")
        if seq is None:  # used directly, not through KVStreamEngine
            prompt = await self.tokenize(request)
            seq = Sequence(prompt or [0], request.max_tokens or 256)
        try:
            params = SamplingParams(
                max_tokens=seq.max_tokens,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=request.top_k or 0,
                seed=request.seed,
                stop=list(request.stop),
            )
        except ValueError as exc:
            raise BackendRejected(str(exc)) from None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(batch: list) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(events.put_nowait, batch)

        try:
            self.engine.add_request(seq, params, sink, blend=self._blend_params(request))
        except SchedulerError as exc:
            raise BackendError(str(exc), exc.status, code=exc.code, retryable=exc.status >= 429) from None
        finished = False
        generated = 0
        try:
            timeout = self.options.get("queue_timeout_s")
            admitted = False
            while True:
                try:
                    batch = await (asyncio.wait_for(events.get(), timeout) if not admitted and timeout else events.get())
                except TimeoutError:
                    raise BackendError(
                        f"The request waited {timeout:g}s in the queue without a free slot.", 503, code="queue_timeout"
                    ) from None
                for event in batch:
                    if event.kind == "admitted":
                        admitted = True
                    elif event.kind == "error":
                        finished = True
                        if isinstance(event.error, SchedulerError):
                            err = event.error
                            raise BackendError(str(err), err.status, code=err.code, retryable=err.status >= 429)
                        raise BackendError(f"the engine failed: {event.error!r}", 500, code="engine_error")
                    elif event.finish_reason is None:
                        admitted = True
                        generated += 1
                        yield Token(text=event.text, token_id=event.token_id)
                    else:
                        finished = True
                        if event.text:
                            yield Token(text=event.text, token_id=event.token_id)
                        if event.finish_reason == "length" or event.token_id not in self.engine.eos_ids:
                            generated += 1
                        usage = Usage(len(seq.prompt_token_ids), generated, seq.num_cached_tokens)
                        yield Token(finish_reason=event.finish_reason, usage=usage)
                        return
        finally:
            if not finished:
                self.engine.abort(seq.seq_id)
