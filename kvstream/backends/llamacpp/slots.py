"""Slot affinity and slot files for llama-server's hard KV inject (see llamacpp_inject).

llama-server can write a slot's KV cache (with the tokens it holds) to a file and read it
back into any slot (``POST /slots/{id}?action=save|restore``). KVStream saves the state of
long prompts and indexes each file by the chained hashes of its prompt's full blocks. When a
later request shares a long prefix with a saved prompt but no slot holds it (the runtime
restarted, evicted it, or it was computed on another replica that shares the directory),
the file is restored into the chosen slot first, so llama-server computes only the suffix.

Correctness does not depend on the index being right: a slot file carries its own tokens and
llama-server reuses only the longest common token prefix with the new prompt, so a stale or
mismatched file can cost time, never produce a wrong answer. A corrupt file fails to restore
(llama-server answers 400 and clears the slot); it is deleted and the request prefilled.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstream.kv.hashing import block_hashes, model_key

logger = logging.getLogger(__name__)



def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class SlotState:
    """What KVStream believes one llama-server slot holds."""

    id: int
    busy: bool = False
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0
    running: list[int] = field(default_factory=list)  # the prompt running there while busy
    # Tokens it holds that KVStream cannot name: a prompt another client ran there (or one
    # that was there before KVStream started), or one whose slot llama-server chose itself.
    unknown: int = 0
    # KVStream sent (or may have sent) a request here since /slots was last read: a new task
    # id there is its own, not another client's.
    dispatched: bool = False
    # Tokens llama-server reports in /slots after KVStream's last request here (its prompt
    # and all but the last token it generated); None when not known.
    held: int | None = None


@dataclass
class InjectStats:
    """Counters for /status and /metrics."""

    restores: int = 0
    restore_failures: int = 0  # the runtime refused the file (missing, corrupt, no space)
    ineffective: int = 0  # restored, but the next request did not reuse it
    restored_tokens: int = 0
    restored_bytes: int = 0
    saves: int = 0
    saved_bytes: int = 0
    evicted_files: int = 0
    affinity_hits: int = 0  # requests routed to a slot that already held their prefix
    swap_outs: int = 0  # preempted requests whose slot state was saved
    swap_ins: int = 0  # resumed requests whose saved state was restored
    slot_waits: int = 0  # requests that waited for the busy slot running their prefix
    foreign_uses: int = 0  # slots another client ran a prompt in, seen in /slots
    left_to_runtime: int = 0  # requests sent unpinned: a slot held a prompt KVStream could not name
    prefill_samples: int = 0  # requests whose prefill speed was measured


class SlotFileStore:
    """Saved slot files in one directory, indexed by prefix hash, bounded by a byte budget.

    The index lives next to the files (one per model identity, written atomically under a
    lock), so it survives a KVStream restart and is shared by replicas using the directory.
    """

    def __init__(self, directory: Path, identity: str, block_size: int, budget_bytes: int) -> None:
        self.directory = directory
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.salt = model_key(identity)
        self.tag = self.salt.hex()[:12]
        self.index_path = directory / f"kvstream-index-{self.tag}.json"
        self.lock_path = directory / f"kvstream-index-{self.tag}.lock"
        self.identity = identity
        self._files: dict[str, dict] = {}
        self._by_hash: dict[str, list[str]] = {}
        self._mtime = -1.0
        directory.mkdir(parents=True, exist_ok=True)
        self._reload()

    # ---------------------------------------------------------------- index
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                self._reload()
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _reload(self) -> None:
        try:
            mtime = self.index_path.stat().st_mtime
        except FileNotFoundError:
            self._files, self._by_hash, self._mtime = {}, {}, -1.0
            return
        if mtime == self._mtime:
            return
        try:
            data = json.loads(self.index_path.read_text())
            files = data["files"] if data.get("identity") == self.identity else {}
        except (ValueError, KeyError, OSError):
            logger.warning("slot index %s is unreadable; starting a new one", self.index_path)
            files = {}
        self._files = {name: meta for name, meta in files.items() if (self.directory / name).is_file()}
        self._by_hash = {}
        for name, meta in self._files.items():
            for h in meta["hashes"]:
                self._by_hash.setdefault(h, []).append(name)
        self._mtime = mtime

    def _write(self) -> None:
        tmp = self.index_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"identity": self.identity, "files": self._files}))
        os.replace(tmp, self.index_path)
        self._mtime = self.index_path.stat().st_mtime

    # ---------------------------------------------------------------- queries
    def prefix_hashes(self, tokens: Sequence[int], root: bytes | None = None) -> list[str]:
        """The chained hashes that name saved prefixes of ``tokens``; a tenant's ``root``
        makes its files findable only by its own requests."""
        return [h.hex() for h in block_hashes(tokens, self.block_size, self.salt, root)]

    def filename_for(self, tokens: Sequence[int]) -> str:
        """A name derived from the prefix hash only: no user text, no path separators."""
        hashes = self.prefix_hashes(tokens)
        return self.filename_for_hashes(hashes) if hashes else ""

    def filename_for_hashes(self, hashes: Sequence[str]) -> str:
        return f"kvs-{self.tag}-{hashes[-1][:32]}.bin"

    def lookup(self, prompt: Sequence[int]) -> tuple[str, int] | None:
        """The most recently used file holding the longest saved prefix of ``prompt`` (at
        least one token is left for the runtime to compute), and that prefix's length."""
        return self.longest(self.prefix_hashes(prompt[: max(0, len(prompt) - 1)]))

    def covered(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` some saved file already holds."""
        found = self.longest(self.prefix_hashes(prompt))
        return found[1] if found else 0

    def longest(self, hashes: Sequence[str]) -> tuple[str, int] | None:
        """For the block hashes of a token prefix: the most recently used file holding the
        longest indexed part of it, and that part's length in tokens."""
        self._reload()
        for i in range(len(hashes) - 1, -1, -1):
            names = self._by_hash.get(hashes[i])
            if names:
                best = max(names, key=lambda n: self._files[n]["last_used"])
                return best, (i + 1) * self.block_size
        return None

    @property
    def total_bytes(self) -> int:
        return sum(meta["bytes"] for meta in self._files.values())

    def __len__(self) -> int:
        self._reload()
        return len(self._files)

    # --------------------------------------------------------------- updates
    def add(self, name: str, prompt: Sequence[int], nbytes: int, hashes: list[str] | None = None) -> list[str]:
        """Index a file the runtime just wrote; returns the files evicted for the budget."""
        with self._locked():
            hashes = hashes if hashes is not None else self.prefix_hashes(prompt)
            self._files[name] = {"tokens": len(prompt), "bytes": nbytes, "hashes": hashes, "last_used": time.time()}
            evicted = []
            while self.total_bytes > self.budget_bytes and len(self._files) > 1:
                oldest = min((n for n in self._files if n != name), key=lambda n: self._files[n]["last_used"])
                self._drop(oldest)
                evicted.append(oldest)
            if self.total_bytes > self.budget_bytes:  # the new file alone exceeds the budget
                self._drop(name)
                evicted.append(name)
            self._rebuild_hashes()
            self._write()
        return evicted

    def touch(self, name: str) -> None:
        with self._locked():
            if name in self._files:
                self._files[name]["last_used"] = time.time()
                self._write()

    def remove(self, name: str) -> None:
        with self._locked():
            if name in self._files or (self.directory / name).exists():
                self._drop(name)
                self._rebuild_hashes()
                self._write()

    def _drop(self, name: str) -> None:
        self._files.pop(name, None)
        with contextlib.suppress(FileNotFoundError):
            (self.directory / name).unlink()

    def _rebuild_hashes(self) -> None:
        self._by_hash = {}
        for name, meta in self._files.items():
            for h in meta["hashes"]:
                self._by_hash.setdefault(h, []).append(name)


class SlotTable:
    """KVStream's view of llama-server's slots, for affinity routing."""

    def __init__(self, count: int, min_shared: int = 1) -> None:
        """``min_shared``: the fewest shared tokens worth choosing a slot for (see acquire)."""
        self.slots = [SlotState(i) for i in range(count)]
        self.min_shared = min_shared
        self._released = asyncio.Event()

    async def wait_idle(self, timeout: float) -> None:
        """Wait (up to ``timeout``) until some slot is idle. A preempted request keeps its
        slot until its state is saved; the request that preempted it must not start on
        that slot before, or it would overwrite the state being saved."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while all(s.busy for s in self.slots):
            self._released.clear()
            try:
                await asyncio.wait_for(self._released.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return  # someone else shares the runtime: fall back to queueing inside it

    def holder(self, prompt: Sequence[int]) -> tuple[SlotState, int, int] | None:
        """The busy slot whose running prompt shares the most with ``prompt``, the tokens it
        shares, and how many more that is than the best idle slot shares; None when no busy
        slot beats every idle one (nothing to wait for)."""
        idle_best = max((common_prefix(s.tokens, prompt) for s in self.slots if not s.busy), default=0)
        busy = [(common_prefix(s.running, prompt), s) for s in self.slots if s.busy]
        if not busy:
            return None
        shared, slot = max(busy, key=lambda pair: pair[0])
        return (slot, shared, shared - idle_best) if shared > idle_best else None

    async def wait_for(self, slot: SlotState, timeout: float) -> None:
        """Wait (up to ``timeout``) until ``slot`` is idle."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while slot.busy and loop.time() < deadline:
            self._released.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._released.wait(), max(0.0, deadline - loop.time()))

    def acquire(self, prompt: Sequence[int]) -> tuple[SlotState, int]:
        """The idle slot sharing the longest prefix with ``prompt``, marked busy, and the
        length of that shared prefix. A prefix shorter than ``min_shared`` does not count:
        every chat shares its template's first tokens, and choosing by those would put each
        new conversation in the slot of the last one (an empty slot shares nothing),
        evicting it while other slots stay unused. Among equals, the least recently used."""
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            # More in flight than slots (another client shares the runtime): any slot will
            # do, llama-server queues the request behind it.
            idle = list(self.slots)

        def worth(slot: SlotState) -> int:
            shared = common_prefix(slot.tokens, prompt)
            return shared if shared >= self.min_shared else 0

        best = max(idle, key=lambda s: (worth(s), -s.last_used))
        best.busy = best.dispatched = True
        best.running = list(prompt)
        return best, common_prefix(best.tokens, prompt)

    def release(self, slot: SlotState, tokens: list[int] | None, unknown: int = 0, held: int | None = None) -> None:
        """Mark idle; ``tokens`` is what it holds now (None: unknown, so assume nothing),
        ``unknown`` how many tokens it may hold that KVStream cannot name, ``held`` how many
        llama-server will report it holds (see SlotState.held)."""
        slot.busy = False
        slot.tokens = tokens or []
        slot.unknown = unknown
        slot.held = held
        slot.running = []
        slot.last_used = time.monotonic()
        self._released.set()

    def forget(self) -> None:
        """The runtime lost its KV (restart): believe nothing about any slot."""
        for slot in self.slots:
            slot.tokens = []
            slot.unknown = 0
