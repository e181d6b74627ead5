"""The runtime's own Prometheus metrics, carried on KVStream's ``/metrics`` after its own.

A user who scraped llama-server's (or vLLM's, SGLang's) ``/metrics`` and puts KVStream in
front of it keeps the same scrape target: KVStream's ``/metrics`` answers with its own
families followed by the runtime's, read at scrape time. One runtime's text goes through as
it came (names, types, help and samples untouched, its response headers too, such as
llama-server's ``Process-Start-Time-Unix``); the families of several replicas are merged, one
header per family and every sample labelled ``kvstream_backend="<replica URL>"``, since the
same names from two runtimes would otherwise be two families in one exposition. A family
whose name KVStream's own output already has is left out (none today: KVStream's names all
start ``kvstream_``): a name must mean one thing in one scrape. A runtime that serves no metrics (llama-server
without ``--metrics`` answers 501), answers slowly or not at all, or answers something other
than Prometheus text adds nothing: KVStream's own metrics never wait on it for long.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from kvstream.backends.http import UpstreamSession

logger = logging.getLogger(__name__)

# Longest a scrape of KVStream waits for the runtime's metrics (Prometheus' own scrape
# timeout defaults to 10 s; KVStream's families must not be the ones that miss it).
SCRAPE_TIMEOUT_S = 2.0
MAX_BYTES = 8 * 1024 * 1024
REPLICA_LABEL = "kvstream_backend"
# Headers of the runtime's answer that describe the connection or the body KVStream sends,
# not the runtime's metrics; its CORS headers (access-control-*) stay behind too: KVStream's
# own route answers for its origin policy.
NOT_CARRIED = frozenset(
    {
        "connection", "keep-alive", "transfer-encoding", "trailer", "upgrade", "content-type", "content-length",
        "content-encoding", "date", "server", "via", "vary",
    }
)
_COMMENT = re.compile(r"#\s+(HELP|TYPE)\s+(\S+)")


@dataclass
class RuntimeScrape:
    """One runtime's answer: its base URL, Prometheus text and carried headers."""

    url: str
    text: str
    headers: dict[str, str] = field(default_factory=dict)


async def scrape(session: UpstreamSession | None, path: str | None, url: str) -> RuntimeScrape | None:
    """The runtime's Prometheus text at ``path``, or None when it has none to give."""
    if session is None or path is None:
        return None
    try:
        async with session.request("GET", path, headers={"Accept": "text/plain"}, timeout=SCRAPE_TIMEOUT_S) as resp:
            kind = resp.headers.get("Content-Type", "")
            if resp.status != 200 or not kind.startswith("text/plain"):
                logger.debug("%s%s: HTTP %s, %s: not carried on /metrics", url, path, resp.status, kind or "no type")
                return None
            raw = await resp.content.read(MAX_BYTES + 1)
            if len(raw) > MAX_BYTES:
                logger.warning("%s%s is larger than %d bytes: not carried on /metrics", url, path, MAX_BYTES)
                return None
            headers = {
                k: v for k, v in resp.headers.items() if k.lower() not in NOT_CARRIED and not k.lower().startswith("access-control-")
            }
            return RuntimeScrape(url, raw.decode("utf-8", "replace"), headers)
    except Exception as exc:  # noqa: BLE001 - timeouts, refused connections, bad bytes: the scrape adds nothing
        logger.debug("%s%s: %s: not carried on /metrics", url, path, exc)
        return None


def family_names(text: str) -> set[str]:
    """Every family named by a ``# HELP`` or ``# TYPE`` line of an exposition."""
    return {m.group(2) for line in text.splitlines() if (m := _COMMENT.match(line))}


def families(text: str) -> list[tuple[str, list[str], list[str]]]:
    """An exposition as (family name, its HELP/TYPE lines, its sample lines), in order. A
    sample that is not its family's (one before any header, or another name) starts a
    family of its own name (untyped)."""
    out: list[tuple[str, list[str], list[str]]] = []
    current: tuple[str, list[str], list[str]] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            match = _COMMENT.match(line)
            if match is None:
                continue  # a plain comment
            name = match.group(2)
            if current is None or current[0] != name:
                current = (name, [], [])
                out.append(current)
            current[1].append(line)
            continue
        name = _sample_name(line)
        if current is None or not _belongs(name, current[0]):
            current = (name, [], [])
            out.append(current)
        current[2].append(line)
    return out


# What a sample's name may add to its family's (histograms, summaries, counters, info).
_SUFFIXES = ("", "_bucket", "_sum", "_count", "_total", "_created", "_info", "_gsum", "_gcount")


def _belongs(sample: str, family: str) -> bool:
    return any(sample == family + suffix for suffix in _SUFFIXES)


def _sample_name(line: str) -> str:
    end = len(line)
    for stop in ("{", " ", "\t"):
        at = line.find(stop)
        if at != -1:
            end = min(end, at)
    return line[:end]


def labelled(sample: str, name: str, value: str) -> str:
    """``sample`` with the label ``name="value"`` first among its labels."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    metric = _sample_name(sample)
    rest = sample[len(metric) :]
    if rest.startswith("{"):
        inner = rest[1:]
        return f'{metric}{{{name}="{escaped}"{"" if inner.lstrip().startswith("}") else ","}{inner}'
    return f'{metric}{{{name}="{escaped}"}}{rest}'


def merge(own: str, scrapes: list[RuntimeScrape]) -> str:
    """KVStream's exposition ``own`` followed by the runtimes' families (see the module
    docstring): one runtime's as it came, several merged per family and labelled."""
    taken = family_names(own)
    parts = [own if own.endswith("\n") or not own else own + "\n"]
    if len(scrapes) == 1:
        for name, header, samples in families(scrapes[0].text):
            if name not in taken:
                parts.extend(line + "\n" for line in header + samples)
        return "".join(parts)
    merged: dict[str, tuple[list[str], list[str]]] = {}
    for scraped in scrapes:
        for name, header, samples in families(scraped.text):
            if name in taken:
                continue
            entry = merged.setdefault(name, (header, []))
            entry[1].extend(labelled(line, REPLICA_LABEL, scraped.url) for line in samples)
    for header, samples in merged.values():
        parts.extend(line + "\n" for line in header + samples)
    return "".join(parts)
