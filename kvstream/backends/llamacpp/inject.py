"""Hard KV inject for llama-server: route each request to a slot, restore a saved prefix into
it when that saves prefill, verify the runtime used it, and save new long prefixes.

The pieces it drives live in llamacpp_slots (the slot table and the slot-file store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvstream.backends.llamacpp.slots import InjectStats, SlotFileStore, SlotState, SlotTable

logger = logging.getLogger(__name__)

# A verified restore: the next request reused at least the restored prefix, give or take a
# block (llama-server may re-evaluate the tail of what it restored).
RESTORE_SLACK_TOKENS = 16
# Longest a request waits for one of KVStream's slots to be free before sending anyway.
SLOT_WAIT_S = 30.0
# Prompt tokens per second llama-server is assumed to prefill until it was measured (short
# waits for a busy slot until then: see HardInject.prepare).
DEFAULT_PREFILL_TPS = 1000.0
# Block hashes remembered as computed by the running runtime (a bounded LRU).
MAX_SEEN_BLOCKS = 200_000
# Oldest a /slots report read ahead (while the prompt was tokenized) may be when used.
PREFETCH_MAX_AGE_S = 1.0


@dataclass
class Route:
    """One request's placement: its slot, its prompt's block hashes (computed once), what was
    restored into the slot, and how much the runtime's own cache is expected to supply."""

    slot: SlotState
    prompt: list[int]
    hashes: list[str]
    restored: int = 0
    expect_runtime_cache: int = 0
    first_token_s: float | None = None  # from sending the request to its first token
    generated: int | None = None  # completion tokens, once the runtime said
    # Send the request to this slot (id_slot). Off when the runtime's own prompt cache is
    # expected to serve the prefix, or a slot holds a prompt KVStream cannot name that may
    # share more with this one: llama-server then picks the slot itself, from what its
    # slots really hold (another client may have changed them behind KVStream's back).
    pin: bool = True
    # Each slot's task id in /slots when the request was placed: the slot llama-server chose
    # for an unpinned request is one whose task changed since.
    tasks_before: dict[int, int | None] = field(default_factory=dict)


class HardInject:
    """Routes requests to slots and restores or saves slot files around them.

    Used by LlamaCppBackend: ``prepare`` before the request (choose a slot, restore a file
    if it saves prefill), ``finish`` after it (verify the reuse, save new long prefixes,
    release the slot).
    """

    def __init__(
        self,
        http,
        slots: int,
        store: SlotFileStore | None,
        *,
        min_tokens: int = 64,
        save_min_new_tokens: int = 128,
        max_failures: int = 5,
        off_reason: str | None = None,
    ) -> None:
        """``off_reason``: why there is no slot file store, for /status (None with a store)."""
        self.http = http
        self.table = SlotTable(slots, min_shared=min_tokens)
        self.store = store
        self.min_tokens = min_tokens
        self.save_min_new_tokens = save_min_new_tokens
        self.max_failures = max_failures
        self.stats = InjectStats()
        self.enabled = store is not None
        self.off_reason = None if self.enabled else off_reason or "no slot directory"
        self._failures_in_a_row = 0
        # Prefixes (block hashes) this runtime instance has computed since it started, and
        # whether its own host-RAM prompt cache can be trusted to still hold them.
        self._seen: dict[bytes, None] = {}
        self.trust_runtime_cache = True
        self._max_task_seen = -1
        self._tasks: dict[int, int | None] = {}  # slot id -> its task id when /slots was last read
        self._unpinned_in_flight = 0
        self._reported_slots: int | None = None  # how many slots /slots last listed
        # Set when /slots showed the runtime restarted or dropped its KV (a restart is seen
        # only by its empty slots when no task of the old instance was seen); the backend
        # reports it (the runtime may have come back with other limits, its caches empty).
        self.kv_lost = False
        self.prefill_tps = DEFAULT_PREFILL_TPS  # measured: prompt tokens computed per second
        # Bumped whenever KVStream's beliefs about the slots change (a report observed, a
        # slot taken or freed): a report read before a change is older than those beliefs.
        self._epoch = 0
        self._read_ahead: tuple[int, float, asyncio.Task[list[dict[str, Any]] | None]] | None = None

    async def _post(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        async with self.http.request("POST", path, json_body=body or {}, timeout=120) as resp:
            try:
                payload = await resp.json(content_type=None)
            except ValueError:
                payload = {}
            return resp.status, payload if isinstance(payload, dict) else {}

    async def _read_slots(self) -> list[dict[str, Any]] | None:
        """llama-server's /slots entries for the slots KVStream knows (None: unreadable)."""
        try:
            reported = await self.http.get_json("/slots", timeout=10)
        except Exception as exc:
            logger.debug("GET /slots failed: %r", exc)
            return None
        if not isinstance(reported, list):
            return None
        entries = [e for e in reported if isinstance(e, dict) and type(e.get("id")) is int]
        self._reported_slots = len(entries)
        count = len(self.table.slots)
        return [e for e in entries if 0 <= e["id"] < count]

    def read_ahead(self) -> None:
        """Start reading /slots for the next ``prepare`` now, while the request's prompt is
        tokenized (a round trip of about a millisecond off every request's way). ``prepare``
        uses the report only if nothing changed KVStream's beliefs about the slots since it
        was asked for, and it is fresh; otherwise it reads again."""
        ahead = self._read_ahead
        if ahead is not None and ahead[0] == self._epoch and time.monotonic() - ahead[1] < PREFETCH_MAX_AGE_S:
            return  # one asked for since the last change serves this request too
        if ahead is not None and not ahead[2].done():
            ahead[2].cancel()  # stale: nobody will use it
        self._read_ahead = (self._epoch, time.monotonic(), asyncio.ensure_future(self._read_slots()))

    async def _sync_with_runtime(self) -> None:
        """Compare what we believe the slots hold with what llama-server reports (cheap: an
        idle GET /slots takes under a millisecond); see ``_observe``."""
        reported = None
        ahead, self._read_ahead = self._read_ahead, None
        if ahead is not None:
            epoch, asked_at, task = ahead
            if epoch == self._epoch and time.monotonic() - asked_at < PREFETCH_MAX_AGE_S:
                reported = await task
                if epoch != self._epoch:  # beliefs changed while it was read: it may predate them
                    reported = None
            elif not task.done():
                task.cancel()
        if reported is None:
            reported = await self._read_slots()
        if reported is not None:
            self._observe(reported)

    def _observe(self, reported: list[dict[str, Any]], ran: SlotState | None = None) -> None:
        """Update the slot beliefs from a /slots report. ``ran``: the slot an unpinned request
        of KVStream's was found to have run in (its new task is not another client's).

        A slot whose task id changed although KVStream sent nothing there ran another
        client's prompt (one sent to llama-server directly): KVStream forgets what it
        believed the slot holds and notes that it holds that many tokens it cannot name, so
        a request that may share them is left to llama-server's own slot choice (see
        ``_leave_to_runtime``). A slot seen for the first time that already holds tokens (from
        before KVStream started) is noted the same way. A slot holding fewer tokens than we
        believe with no new task, or task ids going backwards, means the runtime restarted or
        dropped its KV: believe nothing about its slots or its own prompt cache then."""
        self._epoch += 1
        was_dispatched = {slot.id: slot.dispatched for slot in self.table.slots}
        tasks = {e["id"]: e.get("id_task") if isinstance(e.get("id_task"), int) else None for e in reported}
        max_task = max((t for t in tasks.values() if t is not None), default=-1)
        restarted, self._max_task_seen = max_task < self._max_task_seen, max_task
        lost = restarted
        now = time.monotonic()
        for entry in reported:
            slot, task = self.table.slots[entry["id"]], tasks[entry["id"]]
            # A slot that never ran a task lists no token counts: it holds nothing.
            held = entry.get("n_prompt_tokens", 0) if isinstance(entry.get("n_prompt_tokens"), int) else 0
            first_sight = slot.id not in self._tasks
            changed = not first_sight and task != self._tasks[slot.id]
            self._tasks[slot.id] = task
            slot.dispatched = slot.busy
            if restarted or slot.busy:
                continue
            # Another client's prompt ran here: KVStream sent nothing here since the last
            # report, or its own request ran and then another (the slot holds another count
            # of tokens than that request left).
            foreign = changed and slot is not ran and (not was_dispatched[slot.id] or (slot.held is not None and held != slot.held))
            if foreign or (first_sight and held and not slot.tokens):
                slot.tokens, slot.unknown, slot.held = [], held, None
                slot.last_used = now  # as in llama-server's own least-recently-used order
                if changed and not self._unpinned_in_flight:
                    self.stats.foreign_uses += 1
            elif not changed and held < len(slot.tokens):
                lost = True
        if lost:
            logger.info("llama-server lost its KV (restart or eviction); slot and prompt-cache beliefs reset")
            self.reset()
            self.kv_lost = True

    def _leave_to_runtime(self, route: Route, shared: int) -> bool:
        """Send ``route`` unpinned: some idle slot holds a prompt KVStream cannot name that is
        long enough to share more with this one than the best slot it knows (``shared``
        tokens). llama-server's own choice (the slot sharing the most, else the least
        recently used) then finds another client's prompt, or leaves it alone when this
        one does not share it; pinned, KVStream would compute a prompt that sits in
        another slot, or overwrite it."""
        want = shared + self.min_tokens
        if len(route.prompt) < want or not any((s is route.slot or not s.busy) and s.unknown >= want for s in self.table.slots):
            return False
        self._unpin(route)
        self.stats.left_to_runtime += 1
        return True

    def _unpin(self, route: Route) -> None:
        route.pin = False
        self._unpinned_in_flight += 1

    def reset(self) -> None:
        """The runtime lost its KV (restart): believe nothing about its slots or its cache.
        Its own prompt cache is trusted again until it misses: a restarted llama-server may
        run with other flags (``--cache-ram``), and one miss settles it again."""
        self.table.forget()
        self._epoch += 1
        self._seen.clear()
        self.trust_runtime_cache = True
        self._max_task_seen = -1  # (a restart already reported is not reported again)

    def _seen_prefix(self, hashes: list[str]) -> int:
        """Tokens of the longest block-hash prefix this runtime instance has computed."""
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in self._seen:
                return (i + 1) * self.block_size
        return 0

    def _remember_seen(self, hashes: list[str]) -> None:
        for h in hashes:
            self._seen.pop(h, None)
            self._seen[h] = None
        while len(self._seen) > MAX_SEEN_BLOCKS:
            self._seen.pop(next(iter(self._seen)))

    def _fail(self, why: str) -> None:
        self._failures_in_a_row += 1
        if self._failures_in_a_row >= self.max_failures and self.enabled:
            self.enabled = False
            self.off_reason = f"{self._failures_in_a_row} restores in a row failed or did nothing"
            logger.error("hard inject disabled after %d failed or ineffective restores in a row (last: %s)", self._failures_in_a_row, why)

    @property
    def block_size(self) -> int:
        return self.store.block_size if self.store is not None else 16

    async def prepare(self, prompt: list[int], swap_file: str | None = None, root: bytes | None = None) -> Route:
        """Pick the slot for ``prompt``; restore a saved prefix into it when that saves work,
        or ``swap_file`` (the state of a preempted request being resumed). ``root``: the
        tenant's chain root; only its own saved prefixes are found, and what it saves is
        found only by it."""
        await self._sync_with_runtime()
        hashes = self.store.prefix_hashes(prompt, root) if self.store is not None else []
        # At least one prompt token is left for the runtime to compute.
        usable = hashes[: max(0, len(prompt) - 1) // self.block_size]
        held = self.table.holder(prompt) if swap_file is None else None
        from_file = False  # the prefix a busy slot runs is restored from its file instead
        if held is not None and held[2] >= self.min_tokens:
            busy_slot, busy_shared, beyond_idle = held
            # A busy slot is running (so will hold) a longer prefix of this prompt than any
            # idle slot. A saved file of (nearly) that prefix restores it into an idle slot
            # in milliseconds: do that. Else wait for the busy slot, at most as long as
            # computing the difference would take (then take an idle slot and compute it),
            # rather than compute the prefix twice at once and evict another.
            found = self.store.longest(usable) if self.enabled and self.store is not None else None
            if found is not None and found[1] + self.min_tokens > busy_shared:
                from_file = True
            else:
                self.stats.slot_waits += 1
                await self.table.wait_for(busy_slot, min(SLOT_WAIT_S, beyond_idle / self.prefill_tps))
        await self.table.wait_idle(SLOT_WAIT_S)
        slot, shared = self.table.acquire(prompt)
        self._epoch += 1
        route = Route(slot, prompt, hashes, tasks_before=dict(self._tasks))
        if swap_file is not None:
            await self._restore_swap(route, swap_file)
            return route
        if self._reported_slots not in (None, len(self.table.slots)):
            # Restarted with another slot count, not yet read again: a slot id may not exist
            # (llama-server then picks a slot itself, but KVStream would believe the wrong one).
            self._unpin(route)
            return route
        if shared >= self.min_tokens:
            self.stats.affinity_hits += 1
        found = self.store.longest(usable) if self.enabled and self.store is not None else None
        if found is None or found[1] < shared + self.min_tokens:
            self._leave_to_runtime(route, shared)
            return route
        seen = self._seen_prefix(usable)
        if self.trust_runtime_cache and seen >= found[1] and not from_file:
            # This runtime computed the prefix since it started: its own host-RAM prompt
            # cache (--cache-ram) restores it faster than a file would. Verified in finish.
            # (Not while a busy slot runs it: llama-server moves a cached prompt into the
            # slot that loads it, so the cache may hold no other copy.)
            route.expect_runtime_cache = seen
            self._unpin(route)
            return route
        name, n_tokens = found
        status, body = await self._post(f"/slots/{slot.id}?action=restore", {"filename": name})
        if status != 200 or int(body.get("n_restored") or 0) < n_tokens:
            self.stats.restore_failures += 1
            logger.warning("restore of %s into slot %d failed (HTTP %s: %s); prefilling instead", name, slot.id, status, body.get("error", body))
            await self._post(f"/slots/{slot.id}?action=erase")
            slot.tokens, slot.unknown = [], 0
            self.store.remove(name)
            self._fail(f"HTTP {status}")
            return route
        self.stats.restores += 1
        self.stats.restored_tokens += n_tokens
        self.stats.restored_bytes += int(body.get("n_read") or 0)
        self.store.touch(name)
        slot.tokens, slot.unknown = list(prompt[:n_tokens]), 0
        route.restored = n_tokens
        return route

    async def finish(self, route: Route, cached: int | None, completed: bool) -> None:
        """Verify a restore (or the runtime's own cache) was used, save a new long prefix,
        release the slot. ``completed``: the runtime has the prompt's KV (it produced at
        least one token); ``cached``: prompt tokens it reports having reused."""
        prompt = route.prompt
        ran: SlotState | None = route.slot if route.pin else None  # the slot it ran in, when known
        try:
            if not route.pin and completed:
                ran = await self._slot_that_ran(route)
            if route.restored and cached is not None:
                if cached + RESTORE_SLACK_TOKENS < min(route.restored, len(prompt) - 1):
                    self.stats.ineffective += 1
                    self._fail(f"restored {route.restored} tokens but the runtime reused {cached}")
                else:
                    self._failures_in_a_row = 0
            expected = route.expect_runtime_cache
            if expected and cached is not None and self.trust_runtime_cache:
                # One miss settles it: the prefix was in no busy slot (prepare restores from
                # the file then), so a working host-RAM cache held a copy. Believing in a
                # cache that is off costs a whole prefill per request; doubting one that is
                # on, a file restore of a few milliseconds instead of a memory copy. (A hit
                # proves little: the slot llama-server chose may have held the prefix.)
                if cached + RESTORE_SLACK_TOKENS < min(expected, len(prompt) - 1):
                    self.trust_runtime_cache = False
                    logger.info("llama-server's own prompt cache missed a prefix it computed (--cache-ram 0?); restoring from slot files instead")
            if completed:
                self._remember_seen(route.hashes)
                computed = len(prompt) - (cached or 0)
                if route.first_token_s and computed >= self.min_tokens:
                    rate = computed / route.first_token_s
                    self.prefill_tps = 0.7 * self.prefill_tps + 0.3 * rate if self.stats.prefill_samples else rate
                    self.stats.prefill_samples += 1
            if completed and ran is not None and self.enabled and self.store is not None and len(prompt) >= self.min_tokens:
                found = self.store.longest(route.hashes)
                if (found[1] if found else 0) + self.save_min_new_tokens <= len(prompt):
                    await self._save(route, ran)
        finally:
            self._release(route, ran if completed else None)

    def _release(self, route: Route, ran: SlotState | None) -> None:
        """Release the route's slot, believing the prompt is in ``ran`` (None: unknown)."""
        self._epoch += 1
        held = self._held_after(route) if ran is not None else None
        if not route.pin:
            self._unpinned_in_flight -= 1
        if route.pin or ran is route.slot:
            self.table.release(route.slot, route.prompt if ran is not None else None, held=held)
        elif ran is not None:  # llama-server chose another slot: this one holds what it held
            ran.tokens, ran.unknown, ran.held, ran.last_used = list(route.prompt), 0, held, time.monotonic()
            self.table.release(route.slot, route.slot.tokens, route.slot.unknown, route.slot.held)
        else:
            # The runtime chose a slot KVStream could not tell: this one may hold the prompt.
            self.table.release(route.slot, None, unknown=len(route.prompt))

    @staticmethod
    def _held_after(route: Route) -> int | None:
        """The token count /slots reports for the slot a request ran in (its prompt and all
        but the last generated token), when the runtime said how many it generated."""
        return len(route.prompt) + route.generated - 1 if route.generated else None

    async def _slot_that_ran(self, route: Route) -> SlotState | None:
        """The slot llama-server chose for an unpinned request that completed: the one slot
        whose task changed since the request was placed and that holds as many tokens as the
        request left (at least its prompt when the runtime did not say how many it generated),
        not running another of KVStream's requests. None when no one slot fits (another
        request finished meanwhile); the slot beliefs are updated from the same report."""
        reported = await self._read_slots()
        if reported is None:
            return None
        expected = self._held_after(route)
        candidates = []
        for entry in reported:
            slot = self.table.slots[entry["id"]]
            held = entry.get("n_prompt_tokens")
            if (
                (slot is route.slot or not slot.busy)
                and entry.get("id_task") != route.tasks_before.get(slot.id)
                and isinstance(held, int) and (held == expected if expected is not None else held >= len(route.prompt))
            ):
                candidates.append(slot)
        ran = candidates[0] if len(candidates) == 1 else None
        self._observe(reported, ran=ran)
        return ran

    async def _restore_swap(self, route: Route, name: str) -> None:
        status, body = await self._post(f"/slots/{route.slot.id}?action=restore", {"filename": name})
        self.discard_swap(name)
        if status != 200:
            # The resumed request is prefilled instead: slower, never wrong.
            logger.warning("restoring swapped state %s failed (HTTP %s); recomputing", name, status)
            await self._post(f"/slots/{route.slot.id}?action=erase")
            return
        n = int(body.get("n_restored") or 0)
        self.stats.swap_ins += 1
        self.stats.restored_bytes += int(body.get("n_read") or 0)
        route.slot.tokens, route.slot.unknown = list(route.prompt[:n]), 0
        route.restored = min(n, len(route.prompt) - 1)

    async def suspend(self, route: Route, save: bool) -> str | None:
        """A running request was preempted: once llama-server has stopped its task, save the
        slot (prompt and tokens so far) to a swap file and release the slot. Returns the
        file name, or None when nothing was saved (the resumed leg then recomputes).

        An unpinned request (served from the runtime's own cache) may have run in another
        slot than ``route.slot``; the file then holds another prompt's state, and the resumed
        leg reuses only what it shares with it: slower, never wrong."""
        name = None
        try:
            if save and self.store is not None and await self._wait_slot_stopped(route.slot.id):
                candidate = f"kvstream-swap-{self.store.tag}-{uuid.uuid4().hex}.bin"
                status, body = await self._post(f"/slots/{route.slot.id}?action=save", {"filename": candidate})
                if status == 200:
                    name = candidate
                    self.stats.swap_outs += 1
                    self.stats.saved_bytes += int(body.get("n_written") or 0)
                else:
                    logger.warning("saving preempted slot %d failed (HTTP %s)", route.slot.id, status)
        finally:
            self._release(route, None)
        return name

    async def _wait_slot_stopped(self, slot_id: int, timeout: float = 10.0) -> bool:
        """Poll /slots until llama-server has noticed the closed connection and stopped."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            try:
                reported = await self.http.get_json("/slots", timeout=5)
            except Exception:
                return False
            entry = None
            if isinstance(reported, list):
                entry = next((e for e in reported if isinstance(e, dict) and e.get("id") == slot_id), None)
            if entry is None or not entry.get("is_processing"):
                return entry is not None
            await asyncio.sleep(0.01)
        return False

    def discard_swap(self, name: str) -> None:
        """Delete a swap file (resumed, or its request ended while paused)."""
        if self.store is None or not name.startswith("kvstream-swap-") or "/" in name:
            return
        with contextlib.suppress(FileNotFoundError):
            (self.store.directory / name).unlink()

    async def _save(self, route: Route, slot: SlotState) -> None:
        """Save ``slot`` (holding the route's prompt) to the file its prefix hashes name."""
        assert self.store is not None
        if not route.hashes:
            return
        name = self.store.filename_for_hashes(route.hashes)
        status, body = await self._post(f"/slots/{slot.id}?action=save", {"filename": name})
        if status != 200:
            logger.warning("saving slot %d failed (HTTP %s: %s)", slot.id, status, body.get("error", body))
            return
        nbytes = int(body.get("n_written") or 0)
        evicted = self.store.add(name, route.prompt, nbytes, route.hashes)
        self.stats.saves += 1
        self.stats.saved_bytes += nbytes
        self.stats.evicted_files += len(evicted)

    def snapshot(self) -> dict:
        s = self.stats
        return {
            "enabled": self.enabled,
            "off_reason": self.off_reason,
            "restores": s.restores,
            "restore_failures": s.restore_failures,
            "ineffective_restores": s.ineffective,
            "restored_tokens": s.restored_tokens,
            "saves": s.saves,
            "files": len(self.store) if self.store is not None else 0,
            "bytes_on_disk": self.store.total_bytes if self.store is not None else 0,
            "affinity_hits": s.affinity_hits,
            "swap_outs": s.swap_outs,
            "swap_ins": s.swap_ins,
            "slot_waits": s.slot_waits,
            "foreign_slot_uses": s.foreign_uses,
            "left_to_runtime": s.left_to_runtime,
            "prefill_tokens_per_s": round(self.prefill_tps, 1),
            # False once llama-server's own prompt cache missed a prefix it computed.
            "runtime_cache_trusted": self.trust_runtime_cache,
        }


def inject_metric_families(inject: HardInject) -> Iterator[Any]:
    """Prometheus series of hard KV inject, read at scrape time."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    s = inject.stats
    yield GaugeMetricFamily("kvstream_hard_inject_enabled", "1 while hard KV inject (slot save/restore) is on.", value=1.0 if inject.enabled else 0.0)
    yield GaugeMetricFamily("kvstream_hard_inject_runtime_cache_trusted",
                            "1 while llama-server's own prompt cache is trusted with prefixes it computed (0 once it missed one).",
                            value=1.0 if inject.trust_runtime_cache else 0.0)
    restores = CounterMetricFamily("kvstream_hard_inject_restores", "Slot-file restores, by result.", labels=["result"])
    restores.add_metric(["ok"], s.restores)
    restores.add_metric(["failed"], s.restore_failures)
    restores.add_metric(["ineffective"], s.ineffective)
    yield restores
    yield CounterMetricFamily("kvstream_hard_inject_restored_tokens", "Prompt tokens restored instead of prefilled.", value=s.restored_tokens)
    yield CounterMetricFamily("kvstream_hard_inject_restored_bytes", "Bytes of KV state read back into slots.", value=s.restored_bytes)
    yield CounterMetricFamily("kvstream_hard_inject_saves", "Slot states saved to disk.", value=s.saves)
    yield CounterMetricFamily("kvstream_hard_inject_saved_bytes", "Bytes of KV state written to disk.", value=s.saved_bytes)
    yield CounterMetricFamily("kvstream_hard_inject_evicted_files", "Slot files deleted for the byte budget.", value=s.evicted_files)
    yield CounterMetricFamily("kvstream_slot_affinity_hits", "Requests routed to a slot already holding their prefix.", value=s.affinity_hits)
    yield CounterMetricFamily("kvstream_slot_waits", "Requests that waited for the busy slot running their prefix rather than evict another.", value=s.slot_waits)
    yield CounterMetricFamily("kvstream_slot_foreign_uses",
                              "Slots seen in /slots to have run a prompt KVStream did not send there (another client of the runtime).",
                              value=s.foreign_uses)
    yield CounterMetricFamily("kvstream_slot_left_to_runtime",
                              "Requests sent without a slot: a slot held a prompt KVStream could not name, so llama-server chose.",
                              value=s.left_to_runtime)
    store = inject.store
    yield GaugeMetricFamily("kvstream_hard_inject_disk_bytes", "Bytes of slot files on disk.", value=store.total_bytes if store is not None else 0)
