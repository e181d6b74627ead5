"""``kvstream bench``: run a workload against one URL (or two, with --compare) and print the
summary vLLM's ``bench serve`` prints, with ratios when comparing."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstream.bench import datasets
from kvstream.bench.metrics import RequestResult, calculate, ttft_by_turn
from kvstream.bench.runner import Load, Target, discover_model, run_conversations, run_requests


@dataclass
class Workload:
    """The dataset choice and its parameters."""

    dataset: str = "random"
    num_requests: int = 100
    prompt_len: int = 256
    output_len: int = 64
    num_prefixes: int = 4
    suffix_len: int = 32
    conversations: int = 4
    turns: int = 5
    seed: int = 0

    def build(self) -> list[datasets.BenchRequest] | list[datasets.Conversation]:
        if self.dataset == "random":
            return datasets.random_dataset(self.num_requests, self.prompt_len, self.output_len, self.seed)
        if self.dataset == "prefix-repetition":
            return datasets.prefix_repetition_dataset(self.num_requests, self.num_prefixes, self.prompt_len, self.suffix_len, self.output_len, self.seed)
        if self.dataset == "multi-turn":
            return datasets.multi_turn_dataset(self.conversations, self.turns, self.prompt_len, self.suffix_len, self.output_len, self.seed)
        path = Path(self.dataset)
        if path.suffix == ".jsonl" and path.is_file():
            return datasets.file_dataset(path, self.num_requests, self.output_len)
        raise ValueError(f"unknown dataset {self.dataset!r}: random, prefix-repetition, multi-turn or a FILE.jsonl")


async def bench_one(target: Target, items: list, multi_turn: bool, load: Load, results: list[RequestResult], progress: Progress | None) -> float:
    """Run ``items`` once against ``target``; results fill ``results`` as they finish."""
    expected = (load.total_requests or len(items)) if not load.duration else None
    if multi_turn:
        expected = sum(len(c.user_turns) for c in items)
    task_id = progress.add_task(target.url, total=expected) if progress else None

    def done(_: RequestResult) -> None:
        if progress is not None:
            progress.advance(task_id)

    if multi_turn:
        return await run_conversations(target, items, load, results, done)
    return await run_requests(target, items, load, results, done)


MARKERS = ("[A] ", "[B] ")  # one per compared server; equal lengths keep the copies equal in tokens


def rounds(items: list, targets: int, multi_turn: bool, load: Load) -> list[tuple[int, list, Load]]:
    """What to send to which target, in order: ``(target index, items, load)``.

    One target: the workload once. Two (``--compare``, most often KVStream and the runtime
    behind it, so one runtime's caches serve both): each gets its own copy of the workload,
    every prompt marked ``[A]`` or ``[B]``, so that neither is served prefixes the other
    computed (the second would otherwise find the first's prompts cached and look faster);
    the copies run in alternating rounds over halves, A, B, A, B, so that each round but the
    first starts where the other server's round left the runtime's slots, for both alike."""
    if targets == 1:
        return [(0, items, load)]
    if load.total_requests is not None and not multi_turn:  # the rounds split the whole count
        items = [items[i % len(items)] for i in range(load.total_requests)]
    copies = [datasets.marked(items, marker) for marker in MARKERS]
    if load.duration or len(items) < 2:
        return [(i, copies[i], load) for i in (0, 1)]
    half = len(items) // 2
    halves = Load(load.concurrency, load.request_rate, None, None, load.seed)
    return [(i, copies[i][part], halves) for part in (slice(None, half), slice(half, None)) for i in (0, 1)]


ROWS = [
    ("Successful requests", "completed", "{:,.0f}"),
    ("Failed requests", "failed", "{:,.0f}"),
    ("Benchmark duration (s)", "duration", "{:,.2f}"),
    ("Total input tokens", "total_input_tokens", "{:,.0f}"),
    ("Total generated tokens", "total_output_tokens", "{:,.0f}"),
    ("Request throughput (req/s)", "request_throughput", "{:,.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:,.2f}"),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:,.2f}"),
    *[(f"{stat.capitalize()} {name.upper()} (ms)", f"{stat}_{name}_ms", "{:,.2f}")
      for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")],
    ("Mean queue time (ms, KVStream)", "mean_queue_ms", "{:,.2f}"),
    ("Prefix-hit tokens (KVStream)", "prefix_hit_tokens", "{:,.0f}"),
    ("Runtime cached tokens (usage)", "cached_tokens", "{:,.0f}"),
]


def summary_table(named: list[tuple[str, dict[str, Any]]]) -> Table:
    """The result block; with two columns, a ratio column (second / first)."""
    table = Table(title="Serving Benchmark Result", show_lines=False)
    table.add_column("metric")
    for name, _ in named:
        table.add_column(name, justify="right")
    if len(named) == 2:
        table.add_column("ratio", justify="right")
        table.caption = "each server ran its own copy of the workload (prompts marked [A] / [B]), in alternating rounds"
    for label, key, fmt in ROWS:
        values = [m.get(key) for _, m in named]
        if all(v is None for v in values):
            continue
        cells = ["-" if v is None else fmt.format(v) for v in values]
        if len(named) == 2:
            a, b = values
            cells.append(f"{b / a:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else "-")
        table.add_row(label, *cells)
    for name, m in named:
        if m.get("errors"):
            table.add_row(f"errors ({name})", *([", ".join(f"{k}: {v}" for k, v in m["errors"].items())] + [""] * (len(named) - 1 + (len(named) == 2))))
    return table


def plot(path: Path, named: list[tuple[str, list[RequestResult]]], multi_turn: bool) -> None:
    """Latency CDFs (TTFT, E2EL) and, for multi-turn, TTFT per turn. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if multi_turn else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    for name, results in named:
        ok = [r for r in results if r.success]
        for ax, values, title in ((axes[0], [r.ttft * 1000 for r in ok if r.ttft is not None], "TTFT (ms)"), (axes[1], [r.latency * 1000 for r in ok], "E2E latency (ms)")):
            values = sorted(values)
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
            ax.set_xlabel(title)
            ax.set_ylabel("fraction of requests")
            ax.grid(alpha=0.3)
        if multi_turn:
            by_turn = ttft_by_turn(results)
            axes[2].plot([t + 1 for t in by_turn], list(by_turn.values()), marker="o", label=name)
            axes[2].set_xlabel("turn")
            axes[2].set_ylabel("median TTFT (ms)")
            axes[2].grid(alpha=0.3)
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(urls: list[str], model: str | None, api_key: str | None, workload: Workload, load: Load, stream: bool, warmup: int,
        timeout: float, json_path: Path | None, plot_path: Path | None, extra_body: dict[str, Any], console: Console | None = None) -> int:
    """The command: returns the exit status (1 if any request failed, as a load test should)."""
    console = console or Console()
    collected: list[tuple[str, list[RequestResult], float]] = []

    multi_turn = workload.dataset == "multi-turn"

    async def main() -> None:
        targets = []
        for url in urls:
            base = url.rstrip("/").removesuffix("/v1")
            targets.append(Target(base, model or await discover_model(base, api_key), api_key, stream, timeout, extra_body))
            collected.append((url, [], 0.0))
        for target in targets:
            if warmup:
                sample = datasets.random_dataset(warmup, 16, 4, workload.seed + 1)
                await run_requests(target, sample, Load(concurrency=min(warmup, load.concurrency)), [])
        items = workload.build()
        for i, chunk, chunk_load in rounds(items, len(targets), multi_turn, load):
            url, results, elapsed = collected[i]
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, transient=True) as progress:
                elapsed += await bench_one(targets[i], chunk, multi_turn, chunk_load, results, progress)
            collected[i] = (url, results, elapsed)

    interrupted = False
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        interrupted = True
        console.print("[yellow]interrupted: partial results[/yellow]")
    named = []
    for url, results, duration in collected:
        if not duration and results:
            duration = max(r.started + r.latency for r in results) - min(r.started for r in results)
        named.append((url, calculate(results, duration or 1e-9)))
    if not named:
        return 130 if interrupted else 1
    console.print(summary_table(named))
    if multi_turn:
        for url, results, _ in collected:
            turns = ttft_by_turn(results)
            console.print(f"median TTFT per turn ({url}): " + ", ".join(f"{t + 1}: {v:,.0f} ms" for t, v in turns.items()))
    if json_path is not None:
        out: dict[str, Any] = dict(named[0][1]) | {"url": named[0][0], "dataset": workload.dataset, "max_concurrency": load.concurrency,
                                                      "request_rate": load.request_rate or "inf"}
        if len(named) == 2:
            out["compare"] = dict(named[1][1]) | {"url": named[1][0]}
        if multi_turn:
            out["ttft_by_turn_ms"] = {str(t): v for t, v in ttft_by_turn(collected[0][1]).items()}
        json_path.write_text(json.dumps(out, indent=2))
    if plot_path is not None:
        try:
            plot(plot_path, [(u, r) for u, r, _ in collected], multi_turn)
        except ImportError:
            console.print("[yellow]--plot needs matplotlib: pip install 'kvstream[plot]'[/yellow]")
    if interrupted:
        return 130
    return 1 if any(m["failed"] for _, m in named) else 0
