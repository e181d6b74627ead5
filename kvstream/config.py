"""KVStream's configuration: one pydantic-settings model and its layered sources.

Precedence, highest first: CLI flags, environment (``KVSTREAM_SECTION__KEY``, plus the short
forms ``KVSTREAM_BACKEND`` and ``KVSTREAM_BACKEND_URL``), ``kvstream.yaml`` in the working
directory or ``--config PATH``, then the defaults below. ``load_settings`` also records where
every value came from, for ``kvstream config show``.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "KVSTREAM_"
DEFAULT_CONFIG_FILE = "kvstream.yaml"
SHORT_ENV = {"KVSTREAM_BACKEND": ("backend", "type"), "KVSTREAM_BACKEND_URL": ("backend", "base_url")}


class ConfigError(Exception):
    """An invalid configuration value; the message is one line naming the key and problem."""


def split_list(value: Any) -> Any:
    """A list setting given as one string (an environment variable): ``a,b`` or the JSON
    list form ``["a", "b"]`` (pydantic-settings' own for lists)."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                items = json.loads(text)
            except ValueError:
                raise ValueError("looks like a JSON list but is not valid JSON") from None
            if not isinstance(items, list) or not all(isinstance(k, str) for k in items):
                raise ValueError("a JSON list here must hold strings only")
            return [k.strip() for k in items if k.strip()]
        return [k.strip() for k in text.split(",") if k.strip()]
    return value


def runtime_url(value: str | None) -> str | None:
    """A runtime's URL as given, checked: ``host:port`` without a scheme means http (as
    curl and OLLAMA_HOST read it); anything but an http(s) URL with a host is refused here,
    at start, rather than failing every request later with a client error."""
    if value is None:
        return None
    url = value.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    try:
        _ = parts.port  # raises for a port that is not a number in range
    except ValueError:
        raise ValueError(f"{value!r} has a port that is not a number from 1 to 65535") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s) URL of a runtime (e.g. http://127.0.0.1:8080)")
    return url


def _said(error: Any) -> str:
    """A validation error's message without pydantic's "Value error, " before our own words."""
    return error["msg"].removeprefix("Value error, ")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BackendSettings(_Section):
    type: str = Field("auto", description="ollama | llamacpp | lmstudio | foundry | openai | vllm | sglang | hf | auto, or a plugin name")
    base_url: str | None = Field(None, description="the runtime's URL; each backend has its own default")
    replicas: list[str] = Field(default_factory=list, description="several runtimes of this type (their URLs; --backend-url repeated fills it): KVStream routes each request to one of them (see routing)")
    model: str | None = Field(None, description="the model to serve; default: the runtime's first model")
    api_key: SecretStr | None = Field(None, description="a key KVStream sends upstream, if the runtime needs one")
    request_timeout_s: float = Field(600.0, gt=0, description="deadline for one upstream request, from sending it to its last byte (a stream still running then is cut with an error)")
    read_timeout_s: float = Field(120.0, gt=0, description="longest the runtime may send nothing (prefill included) before the request is failed with 504")
    connect_timeout_s: float = Field(5.0, gt=0, description="longest to wait for the runtime to accept a connection")
    parallel: int | None = Field(None, ge=1, description="requests the runtime runs at once when it does not report it (Ollama: OLLAMA_NUM_PARALLEL, default 1; LM Studio: 4)")
    num_ctx: int | None = Field(None, ge=256, description="Ollama: context per request (options.num_ctx), kept constant to avoid reloads")
    keep_alive: str | None = Field(None, description="Ollama: keep_alive sent with every request (e.g. 10m, -1)")
    exact_tokens: bool = Field(True, description="Ollama: count prompt tokens with the model's own tokenizer and chat template, rebuilt from /api/show (needs transformers: pip install 'kvstream[hf]'); otherwise estimated")
    metrics_interval_s: float = Field(1.0, gt=0, description="vllm, sglang: how often their Prometheus /metrics are read (running, waiting, KV usage), which gate admission and drive routing")
    managed_slots: int = Field(2, ge=1, description="slots (-np) of a llama-server KVStream starts itself")
    managed_ctx: int = Field(4096, ge=256, description="total context (-c) of a llama-server KVStream starts itself")
    slot_save_path: Path | None = Field(None, description="llama.cpp: the server's --slot-save-path, where KVStream keeps slot files")
    inject: bool = Field(True, description="llama.cpp: hard KV inject (save and restore slot state) when slot saving works")
    inject_min_tokens: int = Field(64, ge=1, description="llama.cpp: shortest prefix worth restoring from a slot file")
    slot_budget_bytes: int = Field(2 * 1024**3, ge=0, description="llama.cpp: most bytes of slot files kept (LRU)")
    model_aliases: dict[str, str] = Field(default_factory=dict, description="model names clients send -> the runtime's model id (applied before anything else)")
    model_fallback: bool | None = Field(None, description="serve a model name the runtime does not list with its one model (as llama-server does); none = on unless the backend is ollama (which answers 404 itself)")
    gguf_file: str | None = Field(None, description="hf: the .gguf file inside the --model folder, for transformers' GGUF loader")
    served_model_name: str | None = Field(None, min_length=1, description="hf: the name the model is listed and answered under (vLLM's --served-model-name, llama-server's --alias); none = its folder's or file's name")
    default_max_tokens: int | None = Field(None, ge=1, description="hf: tokens generated by a request that sets no bound (llama-server's --n-predict), ending as a length stop; none = up to the end of the context")
    seed: int | None = Field(None, ge=-1, le=2**32 - 1, description="hf: the sampling seed of every request that sets none (llama-server's --seed): the same request gets the same answer, whatever shares its batch; none or -1 (llama-server's random) = a fresh random seed per request")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="hf: where the model runs; auto = cuda when available")
    threads: int | None = Field(None, ge=1, description="hf: torch CPU threads; none = torch's default")
    chat_template: Path | None = Field(None, description="hf, or a llama-server KVStream starts: a Jinja chat template file used instead of the model's own (vLLM's --chat-template, llama-server's --chat-template-file): for a model whose template does not show it tools, e.g. DeepSeek-R1's distillations")
    tool_call_syntax: Literal["auto", "hermes", "qwen3_xml", "llama3_json", "mistral", "granite", "deepseek", "pythonic", "generic", "none"] = Field(
        "auto", description="hf: how the model's own tool calls are read from its text (vLLM's --tool-call-parser); auto = the syntax its chat template shows, generic where it shows no tools; generic = the tools described in the system message and the answer held to {\"tool_calls\": [...]} or {\"response\": ...} (llama.cpp's former Generic format); none = never (calls stay text; tools for a template that shows none are a 400)")

    @field_validator("replicas", mode="before")
    @classmethod
    def _split_replicas(cls, value: Any) -> Any:
        return split_list(value)

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, value: str | None) -> str | None:
        return runtime_url(value)

    @field_validator("replicas")
    @classmethod
    def _replica_urls(cls, value: list[str]) -> list[str]:
        return [runtime_url(url) for url in value]

    @field_validator("seed")
    @classmethod
    def _random_seed(cls, value: int | None) -> int | None:
        return None if value == -1 else value  # llama-server's --seed -1: random


class UpstreamEntry(_Section):
    """One upstream of a mixed fleet (``backends:``): its own type, URL, model, capacity
    and routing weight; everything else comes from the ``backend`` section."""

    type: str = Field(description="ollama | llamacpp | lmstudio | foundry | openai | vllm | sglang, or a plugin name")
    url: str | None = Field(None, description="its URL; default: the type's own")
    model: str | None = Field(None, description="the model it serves; default: its first")
    weight: float = Field(1.0, gt=0, description="its share of traffic relative to the others (round_robin, least_loaded, and where new prefixes go)")
    parallel: int | None = Field(None, ge=1, description="requests it runs at once, when it does not report it")
    api_key: SecretStr | None = Field(None, description="a key sent to it, if it needs one")

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return runtime_url(value)


class MemorySettings(_Section):
    num_gpu_blocks: int | Literal["auto"] = Field(
        "auto", description="KV blocks in the pool; auto = sized from what the runtime reports"
    )
    num_cpu_blocks: int = Field(512, ge=0, description="blocks in the host swap pool")
    block_size: Literal[8, 16, 32] = Field(16, description="tokens per KV block")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field("auto", description="hf: model and KV dtype; auto = float32 on CPU, bfloat16 on CUDA")
    kv_cache_bytes: int | None = Field(None, ge=1, description="hf: bytes of the device KV pool when num_gpu_blocks is auto; none = 1 GiB on CPU, 40% of free memory on CUDA")
    host_cache_bytes: int = Field(0, ge=0, description="hf: host RAM for cached blocks the pool reclaims (spilled, restored on a hit); 0 = none")
    kv_cache_bits: Literal[8, 4] | None = Field(None, description="hf: keep spilled and swapped KV blocks KIVI-quantized to 8 or 4 bits; none = model precision")
    disk_cache_dir: Path | None = Field(None, description="hf: directory of the disk KV tier (below host RAM; survives restarts); none = no disk tier")
    disk_cache_bytes: int = Field(4 * 1024**3, ge=1, description="hf: most bytes the disk KV tier holds")
    kv_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field("auto", description="hf: the KV pool's dtype; auto = the model's. float16 / bfloat16 under a float32 CPU model: half the pool's bytes (twice the tokens in kv_cache_bytes) and half what decode reads at long context, K/V rounded once as they are written")
    half_weights: bool = Field(True, description="hf: on the CPU in float32, hold the linear layers and embeddings of a bfloat16 / float16 checkpoint as stored (values exactly half precision) and widen them in the kernel: half the weight bytes, the upcast model's results at decode; false = upcast every weight")

    @field_validator("num_gpu_blocks")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be a positive number of blocks or 'auto'")
        return value


# A remote runtime batches on its own; more in flight than this by default only queues there.
REMOTE_BATCH_SIZE = 8


class SchedulerSettings(_Section):
    max_batch_size: int | Literal["auto"] = Field(
        "auto",
        description="most requests in flight at once; auto = 8 in front of a runtime (never more than its slots), "
        "in-process sized from the KV pool (one sequence per 1,024 pool tokens, 8 to 256)",
    )
    preemption_policy: Literal["swap", "recompute"] = Field("swap", description="how a preempted sequence is paused")
    policy: Literal["auto", "fcfs", "sjf", "lpm"] = Field("auto", description="queue order: fcfs = arrival; sjf = shortest job first (with aging); lpm = longest prefix the runtime already holds first (with aging); auto = lpm in front of a runtime with a per-slot prompt cache (every remote backend), fcfs in-process")
    lpm_max_overtakes: int = Field(8, ge=0, description="lpm: times a waiting request may be passed over for a better prefix match before it goes first")
    lpm_window: int = Field(64, ge=1, description="lpm: the waiting requests (the first in arrival order) ordered by the prefix the runtime holds; those behind them wait in arrival order, so a scheduling pass costs the same however long the queue")
    max_queue_size: int = Field(256, ge=0, description="waiting requests beyond this get 429 + Retry-After")
    queue_timeout_s: float | None = Field(None, gt=0, description="a request waiting longer for a slot gets 503 + Retry-After; none = no deadline (a request waits as long as its client does, as it would at the runtime; a client sets its own with the X-KVStream-Deadline-Ms header)")
    max_num_batched_tokens: int = Field(2048, ge=16, description="hf: most tokens in one forward pass; longer prompts are prefilled in chunks")
    prefill_step_ms: int = Field(500, ge=0, description="hf: while sequences decode, the prompt tokens of a step are as many as keep it to about this long (every decoding stream waits on the step for its next token); 0 = as many as max_num_batched_tokens")

    @field_validator("max_batch_size")
    @classmethod
    def _positive_batch(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be a positive number of requests or 'auto'")
        return value

    def remote_batch_size(self) -> int:
        """``max_batch_size`` in front of a remote runtime ("auto": REMOTE_BATCH_SIZE; the
        runtime's own slot count caps it where it reports one)."""
        return REMOTE_BATCH_SIZE if self.max_batch_size == "auto" else self.max_batch_size


class PrefixCacheSettings(_Section):
    enabled: bool = Field(True, description="share KV blocks of common prompt prefixes")
    max_prefix_length: int | None = Field(None, ge=0, description="longest prefix (tokens) reused; none = no cap")
    tenant_isolation: bool | None = Field(None, description="per-API-key cache salt: a key's requests share cached prefixes only with the same key's, and see only their own hits; none = on when API keys are configured")
    ttl_seconds: float = Field(3600.0, gt=0, description="unreferenced cached blocks older than this are dropped")
    warm: list[str] = Field(default_factory=list, description="system prompts prefilled at start, so their prefix is cached before the first request")
    reuse: Literal["exact", "blend"] = Field("exact", description="hf: exact = reuse only identical prefixes (output unchanged); blend = also reuse moved chunks, approximately (RAG); a request's own 'reuse' field wins")
    blend_ratio: float = Field(0.15, ge=0, le=1, description="hf: share of moved tokens recomputed by the blend repair (0 = move only)")


class AttentionSettings(_Section):
    backend: Literal["auto", "flash", "native", "flex", "sdpa", "eager"] = Field("auto", description="hf: attention kernel over the paged pool, checked against eager at start; auto = the fastest tier that passes: flash (every row reads the pool in place with one Triton kernel; CUDA; untested on a GPU so far), native (decodes read the pool in place with a C++ kernel built on first use; CPU, float32; needs a C++ compiler and ninja), flex (decodes read the pool in place with compiled flex_attention from 4,096 tokens of decode context a step; needs torch.compile, on CPU a C++ compiler), sdpa (gather + torch's fused kernels), eager (plain matmul-softmax, the reference)")


class MatmulSettings(_Section):
    backend: Literal["auto", "native", "torch"] = Field("auto", description="hf: what runs the model's linear layers for batches of up to 64 rows (decode steps); auto = native where it builds and agrees with torch's at start (a C++ kernel built on first use; CPU, float32; needs a C++ compiler and ninja), torch otherwise; torch = F.linear always. All but torch also run the RMSNorm and rotary embedding as one native call each where they agree with transformers' ops")


class AWQSettings(_Section):
    streaming: bool = Field(False, description="hf, an AWQ checkpoint: keep only embeddings, norms, head and the first/last K decoder layers resident, and stage the other layers' packed weights from the memory-mapped checkpoint before each forward")
    mode: Literal["full_resident", "partial_resident", "ffn_only_stream", "full_stream"] = Field("partial_resident", description="what streams: partial_resident = layers outside the first/last K whole; ffn_only_stream = only their MLP; full_stream = every layer; full_resident = none")
    keep_first_k: int = Field(2, ge=0, description="decoder layers at the start kept resident")
    keep_last_k: int = Field(2, ge=0, description="decoder layers at the end kept resident")
    staging_slots: int = Field(2, ge=1, description="layers staged at once: the one computing and slots - 1 prefetched ahead (copy: preallocated slots they are copied into; mapped: layers whose pages are faulted in ahead)")
    drop_page_cache: bool = Field(False, description="drop each streamed layer's checkpoint pages once staged, so that the page cache does not hold the model (every forward reads streamed layers from disk)")
    stream_embeddings: bool | None = Field(None, description="with streaming: the token embeddings and LM head are read from the mapped checkpoint too instead of held in memory (the head reads its whole table from the page cache every token, as a streamed layer does; an untied input table is left mapped anyway). Unset: on where it can be (the CPU, a head that keeps its table as stored); false keeps them held")
    staging: Literal["copy", "mapped"] = Field("mapped", description="mapped (CPU) = streamed layers compute straight from the memory-mapped checkpoint, the next layers' pages faulted in ahead where they left the page cache (no copies, no slots; faster warm and cold here); copy = their packed weights copied into the staging slots before they compute")


class RoutingSettings(_Section):
    policy: Literal["cache_aware", "least_loaded", "round_robin"] = Field("cache_aware", description="with several replicas: cache_aware = the replica that holds the longest part of the prompt, unless it is loaded balance_threshold requests beyond the least loaded; a prefix nobody holds goes where its hash says (the same in every KVStream); least_loaded; round_robin")
    balance_threshold: int = Field(2, ge=0, description="cache_aware: in-flight requests a replica may have beyond the least loaded one and still get a hit")
    health_interval_s: float = Field(5.0, gt=0, description="how often each replica's health is probed")
    eject_after: int = Field(3, ge=1, description="failures in a row (requests that could not connect, or probes) that eject a replica")
    cooldown_s: float = Field(15.0, gt=0, description="an ejected replica gets no traffic for this long, then is probed again")


class ServerSettings(_Section):
    host: str = Field("127.0.0.1", description="address to bind; anything but loopback exposes the API")
    port: int = Field(8080, ge=0, le=65535, description="port to listen on")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    max_messages: int = Field(2048, ge=1, description="most messages in one chat request")
    api_keys: list[SecretStr] = Field(default_factory=list, description="accepted Bearer keys; empty = no auth")
    api_keys_file: Path | None = Field(None, description="a file with one accepted key per line")
    shutdown_grace_s: float = Field(30.0, ge=0, description="time running requests get to finish on SIGTERM")
    max_concurrent_per_key: int | None = Field(None, ge=1, description="most generations in flight per API key (429 past it); none = no cap")
    idle_timeout_s: float = Field(15.0, gt=0, description="a connection with no complete request head for this long is closed: idle keep-alive connections and slowly sent heads alike")
    body_timeout_s: float = Field(60.0, gt=0, description="longest a client may take to send a request body (408 past it)")
    write_timeout_s: float = Field(30.0, gt=0, description="a client that reads nothing of its answer for this long is disconnected, and its request cancelled (its batch slot freed)")
    max_connections: int | None = Field(None, ge=1, description="most client connections open at once; past it a new connection gets 503 and is closed; none = 4096, or 3/4 of the open-file limit if that is lower")
    passthrough: bool = Field(True, description="pass every route KVStream does not manage to the runtime (its admin routes too, behind KVStream's keys); false = 404 for them")
    responses_max_stored: int = Field(1000, ge=0, description="Responses API answered by KVStream itself (in-process engine, Ollama): most responses kept for previous_response_id, retrieval and input_items, and most conversations (in memory, least recently used out); 0 = store nothing")
    responses_max_bytes: int = Field(64 * 1024**2, ge=0, description="most bytes of stored responses (each one's output and own input, as JSON), and as many of conversations' items")
    responses_file: Path | None = Field(None, description="keep stored responses and conversations across a restart: written to this file (owner-only) at a graceful stop, and while running every responses_save_interval_s in which they changed, and read back at start; none = memory only")
    responses_save_interval_s: float = Field(30.0, ge=0, description="with responses_file: seconds between writes while the stores or the background responses running change (what a killed process can lose; a run it had reads failed after a restart); 0 = at a graceful stop only")
    cors_origins: list[str] = Field(["localhost"], description="in-process engine (no runtime behind it): origins whose web pages may call KVStream from a browser: localhost (any port on localhost, 127.0.0.1, [::1]), exact origins (https://app.example.com), or * for any; in front of a runtime its own CORS policy answers")
    runtime_metrics: bool = Field(True, description="carry the runtime's own Prometheus families (llama-server with --metrics, vLLM, SGLang) on /metrics after KVStream's, read at scrape time; several replicas' labelled kvstream_backend")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: Any) -> Any:
        return split_list(value)


class Settings(BaseSettings):
    """The whole configuration. Build it with ``load_settings`` to get the layered sources."""

    model_config = SettingsConfigDict(extra="forbid", validate_assignment=True)

    backend: BackendSettings = Field(default_factory=BackendSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    prefix_cache: PrefixCacheSettings = Field(default_factory=PrefixCacheSettings)
    attention: AttentionSettings = Field(default_factory=AttentionSettings)
    matmul: MatmulSettings = Field(default_factory=MatmulSettings)
    awq: AWQSettings = Field(default_factory=AWQSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)
    backends: list[UpstreamEntry] = Field(default_factory=list, description="several upstreams of any mix of types, each request routed to one (see routing); replaces backend.type/base_url/replicas")

    @field_validator("backends", mode="before")
    @classmethod
    def _backends_json(cls, value: Any) -> Any:
        if isinstance(value, str):  # KVSTREAM_BACKENDS: the list as JSON
            try:
                return json.loads(value)
            except ValueError:
                raise ValueError("KVSTREAM_BACKENDS must be a JSON list of {type, url, ...} objects") from None
        return value

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, **_sources):  # type: ignore[override]
        # load_settings merges the layers itself so that it can tell where each value came
        # from; the model only validates the merged result.
        return (init_settings,)

    def with_overrides(self, **values: Any) -> Settings:
        """A validated copy with ``key=value`` overrides, each key naming a setting of exactly
        one section (``request_timeout_s=0.5``, ``num_gpu_blocks=64``): the keyword form a
        backend constructor takes. Raises TypeError for an unknown key, ConfigError for a bad
        value."""
        if not values:
            return self
        merged = self.model_dump()
        for key, value in values.items():
            owners = [name for name, model in SECTIONS.items() if key in model.model_fields]
            if len(owners) != 1:
                raise TypeError(f"unknown setting {key!r}")
            merged[owners[0]][key] = value
        try:
            # Secrets dump as SecretStr objects, which validate back unchanged.
            return Settings(**merged)
        except ValidationError as exc:
            error = exc.errors()[0]
            raise ConfigError(f"invalid setting {'.'.join(str(p) for p in error['loc'][:2])}: {_said(error)}") from None

    def accepted_keys(self) -> list[str]:
        """Every API key from ``server.api_keys`` and ``server.api_keys_file``."""
        keys = [k.get_secret_value() for k in self.server.api_keys]
        if self.server.api_keys_file is not None:
            text = self.server.api_keys_file.read_text()
            keys += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
        return keys


# The keyed sections; ``backends`` (a list, not a section of keys) is handled apart.
LIST_SETTINGS = ("backends",)
SECTIONS: dict[str, type[BaseModel]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in Settings.model_fields.items()
    if name not in LIST_SETTINGS
}


def default(section: str, key: str) -> Any:
    """The one default of ``section.key``, for code that takes the setting as a plain
    argument (the in-process engine's library API) rather than the Settings object."""
    return SECTIONS[section].model_fields[key].default


def env_layer(environ: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str], str]]:
    """The KVSTREAM_* variables as a nested dict, and the variable behind each key."""
    layer: dict[str, dict[str, Any]] = {}
    origin: dict[tuple[str, str], str] = {}
    for name, value in environ.items():
        if name in SHORT_ENV:
            path = SHORT_ENV[name]
        elif name.startswith(ENV_PREFIX) and "__" in name:
            section, _, key = name[len(ENV_PREFIX) :].lower().partition("__")
            if section not in SECTIONS or key not in SECTIONS[section].model_fields:
                raise ConfigError(f"{name}: unknown setting {section}.{key}")
            path = (section, key)
        else:
            continue
        # The long form wins over the short one when both are set.
        if path in origin and name in SHORT_ENV:
            continue
        layer.setdefault(path[0], {})[path[1]] = value
        origin[path] = name
    return layer, origin


def yaml_layer(path: Path) -> dict[str, dict[str, Any]]:
    """The YAML file as a nested dict (an empty file is no settings)."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections")
    for section, values in data.items():
        if section in LIST_SETTINGS:
            if values is not None and not isinstance(values, list):
                raise ConfigError(f"{path}: '{section}' must be a list")
            continue
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section '{section}'")
        if values is None:
            data[section] = {}
        elif not isinstance(values, dict):
            raise ConfigError(f"{path}: section '{section}' must be a mapping")
    return data


class LoadedSettings(BaseModel):
    """Validated settings plus the source of each value (``section.key`` -> where)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    settings: Settings
    sources: dict[str, str]


def load_settings(
    cli: Mapping[str, Mapping[str, Any]] | None = None,
    config_path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> LoadedSettings:
    """Merge defaults < YAML < environment < CLI and validate. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    cli = {s: {k: v for k, v in values.items() if v is not None} for s, values in (cli or {}).items()}
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
    else:
        path = (cwd or Path.cwd()) / DEFAULT_CONFIG_FILE
    yaml_values = yaml_layer(path) if path.is_file() else {}
    env_values, env_origin = env_layer(environ)

    merged: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    for section, model in SECTIONS.items():
        merged[section] = {}
        for key in model.model_fields:
            for layer, label in ((cli, "cli"), (env_values, "env"), (yaml_values, str(path))):
                if key in layer.get(section, {}):
                    merged[section][key] = layer[section][key]
                    sources[f"{section}.{key}"] = env_origin[(section, key)] if label == "env" else label
                    break
            else:
                sources[f"{section}.{key}"] = "default"
        unknown = set(yaml_values.get(section, {})) - set(model.model_fields)
        if unknown:
            raise ConfigError(f"{path}: unknown setting {section}.{sorted(unknown)[0]}")
    for name in LIST_SETTINGS:
        variable = ENV_PREFIX + name.upper()
        if variable in environ:
            merged[name], sources[name] = environ[variable], variable
        elif yaml_values.get(name) is not None:
            merged[name], sources[name] = yaml_values[name], str(path)
        else:
            sources[name] = "default"
    try:
        settings = Settings(**merged)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(p) for p in error["loc"]]
        key = f"{loc[0]}[{loc[1]}]" + (f".{loc[2]}" if len(loc) > 2 else "") if loc[0] in LIST_SETTINGS and len(loc) > 1 else ".".join(loc[:2])
        where = sources.get(loc[0] if loc[0] in LIST_SETTINGS else key, "?")
        raise ConfigError(f"invalid setting {key} (from {where}): {_said(error)}") from None
    return LoadedSettings(settings=settings, sources=sources)


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` part shown as ``***@``."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if not sep or "@" not in authority:
        return url
    return f"{scheme}://***@{authority.rpartition('@')[2]}{slash}{path}"


def describe(loaded: LoadedSettings) -> list[tuple[str, str, str]]:
    """Rows of (key, value, source) for display; secrets are masked."""
    rows = []
    data = loaded.settings.model_dump()
    for i, entry in enumerate(data.pop("backends")):
        shown = " ".join(f"{k}={redact_url(v) if k == 'url' and v else v}" for k, v in entry.items() if k != "api_key" and v is not None)
        rows.append((f"backends[{i}]", shown + (" api_key=(set, hidden)" if entry["api_key"] else ""), loaded.sources["backends"]))
    for section, values in data.items():
        for key, value in values.items():
            if key in ("api_keys", "api_key"):
                shown = "(none)" if not value else f"({len(value) if isinstance(value, list) else 1} set, hidden)"
            elif key == "base_url" and value:
                shown = redact_url(value)
            else:
                shown = "null" if value is None else str(value)
            rows.append((f"{section}.{key}", shown, loaded.sources[f"{section}.{key}"]))
    return rows
