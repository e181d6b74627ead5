"""The model of a remote runtime's slots that the lpm policy orders by (engine/affinity.py)."""

from __future__ import annotations

from kvstream.engine.affinity import SlotModel
from kvstream.scheduler import Sequence


def prompt(tenant: int, n: int = 40, tail: int = 0) -> Sequence:
    return Sequence([tenant * 1000 + i for i in range(n)] + [9] * tail, 4)


def test_a_freed_slot_holds_its_last_prompt_until_another_lands_there():
    slots = SlotModel(2, 8, "m")
    a1, b1 = prompt(1), prompt(2)
    slots.start(a1)
    slots.start(b1)
    assert slots.held_tokens(prompt(1, tail=3)) == 0  # both slots busy: nothing idle holds it
    slots.finish(a1)
    assert slots.held_tokens(prompt(1, tail=3)) == 40  # the idle slot holds tenant 1's 5 blocks
    assert slots.held_tokens(prompt(2, tail=3)) == 0
    a2 = prompt(1, tail=3)
    slots.start(a2)  # lands in the slot that holds its prefix
    slots.finish(b1)
    slots.finish(a2)
    assert slots.held_tokens(prompt(1)) == 40 and slots.held_tokens(prompt(2)) == 40


def test_without_a_match_a_request_takes_the_least_recently_used_slot():
    slots = SlotModel(2, 8, "m")
    for tenant in (1, 2):
        s = prompt(tenant)
        slots.start(s)
        slots.finish(s)
    c = prompt(3)
    slots.start(c)  # evicts tenant 1 (least recently used), keeps tenant 2
    slots.finish(c)
    assert slots.held_tokens(prompt(1)) == 0
    assert slots.held_tokens(prompt(2)) == 40 and slots.held_tokens(prompt(3)) == 40


def test_tenants_with_the_same_prompt_do_not_match_each_other():
    from kvstream.kv.hashing import tenant_root

    slots = SlotModel(1, 8, "m")
    a = prompt(1)
    a.cache_root = tenant_root("alice")
    slots.start(a)
    slots.finish(a)
    b = prompt(1)
    b.cache_root = tenant_root("bob")
    assert slots.held_tokens(b) == 0
