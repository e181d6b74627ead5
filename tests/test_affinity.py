"""The model of a runtime's slots that lpm and cache_aware routing use (backends/affinity.py)."""

from __future__ import annotations

from kvstream.backends.affinity import SlotModel
from kvstream.kv.hashing import tenant_root


def prompt(tenant: int, n: int = 40, tail: int = 0) -> list[int]:
    return [tenant * 1000 + i for i in range(n)] + [9] * tail


def test_a_freed_slot_holds_its_last_prompt_until_another_lands_there():
    slots = SlotModel(2, 8, "m")
    slots.start("a1", slots.chain(prompt(1)))
    slots.start("b1", slots.chain(prompt(2)))
    assert slots.held_blocks(slots.chain(prompt(1, tail=3))) == 0  # both busy: nothing idle holds it
    assert slots.free == 0
    slots.finish("a1")
    assert slots.held_blocks(slots.chain(prompt(1, tail=3))) == 5  # the idle slot holds tenant 1's 5 blocks
    assert slots.held_blocks(slots.chain(prompt(2, tail=3))) == 0
    slots.start("a2", slots.chain(prompt(1, tail=3)))  # lands in the slot that holds its prefix
    slots.finish("b1")
    slots.finish("a2")
    assert slots.held_blocks(slots.chain(prompt(1))) == 5 and slots.held_blocks(slots.chain(prompt(2))) == 5


def test_without_a_match_a_request_takes_the_least_recently_used_slot():
    slots = SlotModel(2, 8, "m")
    for tenant in (1, 2):
        slots.start(str(tenant), slots.chain(prompt(tenant)))
        slots.finish(str(tenant))
    slots.start("c", slots.chain(prompt(3)))  # evicts tenant 1 (least recently used), keeps tenant 2
    slots.finish("c")
    assert slots.held_blocks(slots.chain(prompt(1))) == 0
    assert slots.held_blocks(slots.chain(prompt(2))) == 5 and slots.held_blocks(slots.chain(prompt(3))) == 5


def test_tenants_with_the_same_prompt_do_not_match_each_other():
    slots = SlotModel(1, 8, "m")
    slots.start("a", slots.chain(prompt(1), tenant_root("alice")))
    slots.finish("a")
    assert slots.held_blocks(slots.chain(prompt(1), tenant_root("bob"))) == 0
    assert slots.held_blocks(slots.chain(prompt(1), tenant_root("alice"))) == 5
