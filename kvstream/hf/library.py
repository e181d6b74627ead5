"""KVStream's in-process engine as a Python library.

::

    from kvstream.hf import HFEngine

    engine = HFEngine.from_pretrained()            # the embedded SmolLM2, or a folder / hub id
    engine.warm(SYSTEM_PROMPT)                     # its KV is computed once and kept
    result = engine.generate(SYSTEM_PROMPT + "Q: ...", max_new_tokens=64)
    result.output_text, result.ttft_ms, result.kv_reuse_ratio

Reuse is exact by default: the KV of any earlier prompt or generated text (whole blocks of
``chunk_size`` tokens) is reused for a later prompt that starts with the same tokens, and the
output is the same as without reuse (``verify_correctness`` measures it). With
``recompute_strategy="cacheblend"`` (or ``"selective"``), text that reappears *elsewhere* in a
prompt (RAG documents in another order) is reused too, approximately: its KV is moved and
re-rotated, then repaired (see kvstream/backends/hf/blend.py). Timings are from
the call: tokenizing, cache lookup, the forward passes and sampling are all included, and
nothing is written after the answer (the cache is filled as a side effect of computing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvstream.config import default
from kvstream.hf.blend import BlendParams
from kvstream.hf.model_runner import RunnerConfig, ModelRunner, TokenEvent
from kvstream.hf.kv_cache import auto_num_blocks, pool_dtype
from kvstream.hf.awq.streaming import StreamingConfig
from kvstream.hf.loader import LoadedModel, chat_token_ids, load_model
from kvstream.hf.sampling import SamplingParams
from kvstream.scheduler import Sequence


@dataclass
class GenerationResult:
    """One generation and what it cost."""

    output_text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the cache
    ttft_ms: float  # from the call to the first token
    total_ms: float  # from the call to the end, everything included
    first_token_logits: torch.Tensor | None = field(default=None, repr=False)
    moved_tokens: int = 0  # prompt tokens whose KV was moved from elsewhere (blend), not computed

    @property
    def kv_reuse_ratio(self) -> float:
        """Share of the prompt not computed: exact hits plus moved (approximate) tokens."""
        return (self.cached_tokens + self.moved_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def exact_reuse_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class HFEngine:
    """A HuggingFace causal LM behind KVStream's paged engine, driven from the calling thread."""

    STRATEGIES = ("none", "selective", "cacheblend")

    def __init__(self, loaded: LoadedModel, config: RunnerConfig, recompute_strategy: str = "none", blend_ratio: float = default("prefix_cache", "blend_ratio")) -> None:
        if recompute_strategy not in self.STRATEGIES:
            raise ValueError(f"recompute_strategy must be one of {self.STRATEGIES}, not {recompute_strategy!r}")
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.engine = ModelRunner(loaded.model, loaded.tokenizer, config)
        # none: exact prefix reuse only. selective: also move reappearing chunks, recomputing
        # only their seams. cacheblend: move, then recompute the blend_ratio most deviant tokens.
        self.blend = None
        if recompute_strategy != "none":
            self.blend = BlendParams(blend_ratio=blend_ratio if recompute_strategy == "cacheblend" else 0.0)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        chunk_size: int = default("memory", "block_size"),
        max_cache_bytes: int | None = None,
        device: str = "auto",
        dtype: str = "auto",
        gguf_file: str | None = None,
        max_batch_size: int | Literal["auto"] = default("scheduler", "max_batch_size"),
        recompute_strategy: str = "none",
        blend_ratio: float = default("prefix_cache", "blend_ratio"),
        kv_cache_bits: int | None = None,
        host_cache_bytes: int = default("memory", "host_cache_bytes"),
        disk_cache_dir: str | None = None,
        disk_cache_bytes: int = default("memory", "disk_cache_bytes"),
        streaming: StreamingConfig | None = None,
        half_weights: bool = default("memory", "half_weights"),
        kv_dtype: str | None = None,
    ) -> HFEngine:
        """Load ``model`` (default: the embedded SmolLM2). ``chunk_size`` is the KV block
        size in tokens, the granularity of reuse; ``max_cache_bytes`` bounds the KV pool
        (default 1 GiB on CPU, 40% of free memory on CUDA). Blocks the pool reclaims spill to
        ``host_cache_bytes`` of RAM, then to ``disk_cache_dir`` (kept across restarts; call
        ``close()``), stored KIVI-quantized when ``kv_cache_bits`` is 8 or 4.
        ``recompute_strategy``: none (exact reuse only), selective or cacheblend (see above).
        ``model`` may be an AWQ checkpoint folder (``kvstream awq quantize``); ``streaming``
        then keeps only some of its layers resident (``kvstream.hf.awq.streaming``).
        ``half_weights``: on the CPU in float32, a bfloat16 / float16 checkpoint's linear
        layers and embeddings stay as stored (``kvstream.hf.half_weights``). ``kv_dtype``
        ("float16", "bfloat16"): the KV pool's dtype when not the model's (half the pool's
        bytes; K/V rounded once as written)."""
        kv_pool_dtype = pool_dtype(kv_dtype)  # a bad name fails here, before the model loads
        loaded = load_model(model, gguf_file, dtype, device, streaming, half_weights)
        blocks = auto_num_blocks(loaded.model, chunk_size, max_cache_bytes, kv_pool_dtype)
        config = RunnerConfig(
            block_size=chunk_size, num_blocks=blocks, num_cpu_blocks=0, max_num_seqs=max_batch_size,
            model_identity=loaded.identity, max_model_len=getattr(loaded.model.config, "max_position_embeddings", None),
            kv_cache_bits=kv_cache_bits, host_cache_bytes=host_cache_bytes, disk_cache_dir=disk_cache_dir,
            disk_cache_bytes=disk_cache_bytes, kv_dtype=kv_dtype,
        )
        return cls(loaded, config, recompute_strategy, blend_ratio)

    # ------------------------------------------------------------------ API
    def encode(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        """Token ids of a text, or of chat messages through the model's template."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return chat_token_ids(self.tokenizer, prompt)

    def warm(self, text: str | list[dict[str, Any]]) -> int:
        """Compute ``text``'s KV and keep it; returns the tokens now reusable from the cache
        (its whole blocks)."""
        ids = self.encode(text)
        self._run([ids], [SamplingParams(max_tokens=1, temperature=0)])
        return len(ids) // self.engine.config.block_size * self.engine.config.block_size

    def generate(
        self,
        prompt: str | list[dict[str, Any]],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> GenerationResult:
        """Generate for one prompt (text, or chat messages)."""
        start = time.perf_counter()
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, list(stop or []))
        return self._run([self.encode(prompt)], [params], start)[0]

    def generate_batch(
        self,
        prompts: list[str | list[dict[str, Any]]],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: list[str] | None = None,
    ) -> list[GenerationResult]:
        """Generate for several prompts at once (continuous batching); timings per request.
        Greedy unless ``temperature`` says otherwise, as ``generate``."""
        start = time.perf_counter()
        params = [SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, list(stop or [])) for _ in prompts]
        return self._run([self.encode(p) for p in prompts], params, start)

    def verify_correctness(
        self, prompts: list[str | list[dict[str, Any]]], max_new_tokens: int = 16, warm: list[str] | None = None
    ) -> list[dict[str, Any]]:
        """Run each prompt with reuse and without (a fresh engine with caching off, same
        model), greedily; report the share of agreeing tokens, the first position that differs
        (None: identical), the KL divergence of the first token's distributions, and the
        reuse ratio. So that reuse really happens, each prompt is warmed first, or, when
        ``warm`` is given, those texts are (e.g. a RAG prompt's documents in another order,
        which exercises blend reuse)."""
        config = self.engine.config
        plain = ModelRunner(
            self.loaded.model, self.tokenizer,
            RunnerConfig(block_size=config.block_size, num_blocks=config.num_blocks, num_cpu_blocks=0, enable_prefix_caching=False),
        )
        report = []
        for prompt in prompts:
            ids = self.encode(prompt)
            for text in warm if warm is not None else [prompt]:
                self.warm(text)
            greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0)
            reused = self._run([ids], [greedy], keep_logits=True)[0]
            fresh = self._run([ids], [greedy], keep_logits=True, engine=plain)[0]
            a, b = reused.token_ids, fresh.token_ids
            first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if first_diff is None and len(a) != len(b):
                first_diff = min(len(a), len(b))
            same = sum(x == y for x, y in zip(a, b))
            p = torch.log_softmax(fresh.first_token_logits.double(), -1)  # type: ignore[union-attr]
            q = torch.log_softmax(reused.first_token_logits.double(), -1)  # type: ignore[union-attr]
            report.append({
                "prompt_tokens": len(ids),
                "kv_reuse_ratio": reused.kv_reuse_ratio,
                "exact_reuse_ratio": reused.exact_reuse_ratio,
                "token_agreement": same / max(len(a), len(b), 1),
                "first_divergence": first_diff,
                "first_token_kl": float((p.exp() * (p - q)).sum()),
            })
        return report

    def close(self) -> None:
        """Write the cache to the disk tier (if configured) and release it."""
        self.engine.close()

    def __enter__(self) -> HFEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _run(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        start: float | None = None,
        keep_logits: bool = False,
        engine: ModelRunner | None = None,
    ) -> list[GenerationResult]:
        engine = engine or self.engine
        start = time.perf_counter() if start is None else start
        states = []
        for ids, p in zip(prompts, params, strict=True):
            p.keep_first_logits = keep_logits
            seq = Sequence(ids, p.max_tokens)
            state: dict[str, Any] = {"seq": seq, "tokens": [], "text": [], "first": None, "end": None, "reason": None, "logits": None}

            def sink(events: list[TokenEvent], state: dict[str, Any] = state) -> None:
                now = time.perf_counter()
                for e in events:
                    if e.kind == "error":
                        state["error"] = e.error
                    if e.kind != "token":
                        continue
                    if state["first"] is None:
                        state["first"] = now
                        state["logits"] = e.logits
                    state["tokens"].append(e.token_id)
                    state["text"].append(e.text)
                    if e.finish_reason:
                        state["end"], state["reason"] = now, e.finish_reason

            state["request"] = engine.add_request(seq, p, sink, blend=self.blend if engine is self.engine else None)
            states.append(state)
        while engine.has_work():
            engine.step()
        failed = next((s["error"] for s in states if s.get("error") is not None), None)
        if failed is not None:
            raise RuntimeError(f"the engine failed: {failed!r}") from failed
        results = []
        for s in states:
            results.append(GenerationResult(
                output_text="".join(s["text"]),
                token_ids=s["tokens"],
                finish_reason=s["reason"] or "stop",
                prompt_tokens=len(s["seq"].prompt_token_ids),
                cached_tokens=s["seq"].num_cached_tokens,
                ttft_ms=((s["first"] or start) - start) * 1000,
                total_ms=((s["end"] or time.perf_counter()) - start) * 1000,
                first_token_logits=s["logits"],
                moved_tokens=s["request"].moved_tokens,
            ))
        return results


__all__ = ["GenerationResult", "HFEngine"]
