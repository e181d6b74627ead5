"""The model of a runtime's slots that lpm and cache_aware routing use (backends/affinity.py)."""

from __future__ import annotations

import random

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


def test_the_hash_index_answers_as_comparing_every_slot_would():
    """held_blocks and the slot start() picks, from the counts of held hashes, match the
    definition (the longest common prefix with any idle slot, or any slot; the least
    recently used of the best) through random starts and finishes, more in flight than
    modelled slots included."""
    rng = random.Random(7)
    slots = SlotModel(4, 8, "m")
    idle: list[list[bytes]] = [[] for _ in range(4)]  # the reference: every slot compared
    busy: dict[str, list[bytes]] = {}
    prompts = [slots.chain(prompt(t % 3, n=8 * (1 + t % 5), tail=8 * (t % 2))) for t in range(12)]

    def common(a: list[bytes], b: list[bytes]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for step in range(2000):
        chain = rng.choice(prompts)
        assert slots.held_blocks(chain) == max((common(chain, h) for h in idle), default=0)
        assert slots.held_blocks(chain, busy=True) == max((common(chain, h) for h in [*idle, *busy.values()]), default=0)
        if busy and (rng.random() < 0.5 or len(busy) >= 6):
            key = rng.choice(sorted(busy))
            slots.finish(key)
            idle.append(busy.pop(key))
            if len(idle) + len(busy) > 4:
                idle.pop(0)
        else:
            key = f"r{step}"
            if idle:
                best = max(range(len(idle)), key=lambda i: (common(chain, idle[i]), -i))
                idle.pop(best if common(chain, idle[best]) else 0)
            slots.start(key, chain)
            busy[key] = chain
        assert slots.idle == idle and slots.busy == busy
