"""``kvstream``: serve, config show."""

from __future__ import annotations

import asyncio
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

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="YAML config file (default: ./kvstream.yaml)")]


def _load(cli: dict[str, dict[str, Any]], config: Path | None) -> LoadedSettings:
    try:
        return load_settings(cli, config)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from None


@app.command()
def serve(
    backend: Annotated[Optional[str], typer.Option(help="ollama | llamacpp | lmstudio | foundry | openai | auto")] = None,
    backend_url: Annotated[Optional[str], typer.Option(help="the runtime's URL (default: the runtime's own)")] = None,
    model: Annotated[Optional[str], typer.Option(help="model to serve (default: the runtime's); llamacpp: a .gguf to run")] = None,
    slot_save_path: Annotated[Optional[Path], typer.Option(help="llamacpp: the server's slot directory (enables hard KV inject)")] = None,
    host: Annotated[Optional[str], typer.Option(help="address to bind (default 127.0.0.1)")] = None,
    port: Annotated[Optional[int], typer.Option(help="port to listen on (default 8080)")] = None,
    max_batch_size: Annotated[Optional[int], typer.Option(help="most requests in flight upstream")] = None,
    num_gpu_blocks: Annotated[Optional[str], typer.Option(help="KV blocks in the pool, or auto")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="tokens per KV block: 8, 16 or 32")] = None,
    config: ConfigOpt = None,
    log_level: Annotated[str, typer.Option(help="debug | info | warning")] = "info",
) -> None:
    """Start the proxy in front of a runtime."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cli = {
        "backend": {"type": backend, "base_url": backend_url, "model": model, "slot_save_path": slot_save_path},
        "server": {"host": host, "port": port},
        "scheduler": {"max_batch_size": max_batch_size},
        "memory": {"num_gpu_blocks": num_gpu_blocks, "block_size": block_size},
    }
    loaded = _load(cli, config)
    from kvstream.cli.serve import run

    try:
        asyncio.run(run(loaded.settings))
    except KeyboardInterrupt:
        pass
    except SystemExit:
        raise
    except OSError as exc:
        print(f"cannot start: {exc}", file=sys.stderr)
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
def version() -> None:
    """Print KVStream's version."""
    print(__version__)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
