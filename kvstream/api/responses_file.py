"""Stored responses and conversations kept across a restart: written to one file when the
server stops (``server.responses_file``) and read back when it starts.

Items are written once however many responses share them: a continuation's conversation is
the earlier turns' own item objects (response_store.py), so the file holds a table of
items and each response and conversation lists its items by index into it; read back, the
sharing is the same as before. The file is written whole to a temporary file beside it,
readable by its owner only, and moved over the old one, so that a stop mid-write leaves the
previous file. It is written at a graceful stop (SIGTERM, Ctrl-C) and, while the server
runs, every ``server.responses_save_interval_s`` in which the stores changed
(``keep_saved``), so that a process that is killed loses at most that interval's changes.
Background responses still running are not in the stores (background.py keeps them until
they end): a graceful stop cancels them and writes them cancelled; the periodic writes
include them as they stand, and one read back ``queued`` or ``in_progress`` (the process
that ran it was killed) is stored ``failed``, with the output it had written, a
``server_error`` saying why, and (streamed) a ``response.failed`` event after its last:
a client polling it, or streaming it again, sees it end instead of waiting for ever.

A file that cannot be read (damaged, another version) is set aside as ``<file>.unreadable``
with a warning, and the server starts with empty stores.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstream.api.conversation_store import Conversation, ConversationStore
from kvstream.api.response_store import ResponseStore, StoredResponse
from kvstream.jsonfast import dumps, loads

if TYPE_CHECKING:
    from kvstream.api.background import BackgroundRuns

logger = logging.getLogger(__name__)

VERSION = 1

# The statuses of a response that was still running when the file was written.
RUNNING = frozenset({"queued", "in_progress"})
INTERRUPTED = "The server stopped while this background response ran, before it finished: its output ends where it stopped."

# One write at a time: the stop's write waits for a periodic one still in its thread, and
# then replaces it with what is newer.
_writing = threading.Lock()


def save(path: Path, responses: ResponseStore, conversations: ConversationStore) -> None:
    """Write both stores to ``path`` (the least recently used of each first); a failure is
    logged (the server is stopping: nobody else is left to tell)."""
    try:
        _replace(path, _encode(responses, conversations))
    except OSError as exc:
        logger.error("could not write the stored responses to %s: %s", path, exc)
        return
    logger.info("wrote %d stored responses and %d conversations to %s", len(responses), len(conversations), path)


async def keep_saved(path: Path, responses: ResponseStore, conversations: ConversationStore, interval_s: float,
                     running: BackgroundRuns | None = None) -> None:
    """Write both stores, and the background responses ``running`` as they stand, to
    ``path`` every ``interval_s`` in which any of them changed, until cancelled (the stop's
    ``save`` writes the last state). The encoding runs on the event loop, where they change
    (a snapshot, at most ``server.responses_max_bytes`` of JSON twice over, and the runs'),
    the write and fsync on a thread. A failed write is logged and tried again an interval
    later."""

    def changes() -> tuple[int, int, int]:
        return responses.changes, conversations.changes, running.changes if running is not None else 0

    written = changes()
    while True:
        await asyncio.sleep(interval_s)
        now = changes()
        if now == written:
            continue
        try:
            runs = running.snapshot() if running is not None else []
            await asyncio.to_thread(_replace, path, _encode(responses, conversations, runs))
        except OSError as exc:
            logger.error("could not write the stored responses to %s: %s", path, exc)
            continue
        written = now
        logger.debug("wrote %d stored responses and %d conversations to %s", len(responses), len(conversations), path)


def _encode(responses: ResponseStore, conversations: ConversationStore, running: Iterable[StoredResponse] = ()) -> bytes:
    items: list[dict[str, Any]] = []
    index: dict[int, int] = {}  # id() of an item object -> its place in ``items``

    def refs(objects: Any) -> list[int]:
        places = []
        for item in objects:
            place = index.get(id(item))
            if place is None:
                place = index[id(item)] = len(items)
                items.append(item)
            places.append(place)
        return places

    data = {
        "version": VERSION,
        "responses": [{"response": stored.response | {"output": refs(stored.response["output"])}, "owner": stored.owner,
                       "context": refs(stored.context), "input": refs(stored.input_items), "events": stored.events}
                      for stored in [*responses.values(), *running]],
        "conversations": [{"id": c.id, "owner": c.owner, "metadata": c.metadata, "created_at": c.created_at,
                           "items": refs(c.items)} for c in conversations.values()],
        "items": items,
    }
    return dumps(data)


def _replace(path: Path, data: bytes) -> None:
    """Put ``data`` in ``path``: written beside it, owner-only, fsynced, moved over it."""
    with _writing:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".writing")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)


def _interrupted(response: dict[str, Any], events: tuple[dict[str, Any], ...] | None
                 ) -> tuple[dict[str, Any], tuple[dict[str, Any], ...] | None]:
    """A background response the file kept running, as it ended: failed where it stopped
    (see the module docstring)."""
    failed = response | {"status": "failed", "error": {"code": "server_error", "message": INTERRUPTED}}
    if events is not None:
        events += ({"type": "response.failed", "sequence_number": len(events), "response": failed},)
    return failed, events


def load(path: Path, responses: ResponseStore, conversations: ConversationStore) -> None:
    """Read ``path`` into the (empty) stores, within their bounds; nothing if there is no
    file; a file that cannot be read is set aside (see the module docstring)."""
    directory = path.parent
    if not os.access(directory if directory.exists() else directory.parent, os.W_OK):
        logger.error("%s is not writable: stored responses will not be kept across a restart", directory)
    if not path.exists():
        return
    try:
        data = loads(path.read_bytes())
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} responses file")
        items = data["items"]
        for entry in data["responses"]:
            response = entry["response"] | {"output": [items[i] for i in entry["response"]["output"]]}
            events = tuple(entry["events"]) if entry["events"] is not None else None
            if response.get("status") in RUNNING:
                response, events = _interrupted(response, events)
            responses.put(entry["owner"], response, tuple(items[i] for i in entry["context"]),
                          tuple(items[i] for i in entry["input"]), events)
        for entry in data["conversations"]:
            conversations.restore(Conversation(entry["id"], entry["owner"], entry["metadata"], entry["created_at"]),
                                  [items[i] for i in entry["items"]])
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        aside = path.with_name(path.name + ".unreadable")
        logger.warning("could not read the stored responses in %s (%s): set aside as %s, starting with none",
                       path, exc, aside)
        responses.clear()
        conversations.clear()
        try:
            os.replace(path, aside)
        except OSError as move:
            logger.error("could not set %s aside: %s", path, move)
        return
    logger.info("read %d stored responses and %d conversations from %s", len(responses), len(conversations), path)
