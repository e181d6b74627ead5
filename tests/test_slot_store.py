"""SlotFileStore without a runtime: prefix lookup, coverage, LRU budget, an index shared
between two stores on one directory, and names that carry no user text."""

from __future__ import annotations

import asyncio

import re

from kvstream.backends.llamacpp.slots import SlotFileStore


def make(tmp_path, budget=10_000, identity="model|build|4096"):
    return SlotFileStore(tmp_path, identity, block_size=4, budget_bytes=budget)


def save(store, tmp_path, tokens, nbytes=1000):
    name = store.filename_for(tokens)
    (tmp_path / name).write_bytes(b"x" * nbytes)
    return name, store.add(name, tokens, nbytes)


def test_lookup_leaves_a_token_to_compute_and_covered_does_not(tmp_path):
    store = make(tmp_path)
    name, _ = save(store, tmp_path, list(range(8)))
    assert store.lookup(list(range(8))) == (name, 4)  # 8 tokens cached: the 8th must run
    assert store.lookup(list(range(8)) + [99]) == (name, 8)
    assert store.covered(list(range(8))) == 8
    assert store.lookup([5, 5, 5, 5, 5]) is None
    assert re.fullmatch(r"kvs-[0-9a-f]{12}-[0-9a-f]{32}\.bin", name)


def test_budget_evicts_least_recently_used_and_deletes_files(tmp_path):
    store = make(tmp_path, budget=2500)
    a, _ = save(store, tmp_path, [1, 1, 1, 1, 9])
    b, _ = save(store, tmp_path, [2, 2, 2, 2, 9])
    store.touch(a)
    c, evicted = save(store, tmp_path, [3, 3, 3, 3, 9])
    assert evicted == [b] and not (tmp_path / b).exists()
    assert store.total_bytes <= 2500 and len(store) == 2


def test_two_stores_share_the_index_and_other_identities_are_ignored(tmp_path):
    first, second = make(tmp_path), make(tmp_path)
    name, _ = save(first, tmp_path, list(range(8)))
    assert second.lookup(list(range(9))) == (name, 8)  # written by the other replica
    assert make(tmp_path, identity="other|build|4096").lookup(list(range(9))) is None
    (tmp_path / name).unlink()
    assert make(tmp_path).lookup(list(range(9))) is None  # a missing file is dropped on load


def test_a_tenants_saved_prefix_is_found_only_under_its_root(tmp_path):
    """Issue 18, item 7: slot files saved for one API key are named by hashes chained from
    its root, so another key's identical prompt neither finds nor confirms them."""
    from kvstream.kv.hashing import tenant_root

    store = make(tmp_path)
    alice, bob = tenant_root("alice"), tenant_root("bob")
    prompt = list(range(9))
    hashes = store.prefix_hashes(prompt, alice)
    name = store.filename_for_hashes(hashes)
    (tmp_path / name).write_bytes(b"x" * 100)
    store.add(name, prompt, 100, hashes)
    assert store.longest(store.prefix_hashes(prompt, alice)) == (name, 8)
    assert store.longest(store.prefix_hashes(prompt, bob)) is None
    assert store.longest(store.prefix_hashes(prompt)) is None


async def test_a_busy_slot_running_a_longer_prefix_is_worth_waiting_for():
    import asyncio

    from kvstream.backends.llamacpp.slots import SlotTable

    table = SlotTable(2)
    running, _ = table.acquire([1, 2, 3, 4, 5, 6])
    assert table.holder([1, 2, 3, 4, 9]) == (running, 4, 4)  # the idle slot shares nothing
    assert table.holder([7, 8]) is None
    (idle,) = [s for s in table.slots if not s.busy]
    idle.tokens = [1, 2, 7]
    assert table.holder([1, 2, 3, 4, 9]) == (running, 4, 2)  # 4 shared, 2 more than the idle slot
    assert table.holder([1, 2, 7, 8]) is None
    idle.tokens = []
    waiter = asyncio.ensure_future(table.wait_for(running, 5.0))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    table.release(running, [1, 2, 3, 4, 5, 6, 10])
    await asyncio.wait_for(waiter, 1.0)
    slot, shared = table.acquire([1, 2, 3, 4, 9])
    assert slot is running and shared == 4
    await asyncio.wait_for(table.wait_for(slot, 0.05), 1.0)  # bounded: returns busy after the timeout


def test_hard_inject_says_why_it_is_off(tmp_path):
    """/status and the dashboard name the reason: never on (no slot directory), or turned off
    after restores kept failing (each failure has already fallen back to computing)."""
    from kvstream.backends.llamacpp.inject import HardInject

    never = HardInject(None, 2, None, off_reason="llama-server was started without --slot-save-path")
    assert never.snapshot()["enabled"] is False
    assert never.snapshot()["off_reason"] == "llama-server was started without --slot-save-path"
    inject = HardInject(None, 2, SlotFileStore(tmp_path, "m", block_size=4, budget_bytes=10_000), max_failures=3)
    assert inject.snapshot()["off_reason"] is None
    for _ in range(3):
        inject._fail("the restore did nothing")
    assert inject.snapshot()["enabled"] is False
    assert inject.snapshot()["off_reason"] == "3 restores in a row failed or did nothing"


def test_slots_another_client_used_are_told_from_kvstreams_own():
    """/slots names the task that last ran in each slot and how many tokens it holds: a new
    task where KVStream sent nothing, or a count other than its own request left, is another
    client's; KVStream forgets what it believed the slot holds and notes the unnamed tokens."""
    from kvstream.backends.llamacpp.inject import HardInject

    inject = HardInject(None, 2, None)
    s0, s1 = inject.table.slots
    # First sight: slot 0 holds a prompt from before KVStream started.
    inject._observe([{"id": 0, "id_task": 5, "n_prompt_tokens": 40}, {"id": 1}])
    assert (s0.unknown, s1.unknown, inject.stats.foreign_uses) == (40, 0, 0)
    prompt = list(range(100))
    slot, _ = inject.table.acquire(prompt)
    assert slot is s1  # the empty slot, not the one holding someone's tokens
    inject.table.release(s1, prompt, held=100 + 3 - 1)  # 3 tokens generated
    inject._observe([{"id": 0, "id_task": 5, "n_prompt_tokens": 40}, {"id": 1, "id_task": 9, "n_prompt_tokens": 102}])
    assert s1.tokens == prompt and inject.stats.foreign_uses == 0  # its own task
    # Another client runs in slot 0, where KVStream sent nothing.
    inject._observe([{"id": 0, "id_task": 12, "n_prompt_tokens": 300}, {"id": 1, "id_task": 9, "n_prompt_tokens": 102}])
    assert (inject.stats.foreign_uses, s0.unknown, s1.tokens) == (1, 300, prompt)
    # KVStream's request in slot 1, then another client's there, between two reads.
    longer = prompt + [7, 8]
    slot, shared = inject.table.acquire(longer)
    assert slot is s1 and shared == 100
    inject.table.release(s1, longer, held=102 + 1 - 1)
    inject._observe([{"id": 0, "id_task": 12, "n_prompt_tokens": 300}, {"id": 1, "id_task": 20, "n_prompt_tokens": 500}])
    assert (inject.stats.foreign_uses, s1.tokens, s1.unknown) == (2, [], 500)
    assert not inject.kv_lost
    # The runtime restarted: its slots list no tasks any more.
    inject._observe([{"id": 0}, {"id": 1}])
    assert inject.kv_lost and inject.stats.foreign_uses == 2


def test_a_short_shared_prefix_does_not_choose_the_slot():
    """Every chat shares its template's first tokens: a slot sharing only those is not worth
    evicting while another slot is empty (or less recently used)."""
    from kvstream.backends.llamacpp.slots import SlotTable

    table = SlotTable(2, min_shared=8)
    first, _ = table.acquire([1, 2, 3] + [10] * 20)
    table.release(first, [1, 2, 3] + [10] * 20)
    second, shared = table.acquire([1, 2, 3] + [20] * 20)
    assert second is not first and shared == 0
    table.release(second, [1, 2, 3] + [20] * 20)
    again, shared = table.acquire([1, 2, 3] + [10] * 20 + [5])
    assert again is first and shared == 23


async def test_a_malformed_slots_report_changes_nothing_it_cannot_read():
    """/slots answers that are not a list, entries without an id or out of range, task ids and
    counts of the wrong type: ignored, never an error on a request's path."""
    from kvstream.backends.llamacpp.inject import HardInject

    class Runtime:
        def __init__(self, answer):
            self.answer = answer

        async def get_json(self, path, timeout=None):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    inject = HardInject(Runtime({"error": "nope"}), 2, None)
    await inject._sync_with_runtime()
    assert inject._tasks == {} and not inject.kv_lost
    inject.http = Runtime(ConnectionError("down"))
    await inject._sync_with_runtime()
    assert inject._tasks == {}
    inject.http = Runtime([None, "x", {"id": "0"}, {"id": 7, "id_task": 3}, {"id": 0, "id_task": "3", "n_prompt_tokens": "40"},
                           {"id": 1, "id_task": 4, "n_prompt_tokens": None}])
    await inject._sync_with_runtime()
    s0, s1 = inject.table.slots
    assert inject._tasks == {0: None, 1: 4} and (s0.unknown, s1.unknown) == (0, 0) and not inject.kv_lost
    assert inject._reported_slots == 3  # (a slot 7: another slot count than KVStream's table)
    slot, shared = inject.table.acquire(list(range(10)))
    assert slot is s0 and shared == 0 and not s0.tokens  # nothing believed from the garbage: the first empty slot


async def test_slots_read_ahead_are_used_only_if_nothing_changed_since():
    """The slots are read while a prompt is tokenized (``read_ahead``); ``prepare`` uses that
    report only if KVStream's beliefs about the slots did not change after it was asked for
    (a report from before another request of KVStream's finished would look like a restart:
    task ids going back), else it reads again."""
    from kvstream.backends.llamacpp.inject import HardInject

    class Runtime:
        def __init__(self):
            self.task, self.reads = 5, 0

        async def get_json(self, path, timeout=None):
            self.reads += 1
            return [{"id": 0, "id_task": self.task, "n_prompt_tokens": 0}, {"id": 1}]

    runtime = Runtime()
    inject = HardInject(runtime, 2, None)
    inject.read_ahead()
    inject.read_ahead()  # a second request tokenized meanwhile: the same read serves it
    route = await inject.prepare(list(range(10)))
    assert runtime.reads == 1 and inject._tasks[0] == 5
    inject._release(route, None)
    # Read (task 7), then a newer report observed (another request's own read) before it is
    # used: used after it, task 7 after task 9 would read as a restart.
    runtime.task = 7
    inject.read_ahead()
    await asyncio.sleep(0)
    runtime.task = 9
    inject._observe(await inject._read_slots())
    runtime.task = 10
    await inject.prepare(list(range(20)))
    assert runtime.reads == 4 and inject._tasks[0] == 10 and not inject.kv_lost
