"""``kvstream status``: one snapshot of a running KVStream, or a live dashboard (``--watch``).

Reads ``GET /status`` (and ``/metrics`` for counters that move, such as errors). An
unreachable proxy is shown as such and retried; Ctrl-C leaves cleanly.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

SPARK = "▁▂▃▄▅▆▇█"


def fetch_status(url: str, api_key: str | None, timeout: float = 3.0) -> dict[str, Any]:
    """GET {url}/status; raises OSError (unreachable) or ValueError (not KVStream)."""
    request = urllib.request.Request(url.rstrip("/") + "/status")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise PermissionError("KVStream needs an API key (--api-key or KVSTREAM_API_KEY)") from None
        raise OSError(f"HTTP {exc.code}") from None


def sparkline(values: list[float], width: int = 30) -> str:
    """A unicode sparkline of the last ``width`` values, scaled to their own maximum."""
    values = values[-width:]
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1)))] for v in values)


@dataclass
class History:
    """Recent snapshots, for sparklines and rates."""

    points: deque = field(default_factory=lambda: deque(maxlen=120))

    def add(self, snap: dict[str, Any]) -> None:
        self.points.append((time.monotonic(), snap))

    def series(self, *path: str) -> list[float]:
        out = []
        for _, snap in self.points:
            value: Any = snap
            for key in path:
                value = (value or {}).get(key)
            out.append(float(value or 0))
        return out

    def rate(self, *path: str) -> list[float]:
        """Per-second increase of a counter between consecutive snapshots."""
        pts = list(self.points)
        values = self.series(*path)
        return [max(0.0, (values[i] - values[i - 1]) / max(1e-6, pts[i][0] - pts[i - 1][0])) for i in range(1, len(values))]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f} ms"


class Flow:
    """Parts laid out left to right, two spaces apart, on as many lines as the width needs:
    a part moves to the next line whole (a rich grid cell squeezes its text into a narrow
    column instead, breaking "p90 1,841 ms" in two on an 80-column terminal)."""

    def __init__(self, *parts: str | Text) -> None:
        texts = (part if isinstance(part, Text) else Text(part) for part in parts)
        self.parts = [text for text in texts if text.cell_len]  # an empty part takes no room

    def lines(self, width: int) -> list[Text]:
        lines = [Text()]
        for part in self.parts:
            line = lines[-1]
            if line.cell_len and line.cell_len + 2 + part.cell_len > width:
                line = Text()
                lines.append(line)
            if line.cell_len:
                line.append("  ")
            line.append_text(part)
        return lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.lines(options.max_width)  # (a part wider than a line wraps as text does)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest = max((part.cell_len for part in self.parts), default=0)
        whole = sum(part.cell_len for part in self.parts) + 2 * max(len(self.parts) - 1, 0)
        return Measurement(min(widest, options.max_width), min(whole, options.max_width))


def _rows() -> Table:
    """A label column and a value column (``Flow``s) that wraps under its own start."""
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True)
    table.add_column()
    return table


def render(snap: dict[str, Any], history: History | None = None, url: str = "") -> Group:
    """The dashboard for one snapshot (pure: testable with a recorded payload)."""
    backend = snap.get("backend", {})
    queue, kv, prefix, reqs, recent = snap.get("queue", {}), snap.get("kv", {}), snap.get("prefix_cache", {}), snap.get("requests", {}), snap.get("recent", {})
    ready = backend.get("ready")
    head = Flow(
        Text.assemble(("KVStream ", "bold"), (url, "dim")),
        Text.assemble("backend ", (str(backend.get("type")), "cyan"), " ", (str(backend.get("model") or ""), "cyan")),
        Text("● ready" if ready else "● backend down", style="green" if ready else "red"),
        f"up {snap.get('uptime_s', 0):,.0f}s",
    )
    rows = _rows()
    rows.add_row("queue", Flow(f"running {queue.get('running', 0)} / {queue.get('max_batch_size', '?')}",
                               f"waiting {queue.get('waiting', 0)}", f"swapped {queue.get('swapped', 0)}",
                               f"oldest wait {queue.get('oldest_wait_s', 0):.1f}s"))
    total = kv.get("blocks_total") or 1
    used = kv.get("blocks_used", 0)
    rows.add_row(
        "KV blocks" + (" (estimated)" if kv.get("estimated") else ""),
        Group(ProgressBar(total=total, completed=used, width=24),
              Flow(f"{used}/{total} used", f"{kv.get('blocks_cached', 0)} cached"
                   + (f" ({kv['blocks_retained']} retained)" if kv.get("blocks_retained") else ""),
                   f"{kv.get('block_size')} tokens/block")),
    )
    rows.add_row("prefix cache", Flow(f"hit ratio {prefix.get('hit_ratio', 0):.1%}",
                                      f"{prefix.get('hit_tokens', 0):,} of {prefix.get('query_tokens', 0):,} prompt tokens"))
    pre = snap.get("preemption", {})
    rows.add_row("preemption", Flow(f"{pre.get('preemptions', 0)} preempted",
                                    f"swap out {pre.get('swap_outs', 0)} / in {pre.get('swap_ins', 0)}"))
    decode = "-" if recent.get("decode_tokens_per_s_p50") is None else f"{recent['decode_tokens_per_s_p50']:.0f} tok/s"
    rows.add_row(f"last {recent.get('window_s', 60):.0f}s",
                 Flow(f"{recent.get('requests', 0)} requests",
                      f"TTFT p50 {_ms(recent.get('ttft_p50_s'))}, p90 {_ms(recent.get('ttft_p90_s'))}",
                      f"e2e p50 {_ms(recent.get('e2e_p50_s'))}", f"decode p50 {decode}"))
    rejected = reqs.get("rejected", {})
    rows.add_row("requests", Flow(f"{reqs.get('total', 0):,} total", f"{reqs.get('finished', 0):,} finished",
                                  Text(f"{reqs.get('failed', 0):,} failed", style="red" if reqs.get("failed") else ""),
                                  f"{reqs.get('cancelled', 0):,} cancelled", f"{reqs.get('refused', 0):,} refused",
                                  "rejected " + (", ".join(f"{k} {v}" for k, v in rejected.items()) or "0")))
    inject = backend.get("hard_inject")
    if inject and not inject.get("enabled") and not inject.get("restores") and not inject.get("saves"):
        # Never on: its counters say nothing; why it is off says what to do.
        rows.add_row("hard inject", Flow(Text("off", style="yellow"), inject.get("off_reason") or ""))
    elif inject:
        rows.add_row("hard inject", Flow(
            "on" if inject.get("enabled") else Text(f"off: {inject.get('off_reason') or 'disabled'}", style="yellow"),
            f"{inject.get('restores', 0)} restores",
            Text(f"{inject.get('restore_failures', 0)} failed", style="red" if inject.get("restore_failures") else ""),
            f"{inject.get('saves', 0)} saves", f"{inject.get('files', 0)} files, {inject.get('bytes_on_disk', 0) / 1e6:,.0f} MB",
            f"{inject.get('slot_waits', 0)} slot waits",
            *(["runtime's cache " + ("trusted" if inject["runtime_cache_trusted"] else "missed: files restore")]
              if "runtime_cache_trusted" in inject else [])))
    _in_process_engine(backend, rows)
    stored, conversations = snap.get("responses") or {}, snap.get("conversations") or {}
    if stored.get("stored") or stored.get("running") or conversations.get("stored"):
        rows.add_row("responses", Flow(f"{stored.get('stored', 0):,} stored ({_mb(stored.get('bytes', 0))})",
                                       f"{stored.get('running', 0)} running in the background",
                                       f"{conversations.get('stored', 0):,} conversations"))
    parts: list[Any] = [head, rows]
    replicas = backend.get("replicas")
    if replicas:
        t = Table.grid(padding=(0, 2))
        for replica in replicas:
            engine = replica.get("engine") or {}
            if "running" in engine:  # a vLLM / SGLang replica's own report
                usage = engine.get("kv_usage")
                told = f"engine {engine['running']} running, {engine.get('waiting', 0)} waiting" + (f", KV {usage:.0%}" if usage is not None else "")
            else:
                told = engine.get("metrics", "")
            t.add_row(
                Text("●", style="green" if replica.get("healthy") else "red"), f"{replica.get('type', '')} {replica.get('url')}",
                f"{replica.get('in_flight', 0)} / {replica.get('slots', '?')} in flight",
                f"w {replica.get('weight', 1):g}", f"{replica.get('requests', 0):,} requests",
                Text(f"{replica.get('failures', 0)} failures", style="red" if replica.get("failures") else ""), told,
            )
        parts.append(Panel(t, title=f"replicas ({backend.get('routing')})", title_align="left"))
    if history is not None and len(history.points) > 1:
        spark = Table.grid(padding=(0, 2))
        spark.add_row("running", Text(sparkline(history.series("queue", "running")), style="cyan"))
        spark.add_row("waiting", Text(sparkline(history.series("queue", "waiting")), style="yellow"))
        spark.add_row("KV used", Text(sparkline(history.series("kv", "blocks_used")), style="magenta"))
        spark.add_row("tokens/s", Text(sparkline(history.rate("requests", "generation_tokens")), style="green"))
        parts.append(Panel(spark, title="history", title_align="left"))
    return Group(*parts)


def _mb(value: Any) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f} MB"


def _in_process_engine(backend: dict[str, Any], rows: Table) -> None:
    """Adds the in-process engine's rows (``--backend hf``): what computes, and the weights
    (AWQ layer streaming: what stays resident, what is read per token, stalls); none for a
    runtime behind the proxy."""
    weights = backend.get("weights")
    if "attention_backend" in backend:
        rows.add_row("engine", Flow(f"{backend.get('device')} {backend.get('dtype')}, KV {backend.get('kv_dtype')}",
                                    f"attention {backend['attention_backend']}", f"matmul {backend.get('matmul_backend')}",
                                    f"{backend.get('steps', 0):,} steps"))
    pacing = backend.get("prefill_pacing")
    if pacing and pacing.get("step_ms"):
        rate = pacing.get("tokens_per_s")
        rows.add_row("prefill", Flow(f"paced to {pacing['step_ms']} ms steps while decoding",
                                     f"{pacing.get('tokens_beside_decodes')} prompt tokens a step",
                                     "rate unmeasured" if rate is None else f"{rate:,.0f} tok/s"))
    if weights:
        kind = weights.get("format", "?") + (f" ({weights['kernel']} kernel)" if weights.get("kernel") else "")
        cells: list[str | Text] = [kind, f"{_mb(weights.get('resident_bytes'))} resident"]
        if weights.get("mapped_bytes"):
            cells.append(f"{_mb(weights['mapped_bytes'])} embeddings mapped")
        if "staging" in weights:  # layers streamed
            per_token = weights.get("bytes_staged_per_token")
            stall_s = weights.get("stall_seconds_total") or 0
            cells += [f"{weights.get('mode')}, {weights['staging']}, K {weights.get('keep_first_k')}+{weights.get('keep_last_k')}",
                      f"{_mb(weights.get('streamed_bytes'))} streamed a forward",
                      "-" if per_token is None else f"{_mb(per_token)} a token",
                      Text(f"stalls {stall_s:.2f}s", style="yellow" if stall_s else "")]
        rows.add_row("weights", Flow(*cells))


def render_unreachable(url: str, error: str, retrying: bool = False) -> Panel:
    tail = "retrying..." if retrying else "is KVStream running there? (kvstream serve)"
    return Panel(Text.assemble(("unreachable ", "bold red"), url, "\n", (error, "dim"), "\n", tail), title="KVStream")


def run(url: str, watch: bool, interval: float, as_json: bool, api_key: str | None, console: Console | None = None,
        iterations: int | None = None) -> int:
    """The command; returns the exit status. ``iterations`` bounds --watch (for tests)."""
    console = console or Console()
    if not watch:
        try:
            snap = fetch_status(url, api_key)
        except PermissionError as exc:
            console.print(f"[red]{exc}[/red]")
            return 2
        except (OSError, ValueError) as exc:
            if as_json:
                print(json.dumps({"error": f"unreachable: {exc}", "url": url}))
            else:
                console.print(render_unreachable(url, str(exc)))
            return 1
        if as_json:
            print(json.dumps(snap, indent=2))
        else:
            console.print(render(snap, url=url))
        return 0
    from rich.live import Live

    history = History()
    try:
        with Live(console=console, screen=console.is_terminal, refresh_per_second=4, transient=False) as live:
            while iterations is None or iterations > 0:
                if iterations is not None:
                    iterations -= 1
                try:
                    snap = fetch_status(url, api_key)
                    history.add(snap)
                    live.update(render(snap, history, url))
                except PermissionError as exc:
                    live.update(Text(str(exc), style="red"))
                    return 2
                except (OSError, ValueError) as exc:
                    live.update(render_unreachable(url, str(exc), retrying=True))
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0
