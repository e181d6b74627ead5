"""``kvstream``: serve, config show."""

from __future__ import annotations

import asyncio
import errno
import logging
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from kvstream import __version__
from kvstream.config import ConfigError, LoadedSettings, describe, load_settings

app = typer.Typer(no_args_is_help=True, add_completion=False, help="KVStream: a KV-aware proxy for local LLM runtimes.")
config_app = typer.Typer(no_args_is_help=True, help="Inspect the configuration.")
app.add_typer(config_app, name="config")
awq_app = typer.Typer(no_args_is_help=True, help="AWQ 4-bit checkpoints for the in-process engine.")
app.add_typer(awq_app, name="awq")

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="YAML config file (default: ./kvstream.yaml)")]


def _load(cli: dict[str, dict[str, Any]], config: Path | None) -> LoadedSettings:
    try:
        return load_settings(cli, config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None


# Flags that act only with one backend or one mode, as (section, key) -> flag. Given on the
# command line where they would do nothing, they are refused rather than ignored: a user who
# types --staging copy without --awq-streaming, or --dtype in front of Ollama, means something
# that would not happen. (Config files and the environment may carry them: a file describes
# every setting, whichever backend runs.)
HF_FLAGS = {
    ("backend", "gguf_file"): "--gguf-file", ("backend", "device"): "--device", ("memory", "dtype"): "--dtype",
    ("backend", "tool_call_syntax"): "--tool-call-syntax", ("backend", "default_max_tokens"): "--default-max-tokens",
    ("backend", "served_model_name"): "--served-model-name", ("backend", "seed"): "--seed",
    ("memory", "kv_dtype"): "--kv-dtype", ("memory", "half_weights"): "--half-weights/--no-half-weights",
    ("memory", "kv_cache_bytes"): "--max-cache-bytes", ("memory", "host_cache_bytes"): "--host-cache-bytes",
    ("memory", "kv_cache_bits"): "--kv-cache-bits", ("memory", "disk_cache_dir"): "--disk-cache-dir",
    ("prefix_cache", "reuse"): "--reuse", ("prefix_cache", "blend_ratio"): "--blend-ratio",
    ("attention", "backend"): "--attention-backend", ("matmul", "backend"): "--matmul-backend", ("awq", "streaming"): "--awq-streaming",
}
STREAMING_FLAGS = {
    ("awq", "mode"): "--streaming-mode", ("awq", "keep_first_k"): "--keep-first-k", ("awq", "keep_last_k"): "--keep-last-k",
    ("awq", "staging_slots"): "--staging-slots", ("awq", "drop_page_cache"): "--drop-page-cache", ("awq", "staging"): "--staging",
    ("awq", "stream_embeddings"): "--stream-embeddings",
}
LLAMACPP_FLAGS = {("backend", "slot_save_path"): "--slot-save-path"}
# Flags for the in-process engine or a llama-server KVStream starts.
MODEL_FLAGS = {("backend", "chat_template"): "--chat-template"}


def inert_flag(cli: dict[str, dict[str, Any]], settings: Any) -> str | None:
    """Why a flag given on the command line would have no effect with these settings, or None.
    ``auto`` may pick any backend, so nothing is refused for it."""
    given = {(section, key) for section, values in cli.items() for key, value in values.items() if value is not None}
    kind = settings.backend.type
    for flags, backend in ((HF_FLAGS, "hf"), (STREAMING_FLAGS, "hf"), (LLAMACPP_FLAGS, "llamacpp")):
        stray = [flag for where, flag in flags.items() if where in given]
        if stray and kind not in (backend, "auto"):
            return f"{stray[0]} is for --backend {backend}; the {kind} backend would ignore it"
    stray = [flag for where, flag in MODEL_FLAGS.items() if where in given]
    if stray and kind not in ("hf", "llamacpp", "auto"):
        return f"{stray[0]} is for --backend hf or llamacpp; the {kind} backend would ignore it"
    stray = [flag for where, flag in STREAMING_FLAGS.items() if where in given]
    if stray and not settings.awq.streaming:
        return f"{stray[0]} needs --awq-streaming (awq.streaming); without it the flag would be ignored"
    return None


@app.command()
def serve(
    backend: Annotated[Optional[str], typer.Option(help="ollama | llamacpp | lmstudio | foundry | openai | hf | auto")] = None,
    backend_url: Annotated[Optional[list[str]], typer.Option(help="the runtime's URL (default: the runtime's own); repeat it for several replicas, among which requests are routed")] = None,
    routing: Annotated[Optional[str], typer.Option(help="with several replicas: cache_aware | least_loaded | round_robin")] = None,
    model: Annotated[Optional[str], typer.Option(help="model to serve (default: the runtime's); llamacpp: a .gguf to run; hf: a folder, hub id or .gguf (default: the embedded SmolLM2)")] = None,
    gguf_file: Annotated[Optional[str], typer.Option(help="hf: the .gguf file inside the --model folder")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="hf: the name the model is listed and answered under (vLLM's --served-model-name, llama-server's --alias)")] = None,
    default_max_tokens: Annotated[Optional[int], typer.Option(help="hf: tokens generated by a request that sets no bound (llama-server's --n-predict; default: up to the end of the context)")] = None,
    seed: Annotated[Optional[int], typer.Option(help="hf: the sampling seed of every request that sets none (llama-server's --seed; -1 or unset: a random one per request)")] = None,
    chat_template: Annotated[Optional[Path], typer.Option(help="hf, or llamacpp with --model FILE.gguf: a Jinja chat template file to use instead of the model's own")] = None,
    tool_call_syntax: Annotated[Optional[str], typer.Option(help="hf: how the model's tool calls are read: auto (what its template shows; generic where it shows no tools) | hermes | qwen3_xml | llama3_json | mistral | granite | deepseek | pythonic | generic | none")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="hf: auto | float32 | float16 | bfloat16")] = None,
    device: Annotated[Optional[str], typer.Option(help="hf: auto | cpu | cuda")] = None,
    kv_dtype: Annotated[Optional[str], typer.Option(help="hf: the KV pool's dtype: auto (the model's) | float32 | float16 | bfloat16 (half the pool bytes under a float32 model)")] = None,
    half_weights: Annotated[Optional[bool], typer.Option("--half-weights/--no-half-weights", help="hf, CPU float32: hold a bfloat16/float16 checkpoint's linear layers and embeddings as stored (default on)")] = None,
    slot_save_path: Annotated[Optional[Path], typer.Option(help="llamacpp: the server's slot directory (enables hard KV inject)")] = None,
    responses_file: Annotated[Optional[Path], typer.Option(help="keep the Responses API's stored responses and conversations across restarts in this file (written at a graceful stop and every server.responses_save_interval_s, 30 s, in which they changed)")] = None,
    host: Annotated[Optional[str], typer.Option(help="address to bind (default 127.0.0.1)")] = None,
    port: Annotated[Optional[int], typer.Option(help="port to listen on (default 8080)")] = None,
    max_batch_size: Annotated[Optional[int], typer.Option(help="most requests in flight at once (default auto: 8 in front of a runtime, hf: sized from the KV pool)")] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(help="hf: most tokens in one forward pass; longer prompts are prefilled in chunks (default 2048)")] = None,
    prefill_step_ms: Annotated[Optional[int], typer.Option(help="hf: while sequences decode, a step prefills as many prompt tokens as keep it to about this long (default 500; 0 = max-num-batched-tokens)")] = None,
    num_gpu_blocks: Annotated[Optional[str], typer.Option(help="KV blocks in the pool, or auto")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="tokens per KV block: 8, 16 or 32")] = None,
    max_cache_bytes: Annotated[Optional[int], typer.Option(help="hf: bytes of the device KV pool (the prefix cache's budget)")] = None,
    host_cache_bytes: Annotated[Optional[int], typer.Option(help="hf: host RAM for cached KV blocks the pool reclaims (0 = none)")] = None,
    kv_cache_bits: Annotated[Optional[int], typer.Option(help="hf: keep spilled and swapped KV blocks KIVI-quantized to 8 or 4 bits")] = None,
    disk_cache_dir: Annotated[Optional[Path], typer.Option(help="hf: directory of the disk KV tier (survives restarts)")] = None,
    reuse: Annotated[Optional[str], typer.Option(help="hf: exact | blend (also reuse moved chunks, approximately)")] = None,
    attention_backend: Annotated[Optional[str], typer.Option(help="hf: auto | flash | native | flex | sdpa | eager (auto: the fastest tier that agrees with eager at start)")] = None,
    matmul_backend: Annotated[Optional[str], typer.Option(help="hf: auto | native | torch: the linear layers' kernel for decode-sized batches (auto: native where it builds and agrees with torch; torch also keeps transformers' own norms and rotary)")] = None,
    blend_ratio: Annotated[Optional[float], typer.Option(help="hf: share of moved tokens the blend repair recomputes (default 0.15)")] = None,
    warm: Annotated[Optional[list[str]], typer.Option(help="a system prompt to prefill at start (repeatable)")] = None,
    awq_streaming: Annotated[Optional[bool], typer.Option("--awq-streaming", help="hf, an AWQ folder as --model: stream decoder layers from the checkpoint")] = None,
    streaming_mode: Annotated[Optional[str], typer.Option(help="with --awq-streaming: partial_resident | ffn_only_stream | full_stream | full_resident")] = None,
    keep_first_k: Annotated[Optional[int], typer.Option(help="with --awq-streaming: first decoder layers kept resident (default 2)")] = None,
    keep_last_k: Annotated[Optional[int], typer.Option(help="with --awq-streaming: last decoder layers kept resident (default 2)")] = None,
    staging_slots: Annotated[Optional[int], typer.Option(help="with --awq-streaming: layers staged at once, slots - 1 prefetched ahead (default 2)")] = None,
    drop_page_cache: Annotated[Optional[bool], typer.Option("--drop-page-cache", help="with --awq-streaming: drop streamed layers' checkpoint pages once staged")] = None,
    staging: Annotated[Optional[str], typer.Option(help="with --awq-streaming on CPU: mapped (default; compute from the mapped checkpoint, no copies) | copy (into the staging slots first); on CUDA always copies from pinned host memory")] = None,
    stream_embeddings: Annotated[Optional[bool], typer.Option("--stream-embeddings/--no-stream-embeddings", help="with --awq-streaming: read the token embeddings and LM head from the mapped checkpoint too (the head reads its whole table every token); default: on the CPU where the head keeps its table as stored")] = None,
    config: ConfigOpt = None,
    log_level: Annotated[str, typer.Option(help="debug | info | warning")] = "info",
) -> None:
    """Start the proxy in front of a runtime."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cli = {
        "backend": {
            "type": backend, "base_url": backend_url[0] if backend_url else None,
            "replicas": backend_url if backend_url and len(backend_url) > 1 else None,
            "model": model, "slot_save_path": slot_save_path,
            "gguf_file": gguf_file, "default_max_tokens": default_max_tokens, "served_model_name": served_model_name, "seed": seed, "device": device, "chat_template": chat_template, "tool_call_syntax": tool_call_syntax,
        },
        "server": {"host": host, "port": port, "responses_file": responses_file},
        "routing": {"policy": routing},
        "awq": {"streaming": awq_streaming, "mode": streaming_mode, "keep_first_k": keep_first_k, "keep_last_k": keep_last_k, "staging_slots": staging_slots, "drop_page_cache": drop_page_cache,
                "staging": staging, "stream_embeddings": stream_embeddings},
        "scheduler": {"max_batch_size": max_batch_size, "max_num_batched_tokens": max_num_batched_tokens,
                      "prefill_step_ms": prefill_step_ms},
        "prefix_cache": {"warm": warm or None, "reuse": reuse, "blend_ratio": blend_ratio},
        "attention": {"backend": attention_backend},
        "matmul": {"backend": matmul_backend},
        "memory": {
            "num_gpu_blocks": num_gpu_blocks, "block_size": block_size, "dtype": dtype,
            "kv_cache_bytes": max_cache_bytes, "host_cache_bytes": host_cache_bytes, "kv_cache_bits": kv_cache_bits, "disk_cache_dir": disk_cache_dir,
            "half_weights": half_weights, "kv_dtype": kv_dtype,
        },
    }
    loaded = _load(cli, config)
    why = inert_flag(cli, loaded.settings)
    if why is not None:
        print(f"config error: {why}", file=sys.stderr)
        raise typer.Exit(2)
    from kvstream.cli.serve import run

    try:
        asyncio.run(run(loaded.settings))
    except KeyboardInterrupt:
        pass
    except SystemExit:
        raise
    except OSError as exc:
        hint = ""
        if exc.errno == errno.EADDRINUSE:  # llama-server and KVStream both default to 8080
            hint = (f" (something already listens on port {loaded.settings.server.port}: another KVStream, or a "
                    "runtime on its default port; start KVStream with --port N)")
        print(f"cannot start: {exc}{hint}", file=sys.stderr)
        raise typer.Exit(1) from None


@config_app.command("show")
def config_show(
    config: ConfigOpt = None,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Print the effective configuration and where each value came from."""
    loaded = _load({}, config)
    rows = describe(loaded)
    if json_out:
        import json

        print(json.dumps({key: {"value": value, "source": source} for key, value, source in rows}, indent=2))
        return
    table = Table(title="KVStream configuration", show_lines=False)
    table.add_column("key")
    table.add_column("value")
    table.add_column("source", style="dim")
    for key, value, source in rows:
        table.add_row(key, value, source)
    Console().print(table)


@app.command()
def status(
    url: Annotated[str, typer.Option(help="KVStream's address", envvar="KVSTREAM_URL")] = "http://127.0.0.1:8080",
    watch: Annotated[bool, typer.Option("--watch", "-w", help="live dashboard, refreshed in place")] = False,
    interval: Annotated[float, typer.Option(help="seconds between refreshes with --watch")] = 1.0,
    json_out: Annotated[bool, typer.Option("--json", help="print the raw /status snapshot")] = False,
    api_key: Annotated[Optional[str], typer.Option(help="API key, if KVStream requires one", envvar="KVSTREAM_API_KEY")] = None,
) -> None:
    """Show what a running KVStream is doing."""
    from kvstream.cli.status import run as run_status

    raise typer.Exit(run_status(url, watch, interval, json_out, api_key))


@app.command()
def bench(
    url: Annotated[str, typer.Option(help="OpenAI-compatible base URL (KVStream or the runtime itself)")] = "http://127.0.0.1:8080",
    model: Annotated[Optional[str], typer.Option(help="model (default: the first the server lists)")] = None,
    concurrency: Annotated[int, typer.Option(help="most requests (or conversations) in flight")] = 8,
    total_requests: Annotated[Optional[int], typer.Option(help="requests to send (default: the dataset's size)")] = None,
    duration: Annotated[Optional[float], typer.Option(help="send for this many seconds instead")] = None,
    request_rate: Annotated[Optional[float], typer.Option(help="Poisson arrivals per second (default: closed loop)")] = None,
    prompt_len: Annotated[int, typer.Option(help="prompt (or shared prefix / system prompt) length, tokens")] = 256,
    output_len: Annotated[int, typer.Option(help="max_tokens per request")] = 64,
    dataset: Annotated[str, typer.Option(help="random | prefix-repetition | multi-turn | FILE.jsonl")] = "random",
    num_prompts: Annotated[int, typer.Option(help="requests in a generated dataset")] = 64,
    num_prefixes: Annotated[int, typer.Option(help="prefix-repetition: distinct shared prefixes")] = 4,
    suffix_len: Annotated[int, typer.Option(help="prefix-repetition: per-request suffix; multi-turn: user turn length")] = 32,
    conversations: Annotated[int, typer.Option(help="multi-turn: conversations")] = 4,
    turns: Annotated[int, typer.Option(help="multi-turn: turns per conversation")] = 5,
    seed: Annotated[int, typer.Option(help="seed for datasets and arrivals")] = 0,
    stream: Annotated[bool, typer.Option("--stream/--no-stream", help="stream responses (TTFT and ITL need it)")] = True,
    warmup: Annotated[int, typer.Option(help="short requests sent first, not measured")] = 2,
    timeout: Annotated[float, typer.Option(help="per-request timeout, seconds")] = 600.0,
    compare: Annotated[Optional[str], typer.Option(help="a second URL: the same workload (each server its own copy, prompts marked [A] / [B], in alternating rounds), both columns and ratios")] = None,
    json_file: Annotated[Optional[Path], typer.Option("--json", help="write the results (vLLM's keys) to this file")] = None,
    plot_file: Annotated[Optional[Path], typer.Option("--plot", help="draw latency CDFs (and TTFT per turn) to this PNG")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="ask the server to generate exactly output-len tokens (llama.cpp, vLLM)")] = False,
    api_key: Annotated[Optional[str], typer.Option(help="API key to send", envvar="KVSTREAM_API_KEY")] = None,
) -> None:
    """Load-test an OpenAI-compatible server; compare two with --compare."""
    from kvstream.bench.runner import Load
    from kvstream.cli.bench import Workload, run as run_bench

    if total_requests is not None and duration is not None:
        print("give --total-requests or --duration, not both", file=sys.stderr)
        raise typer.Exit(2)
    workload = Workload(dataset, num_prompts, prompt_len, output_len, num_prefixes, suffix_len, conversations, turns, seed)
    try:
        workload.build()
    except ValueError as exc:
        print(exc, file=sys.stderr)
        raise typer.Exit(2) from None
    load = Load(concurrency, request_rate, total_requests, duration, seed)
    urls = [url] + ([compare] if compare else [])
    extra = {"ignore_eos": True} if ignore_eos else {}
    raise typer.Exit(run_bench(urls, model, api_key, workload, load, stream, warmup, timeout, json_file, plot_file, extra))


@awq_app.command("quantize")
def awq_quantize(
    out: Annotated[Path, typer.Option(help="folder to write the AWQ checkpoint to")],
    model: Annotated[Optional[str], typer.Option(help="an HF model folder (default: the embedded SmolLM2)")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="input channels per scale: 32, 64 or 128 (default: the largest that divides every projection)")] = None,
    calibration: Annotated[Optional[Path], typer.Option(help="a text file to calibrate on (default: Python's standard library documentation)")] = None,
    method: Annotated[str, typer.Option(help="awq (activation-aware scale and clipping search) | rtn (round to nearest only)")] = "awq",
    samples: Annotated[int, typer.Option(help="calibration chunks of 256 tokens")] = 32,
    evaluate: Annotated[bool, typer.Option("--eval", help="print perplexity on held-out text: the original model and the checkpoint")] = False,
) -> None:
    """Make an AWQ checkpoint (AutoAWQ's GEMM layout) from an HF model."""
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvstream.cli.awq import quantize

    raise typer.Exit(quantize(out, model, group_size, calibration, method, samples, evaluate))


@awq_app.command("align")
def awq_align(
    folder: Annotated[Path, typer.Argument(help="an AWQ checkpoint folder (its safetensors files are rewritten in place)")],
) -> None:
    """Pad the checkpoint's safetensors headers so that its packed tensors start 32-byte aligned
    (what `kvstream awq quantize` writes): `--staging mapped` then reads them ~1.1x faster."""
    from kvstream.cli.awq import align

    raise typer.Exit(align(folder))


@app.command()
def version() -> None:
    """Print KVStream's version."""
    print(__version__)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
