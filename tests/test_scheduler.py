"""Scheduler policy: order, aging, priorities, preemption and resume, bounded queue, never-fits."""

from __future__ import annotations

import pytest

from kvstream.kv import BlockManager
from kvstream.scheduler import (
    NeverFits,
    Priority,
    QueueFull,
    Scheduler,
    SchedulerConfig,
    SeqStatus,
    Sequence,
    TooManySamples,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks=16, block_size=4, cpu=8, preemptible=True, **config) -> tuple[Scheduler, Clock]:
    clock = Clock()
    bm = BlockManager(num_blocks, block_size, cpu, model_identity="t")
    return Scheduler(bm, SchedulerConfig(**config), preemptible=preemptible, clock=clock), clock


def seq(n_prompt: int, max_tokens: int = 4, priority=Priority.NORMAL, arrival: float = 0.0, first: int = 0) -> Sequence:
    return Sequence(list(range(first, first + n_prompt)), max_tokens, priority, arrival=arrival)


def admitted_ids(out) -> list[str]:
    return [s.seq_id for s in out.admitted]


def test_fcfs_admits_in_arrival_order_up_to_the_batch_size():
    sched, _ = make(max_batch_size=2)
    a, b, c = seq(4, arrival=1, first=100), seq(4, arrival=2, first=200), seq(4, arrival=3, first=300)
    for s in (c, a, b):
        sched.add(s)
    assert admitted_ids(sched.schedule()) == [a.seq_id, b.seq_id]
    assert sched.waiting == [c]
    sched.finish(a)
    assert admitted_ids(sched.schedule()) == [c.seq_id]
    sched.check_invariants()


def test_sjf_prefers_short_jobs_and_ages_long_ones():
    sched, clock = make(max_batch_size=1, policy="sjf", sjf_aging_tokens_per_s=10)
    long = seq(20, max_tokens=20, arrival=0, first=0)  # expected 40 tokens
    sched.add(long)
    short = seq(2, max_tokens=2, arrival=0.5, first=500)  # expected 4 tokens
    sched.add(short)
    clock.now = 1.0
    assert admitted_ids(sched.schedule()) == [short.seq_id]
    sched.finish(short)
    # A new short job keeps arriving, but after enough waiting the long job's aged size
    # (40 - 10/s x waited) is below the newcomer's 4 tokens.
    newcomer = seq(2, max_tokens=2, arrival=5.0, first=600)
    sched.add(newcomer)
    clock.now = 5.0  # long: 40 - 50 = -10 < newcomer: 4 - 0
    assert admitted_ids(sched.schedule()) == [long.seq_id]


def test_priority_class_comes_before_arrival():
    sched, _ = make(max_batch_size=1)
    low = seq(4, priority=Priority.LOW, arrival=0, first=0)
    high = seq(4, priority=Priority.HIGH, arrival=5, first=100)
    sched.add(low)
    sched.add(high)
    assert admitted_ids(sched.schedule()) == [high.seq_id]


def test_priority_parse_accepts_names_and_numbers():
    assert Priority.parse("high") is Priority.HIGH
    assert Priority.parse("LOW") is Priority.LOW
    assert Priority.parse("1") is Priority.NORMAL
    assert Priority.parse(0) is Priority.HIGH
    with pytest.raises(ValueError):
        Priority.parse("urgent")
    with pytest.raises(ValueError):
        Priority.parse(True)


def test_queue_full_is_refused_at_once():
    sched, _ = make(max_queue_size=2, max_batch_size=1)
    sched.add(seq(4, first=0))
    sched.add(seq(4, first=10))
    with pytest.raises(QueueFull) as err:
        sched.add(seq(4, first=20))
    assert err.value.status == 429


def test_never_fits_is_refused_at_once():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(NeverFits):
        sched.add(seq(10, max_tokens=10))  # 20 tokens > 16-token pool
    with pytest.raises(NeverFits):
        make(num_blocks=100, max_model_len=16)[0].add(seq(10, max_tokens=10))  # > model context
    assert not sched.waiting


def test_the_context_and_a_preemptible_pool_bound_each_choice_not_their_sum():
    """n choices are n sequences once forked, each up to the context, preempted one by one:
    two choices of a chat without max_tokens (each its context's rest) were refused as past
    the context. Without preemption everything a request may hold is reserved, so all of it
    must fit the pool."""
    sched, _ = make(num_blocks=8, block_size=4, max_model_len=24)  # a 32-token pool
    two = seq(4, max_tokens=20)
    two.num_samples = 2  # 44 tokens in all; each choice 24
    sched.add(two)
    past = seq(5, max_tokens=20, first=50)
    past.num_samples = 2
    with pytest.raises(NeverFits) as err:
        sched.add(past)  # one choice is 25 tokens: past the context
    assert "25 tokens" in str(err.value) and "context of 24" in str(err.value)
    reserved, _ = make(num_blocks=8, block_size=4, preemptible=False)
    held = seq(4, max_tokens=20, first=100)
    held.num_samples = 2
    with pytest.raises(NeverFits) as err:
        reserved.add(held)
    assert "44 tokens" in str(err.value) and "each of 2 choices" in str(err.value)


def test_choices_outnumbering_the_batch_are_refused_at_once():
    """A request's choices are forked at admission and run together: more of them than the
    batch has slots could never be admitted (it waited forever, nothing running)."""
    sched, _ = make(max_batch_size=4)
    many = seq(4, max_tokens=4)
    many.num_samples = 5
    with pytest.raises(TooManySamples) as err:
        sched.add(many)
    assert err.value.status == 400 and "5 choices" in str(err.value) and not sched.waiting
    enough = seq(4, max_tokens=4, first=10)
    enough.num_samples = 4
    sched.add(enough)
    assert sched.schedule().admitted == [enough] and sched.running == [enough]


def test_memory_pressure_preempts_lowest_priority_by_swap_and_resumes_it_first():
    sched, _ = make(num_blocks=4, block_size=4, cpu=8, max_batch_size=4, preemption_policy="swap")
    low = seq(4, max_tokens=8, priority=Priority.LOW, arrival=0, first=0)
    normal = seq(7, max_tokens=8, priority=Priority.NORMAL, arrival=1, first=100)
    sched.add(low)
    sched.add(normal)
    sched.schedule()  # low: 1 block, normal: 2 blocks; 1 free
    assert set(sched.running) == {low, normal}
    sched.append(normal, 1)  # fills normal's second block (8 tokens)
    out = sched.append(normal, 2)  # takes the last free block
    assert not out.preempted and sched.bm.num_free_blocks == 0
    for t in range(3, 6):
        assert not sched.append(normal, t).preempted  # tokens 10..12 fill that block
    out = sched.append(normal, 6)  # the 13th token needs a block: low is swapped out
    assert out.preempted == [low] and low.status is SeqStatus.SWAPPED
    assert out.swap_out_copies
    sched.check_invariants()
    newcomer = seq(2, max_tokens=1, priority=Priority.LOW, arrival=2, first=900)
    sched.add(newcomer)
    sched.finish(normal)
    out = sched.schedule()
    assert out.resumed == [low]  # the swapped resume before anyone of their class waiting
    assert sched.bm.tables[low.seq_id].token_ids == list(range(4))
    sched.check_invariants()


def test_recompute_preemption_requeues_with_generated_tokens():
    sched, _ = make(num_blocks=3, block_size=4, cpu=0, max_batch_size=2, preemption_policy="recompute")
    a = seq(4, max_tokens=4, arrival=0, first=0)
    b = seq(3, max_tokens=4, arrival=1, first=100)
    sched.add(a)
    sched.add(b)
    sched.schedule()  # a: 1 block, b: 1 block, 1 free
    sched.append(b, 7)  # b's block is full now
    sched.append(a, 8)  # a takes the last block
    out = sched.append(b, 9)  # b needs a block: b (latest arrival) is recomputed
    assert out.preempted == [b] and b.status is SeqStatus.WAITING and sched.waiting[0] is b
    assert b.output_token_ids == [7]
    sched.finish(a)
    out = sched.schedule()
    assert out.admitted == [b]
    # Its prompt and generated token are back, found in the prefix cache (the full block
    # it held was freed with its hash), and the token that did not fit is not there.
    assert sched.bm.tables[b.seq_id].token_ids == [100, 101, 102, 7]
    assert b.num_cached_tokens == 0  # a 4-token prompt hit leaves one token: no full block
    sched.check_invariants()


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_lowest():
    sched, _ = make(num_blocks=2, block_size=4, cpu=4, max_batch_size=2, preemption_policy="swap")
    high = seq(4, max_tokens=4, priority=Priority.HIGH, first=0)
    low = seq(4, max_tokens=4, priority=Priority.LOW, first=100)
    sched.add(high)
    sched.add(low)
    sched.schedule()
    out = sched.append(low, 1)  # needs a block; the only lower-or-equal victim is itself
    assert out.preempted == [low] and low.status is SeqStatus.SWAPPED
    assert high.status is SeqStatus.RUNNING
    sched.finish(low)
    sched.finish(high)
    assert sched.bm.is_idle()


def test_non_preemptible_admission_keeps_headroom_for_growth():
    sched, _ = make(num_blocks=4, block_size=4, cpu=0, preemptible=False, max_batch_size=4)
    a = seq(4, max_tokens=8, first=0)  # worst case 12 tokens = 3 blocks
    b = seq(4, max_tokens=4, first=100)  # worst case 2 blocks: does not fit beside a
    sched.add(a)
    sched.add(b)
    assert admitted_ids(sched.schedule()) == [a.seq_id]
    for t in range(8):
        out = sched.append(a, t)
        assert not out.preempted
    assert sched.stats.append_overflows == 0
    sched.finish(a)
    assert admitted_ids(sched.schedule()) == [b.seq_id]
    sched.check_invariants()


def test_head_of_line_waits_instead_of_being_starved():
    sched, _ = make(num_blocks=4, block_size=4, cpu=0, preemptible=False, max_batch_size=4)
    running = seq(4, max_tokens=4, first=0)
    sched.add(running)
    sched.schedule()
    big = seq(8, max_tokens=4, arrival=1, first=100)  # 3 blocks: waits for `running`
    small = seq(1, max_tokens=1, arrival=2, first=200)
    sched.add(big)
    sched.add(small)
    assert sched.schedule().admitted == []  # small does not overtake big
    sched.finish(running)
    assert admitted_ids(sched.schedule()) == [big.seq_id, small.seq_id]


def splitting(sched: Scheduler) -> list[tuple[str, int]]:
    """Give ``sched`` a split_group that names the rest "<id>/<keep>"; returns its calls."""
    calls: list[tuple[str, int]] = []

    def split(group: Sequence, keep: int) -> Sequence:
        calls.append((group.seq_id, keep))
        return Sequence(list(group.prompt_token_ids), group.max_tokens, group.priority, seq_id=f"{group.seq_id}/{keep}",
                        arrival=group.arrival, num_samples=group.num_samples - keep)

    sched.split_group = split
    return calls


def test_a_group_of_choices_runs_what_fits_and_its_rest_keeps_the_head_of_the_queue():
    sched, _ = make(max_batch_size=4)
    calls = splitting(sched)
    running = seq(4, arrival=0, first=0)
    sched.add(running)
    sched.schedule()
    group = seq(4, arrival=1, first=100)
    group.num_samples = 4
    behind = seq(4, arrival=2, first=200)
    sched.add(group)
    sched.add(behind)
    out = sched.schedule()
    # 3 free lanes: 3 of the 4 choices run (2 slots reserved for forks), the 4th waits
    # first, and the request behind it does not pass it.
    assert calls == [(group.seq_id, 3)] and admitted_ids(out) == [group.seq_id]
    assert group.num_samples == 3 and group.unforked == 2 and sched._reserved == 2
    assert [s.seq_id for s in sched.waiting] == [f"{group.seq_id}/3", behind.seq_id]
    assert sched.waiting[0].num_samples == 1
    sched.check_invariants()
    sched.finish(running)
    assert admitted_ids(sched.schedule()) == [f"{group.seq_id}/3"]  # one lane: the rest, not the one behind
    sched.check_invariants()


def test_a_group_is_not_split_without_a_splitter_nor_when_preempting_a_lower_class_fits_it_whole():
    sched, _ = make(max_batch_size=4)
    running = seq(4, arrival=0, first=0)
    sched.add(running)
    sched.schedule()
    group = seq(4, arrival=1, first=100)
    group.num_samples = 4
    sched.add(group)
    assert not sched.schedule() and group.num_samples == 4  # no split_group: it waits whole
    sched, _ = make(num_blocks=32, cpu=16, max_batch_size=4, preemption_policy="swap")
    calls = splitting(sched)
    low = seq(4, priority=Priority.LOW, arrival=0, first=0)
    sched.add(low)
    sched.schedule()
    high = seq(4, priority=Priority.HIGH, arrival=1, first=100)
    high.num_samples = 4
    sched.add(high)
    out = sched.schedule()
    assert not calls and out.preempted == [low] and admitted_ids(out) == [high.seq_id] and high.num_samples == 4
    sched.check_invariants()


def test_choices_past_the_batch_run_a_batch_at_a_time_and_a_higher_class_preempts_for_each():
    sched, _ = make(num_blocks=32, cpu=16, max_batch_size=4, preemption_policy="swap")
    calls = splitting(sched)
    lows = [seq(4, priority=Priority.LOW, arrival=i, first=10 * i) for i in range(2)]
    for low in lows:
        sched.add(low)
    sched.schedule()
    high = seq(4, priority=Priority.HIGH, arrival=5, first=100)
    high.num_samples = 10  # past the batch: no TooManySamples with a splitter
    sched.add(high)
    out = sched.schedule()
    # A batch of its choices first, for which the two lows are preempted as for any group
    # of a higher class; the rest, a batch and 2, finds no free lane.
    assert calls == [(high.seq_id, 4), (f"{high.seq_id}/4", 4)] and high.num_samples == 4
    assert admitted_ids(out) == [high.seq_id]
    assert sorted(s.seq_id for s in out.preempted) == sorted(s.seq_id for s in lows)
    assert [s.num_samples for s in sched.waiting] == [4, 2]
    sched.check_invariants()


def test_a_group_swapped_out_before_it_forked_resumes_the_choices_that_fit_and_queues_the_rest_first():
    sched, _ = make(num_blocks=32, cpu=16, max_batch_size=3, preemption_policy="swap")
    calls = splitting(sched)
    low = seq(4, priority=Priority.LOW, arrival=0, first=0)
    low.num_samples = 3
    sched.add(low)
    sched.schedule()
    high = seq(4, priority=Priority.HIGH, arrival=1, first=100)
    behind = seq(4, priority=Priority.LOW, arrival=2, first=200)
    sched.add(high)
    sched.add(behind)
    out = sched.schedule()
    assert out.preempted == [low] and admitted_ids(out) == [high.seq_id] and low.status is SeqStatus.SWAPPED
    # 2 lanes free: the swapped group comes back with 2 of its 3 choices (not after the
    # high one ends), its third first in the queue, ahead of the request that came after it.
    out = sched.schedule()
    assert out.resumed == [low] and low.num_samples == 2 and calls == [(low.seq_id, 2)]
    assert [s.seq_id for s in sched.waiting] == [f"{low.seq_id}/2", behind.seq_id]
    sched.check_invariants()
    sched.finish(high)
    assert admitted_ids(sched.schedule()) == [f"{low.seq_id}/2"]
    sched.check_invariants()


def test_a_group_split_for_blocks_keeps_as_many_choices_as_their_reserved_growth_allows():
    """Non-preemptible, each choice's growth is reserved at admission: 4 prompt tokens and 4
    each for 3 choices is 4 blocks of 4; with 3 free, 2 choices (3 blocks) run now. (Only
    here do blocks depend on the choices: a preempting scheduler, the in-process engine's,
    admits on the prompt's blocks.)"""
    sched, _ = make(num_blocks=4, block_size=4, cpu=0, preemptible=False, max_batch_size=8)
    calls = splitting(sched)
    running = seq(3, max_tokens=1, first=0)  # 1 block
    sched.add(running)
    sched.schedule()
    group = seq(4, max_tokens=4, arrival=1, first=100)
    group.num_samples = 3
    sched.add(group)
    assert admitted_ids(sched.schedule()) == [group.seq_id] and calls == [(group.seq_id, 2)]
    assert sched.waiting[0].num_samples == 1
    sched.check_invariants()


def test_finish_is_idempotent_and_frees_from_any_queue():
    sched, _ = make(max_batch_size=1)
    a, b = seq(4, first=0), seq(4, first=100)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b)  # still waiting
    sched.finish(a)  # running
    sched.finish(a)
    assert not sched.running and not sched.waiting
    assert sched.bm.is_idle()


def test_a_higher_class_takes_a_full_batch_slot_by_preemption_and_the_victim_resumes_after():
    sched, _ = make(num_blocks=32, block_size=4, cpu=16, max_batch_size=2, preemption_policy="swap")
    low1 = seq(5, max_tokens=8, priority=Priority.LOW, arrival=0, first=0)
    low2 = seq(5, max_tokens=8, priority=Priority.LOW, arrival=1, first=100)
    for s_ in (low1, low2):
        sched.add(s_)
    sched.schedule()
    assert set(sched.running) == {low1, low2}
    high = seq(3, max_tokens=4, priority=Priority.HIGH, arrival=2, first=500)
    sched.add(high)
    out = sched.schedule()
    # Both slots were taken: the latest low is swapped out to make room.
    assert out.preempted == [low2] and out.admitted == [high] and low2.status is SeqStatus.SWAPPED
    sched.check_invariants()
    normal = seq(3, max_tokens=4, priority=Priority.NORMAL, arrival=3, first=700)
    sched.add(normal)
    sched.finish(high)
    out = sched.schedule()
    # The free slot goes to the waiting normal request (a higher class than the swapped low).
    assert out.admitted == [normal] and not out.resumed
    sched.finish(normal)
    out = sched.schedule()
    assert out.resumed == [low2]
    sched.check_invariants()


def test_equal_classes_never_preempt_each_other_for_a_slot():
    sched, _ = make(num_blocks=32, block_size=4, cpu=16, max_batch_size=1, preemption_policy="swap")
    first = seq(3, max_tokens=4, arrival=0, first=0)
    second = seq(3, max_tokens=4, arrival=1, first=100)
    sched.add(first)
    sched.schedule()
    sched.add(second)
    out = sched.schedule()
    assert not out and sched.waiting == [second]


def test_a_runtime_generating_past_its_reservation_takes_no_one_elses_blocks():
    """Issue 18, item 8: with no max_tokens and no known context KVStream reserves a guess; a
    runtime that goes on past it is counted but given no more blocks, so a small request
    that fits beside the reservation is still admitted."""
    sched, _ = make(num_blocks=6, block_size=4, cpu=0, preemptible=False, max_batch_size=4)
    runaway = seq(4, max_tokens=8, first=0)  # reserves 3 blocks
    sched.add(runaway)
    sched.schedule()
    for t in range(40):  # 32 tokens past its reservation: 8 more blocks if it were given them
        sched.append(runaway, t)
    assert sched.stats.append_overflows == 32
    assert len(sched.bm.tables[runaway.seq_id].blocks) == 3
    small = seq(3, max_tokens=1, first=500)
    sched.add(small)
    assert admitted_ids(sched.schedule()) == [small.seq_id]
    sched.check_invariants()


def test_lpm_admits_the_longest_held_prefix_first_and_bounds_how_often_one_is_passed_over():
    """scheduler.policy lpm: when a slot frees, the waiting request whose prefix the runtime
    holds goes first; one passed over lpm_max_overtakes times goes before every match."""
    held = {"a": 0}

    def affinity(s):
        return 64 if s.prompt_token_ids[0] == held["a"] else 0

    clock = Clock()
    bm = BlockManager(64, 4, 0, model_identity="t")
    sched = Scheduler(bm, SchedulerConfig(max_batch_size=1, policy="lpm", lpm_max_overtakes=2), preemptible=False,
                      clock=clock, affinity=affinity)
    running = seq(4, max_tokens=1, first=0, arrival=0)
    sched.add(running)
    sched.schedule()
    other = seq(4, max_tokens=1, first=100, arrival=1)  # arrived first, holds nothing
    sched.add(other)
    matches = [seq(4, max_tokens=1, first=0, arrival=2 + i) for i in range(4)]  # share the held prefix
    for m in matches:
        sched.add(m)
    order = []
    current = running
    for _ in range(5):
        sched.finish(current)
        (current,) = sched.schedule().admitted
        order.append(current.seq_id)
    # Two matches jump ahead of `other`, which then goes first; the other matches follow.
    assert order == [matches[0].seq_id, matches[1].seq_id, other.seq_id, matches[2].seq_id, matches[3].seq_id]
    sched.check_invariants()


def test_lpm_orders_its_window_by_prefix_and_the_queue_behind_it_by_arrival():
    """Only the lpm_window first arrivals are looked up (a pass costs the same however long
    the queue): a match inside the window goes first, one behind it waits its turn; the
    aging of those passed over counts only the earlier arrivals of the same class."""
    looked_up = []

    def affinity(s):
        looked_up.append(s.seq_id)
        return 64 if s.prompt_token_ids[0] == 0 else 0

    bm = BlockManager(256, 4, 0, model_identity="t")
    sched = Scheduler(bm, SchedulerConfig(max_batch_size=1, policy="lpm", lpm_window=3), preemptible=False,
                      clock=Clock(), affinity=affinity)
    running = seq(4, max_tokens=1, first=0, arrival=0)
    sched.add(running)
    sched.schedule()
    others = [seq(4, max_tokens=1, first=100 + 10 * i, arrival=1 + i) for i in range(3)]  # the window, no match
    late_match = seq(4, max_tokens=1, first=0, arrival=10)  # behind the window
    early_match = seq(4, max_tokens=1, first=0, arrival=2.5)  # inside it once sorted by arrival
    for s in (*others, late_match, early_match):
        sched.add(s)
    looked_up.clear()
    sched.finish(running)
    (first,) = sched.schedule().admitted
    assert first is early_match  # passed the two that arrived before it
    assert len(looked_up) == 3 and late_match.seq_id not in looked_up
    assert [s.overtaken for s in others] == [1, 1, 0] and late_match.overtaken == 0
    order = []
    current = first
    while sched.waiting:
        sched.finish(current)
        (current,) = sched.schedule().admitted
        order.append(current)
    # The window's first by arrival; then the late match, once inside the window, passes the rest.
    assert order == [others[0], late_match, others[1], others[2]]
    sched.check_invariants()


def test_an_arrival_while_every_slot_is_busy_orders_nothing():
    """With the batch full and nothing to preempt for it, a pass returns at once: no prefix
    is looked up for the queue (under load that was every arrival's cost, per waiting
    request); a higher class arriving at a preemptible engine still preempts."""
    looked_up = []

    def affinity(s):
        looked_up.append(s.seq_id)
        return 0

    bm = BlockManager(64, 4, 8, model_identity="t")
    sched = Scheduler(bm, SchedulerConfig(max_batch_size=2, policy="lpm"), preemptible=True, clock=Clock(), affinity=affinity)
    for i in range(2):
        sched.add(seq(4, first=100 * i, arrival=i))
    assert len(sched.schedule().admitted) == 2
    for i in range(5):
        sched.add(seq(4, first=1000 + 100 * i, arrival=10 + i))
    looked_up.clear()
    out = sched.schedule()
    assert not out.admitted and not out.preempted and looked_up == []
    urgent = seq(4, priority=Priority.HIGH, first=5000, arrival=20)
    sched.add(urgent)
    out = sched.schedule()
    assert admitted_ids(out) == [urgent.seq_id] and len(out.preempted) == 1
    sched.check_invariants()


def test_a_prompt_sharing_a_prefix_being_computed_waits_for_it_and_then_hits_the_cache():
    """In-process engines (hash_on_append off, commit reports what is computed): b shares
    a's three-block document, arrives with it, waits until a has computed it, and is then
    admitted with the document cached; c shares nothing and is admitted around b."""
    clock = Clock()
    bm = BlockManager(32, 4, 0, model_identity="t", hash_on_append=False)
    sched = Scheduler(bm, SchedulerConfig(max_batch_size=8, wait_for_shared_prefix_tokens=4), preemptible=True, clock=clock)
    document = list(range(100, 112))  # three blocks of 4
    a, b = Sequence(document + [1, 2], 4, arrival=1), Sequence(document + [3, 4], 4, arrival=2)
    c = Sequence(list(range(500, 514)), 4, arrival=3)
    for s in (a, b, c):
        sched.add(s)
    assert admitted_ids(sched.schedule()) == [a.seq_id, c.seq_id]
    assert sched.waiting == [b]
    bm.commit(a.seq_id, 8)  # a prefill chunk: two of the three shared blocks computed
    assert admitted_ids(sched.schedule()) == []  # one block (4 tokens) still in flight
    bm.commit(a.seq_id, 14)
    assert admitted_ids(sched.schedule()) == [b.seq_id]
    assert b.num_cached_tokens == 12
    sched.check_invariants()


def test_without_computed_counts_or_with_waiting_off_nobody_waits_for_a_prefix():
    document = list(range(100, 112))
    for hash_on_append, wait in ((True, 4), (False, 0)):
        bm = BlockManager(32, 4, 0, model_identity="t", hash_on_append=hash_on_append)
        sched = Scheduler(bm, SchedulerConfig(max_batch_size=8, wait_for_shared_prefix_tokens=wait), preemptible=True)
        a, b = Sequence(document + [1, 2], 4, arrival=1), Sequence(document + [3, 4], 4, arrival=2)
        sched.add(a)
        sched.add(b)
        assert admitted_ids(sched.schedule()) == [a.seq_id, b.seq_id]


def test_a_waiting_prompt_is_admitted_when_the_request_computing_its_prefix_goes_away():
    bm = BlockManager(32, 4, 0, model_identity="t", hash_on_append=False)
    sched = Scheduler(bm, SchedulerConfig(max_batch_size=8, wait_for_shared_prefix_tokens=4), preemptible=True)
    document = list(range(100, 112))
    a, b = Sequence(document + [1, 2], 4, arrival=1), Sequence(document + [3, 4], 4, arrival=2)
    sched.add(a)
    sched.add(b)
    assert admitted_ids(sched.schedule()) == [a.seq_id]
    sched.finish(a)  # aborted before computing anything
    assert admitted_ids(sched.schedule()) == [b.seq_id] and b.num_cached_tokens == 0


def test_a_prompt_of_another_tenant_never_waits_for_a_prefix_it_could_not_share():
    """Tenants' blocks are chained from their own salt (cache_root): the same tokens under
    another root are not a prefix this request could read, so it does not wait for them."""
    bm = BlockManager(32, 4, 0, model_identity="t", hash_on_append=False)
    sched = Scheduler(bm, SchedulerConfig(max_batch_size=8, wait_for_shared_prefix_tokens=4), preemptible=True)
    document = list(range(100, 112))
    a, b = Sequence(document + [1, 2], 4, arrival=1), Sequence(document + [3, 4], 4, arrival=2)
    b.cache_root = b"tenant-b"
    sched.add(a)
    sched.add(b)
    assert admitted_ids(sched.schedule()) == [a.seq_id, b.seq_id]
    assert b.num_cached_tokens == 0


def test_when_nothing_runs_and_no_swapped_sequence_can_come_back_one_drops_its_kv():
    """Two pairs of forks fill the pool and are all swapped out: the blocks each pair shares
    stay on the device, pinned, and every one of them needs a block to copy its shared last
    block into before it can decode. Nothing runs and nothing could come back: the last in
    order drops its KV (to be recomputed), which frees its partner's blocks of the share,
    and that partner resumes."""
    sched, _ = make(num_blocks=4, block_size=4, cpu=8, max_batch_size=8, preemption_policy="swap")
    pairs = []
    for first in (0, 100):
        parent = seq(6, max_tokens=4, first=first)
        parent.num_samples = 2
        sched.add(parent)
        assert sched.schedule().admitted == [parent]
        child = Sequence(list(parent.prompt_token_ids), 4, seq_id=f"{parent.seq_id}/1", arrival=parent.arrival)
        sched.fork(parent, child)
        pairs.append((parent, child))
    assert sched.bm.num_free_blocks == 0
    out = sched.schedule()
    for victim in [s for pair in pairs for s in pair]:
        sched._preempt(victim, out)  # memory pressure from outside, as the runner's appends cause
    assert not sched.running and len(sched.swapped) == 4 and sched.bm.num_free_blocks == 0
    assert all(sched.bm.blocks_to_resume(s.seq_id) == 1 for s in sched.swapped)  # a copy of the shared last block
    sched.check_invariants()
    out = sched.schedule()
    assert sched.stats.swap_drops == 1 and len(out.resumed) == 1
    dropped = sched.waiting[0]
    assert dropped.status is SeqStatus.WAITING and dropped.seq_id not in sched.bm.swapped
    resumed = out.resumed[0]
    assert {dropped, resumed} in ({*pairs[0]}, {*pairs[1]})  # the dropped one's partner came back
    sched.check_invariants()
    assert not sched.append(resumed, 7).preempted  # and it decodes
    for s in list(sched.running) + list(sched.swapped) + list(sched.waiting):
        sched.finish(s)
    assert sched.bm.is_idle()


def test_a_preemption_that_cannot_make_room_is_not_made():
    """A waiting request of a higher class preempts a running one only if that frees what it
    lacks: blocks the victim shares with a swapped fork stay on the device, so preempting it
    would stop work that could finish (and free them) for nothing."""
    sched, _ = make(num_blocks=4, block_size=4, cpu=8, max_batch_size=8, preemption_policy="swap")
    parent = seq(6, max_tokens=4, priority=Priority.LOW, first=0)
    parent.num_samples = 2
    sched.add(parent)
    sched.schedule()
    child = Sequence(list(parent.prompt_token_ids), 4, Priority.LOW, seq_id=f"{parent.seq_id}/1")
    sched.fork(parent, child)
    sched._preempt(child, sched.schedule())  # the fork swapped out: the pair's two blocks stay, pinned
    assert sched.bm.num_free_blocks == 2
    high = seq(9, max_tokens=2, priority=Priority.HIGH, first=500)  # 3 blocks: more than preempting frees
    sched.add(high)
    out = sched.schedule()
    assert not out.preempted and not out.admitted and parent.status is SeqStatus.RUNNING
    sched.check_invariants()
    sched.finish(parent)
    sched.finish(child)  # the pair done: its blocks free, the high request fits
    assert sched.schedule().admitted == [high]
    sched.finish(high)
    assert sched.bm.is_idle()


def test_a_higher_class_does_not_swap_out_forks_whose_shared_blocks_would_stay():
    """Found by the property test: forks of one prompt swapped out one after the other keep
    their shared blocks on the device, so preempting them all for a request of a higher
    class freed too little; it was left waiting with nothing running (an idle engine, work
    queued, no event to wake it). Admission now counts only the blocks a swap-out frees: the
    request waits while the forks run, and is admitted when they finish."""
    sched, _ = make(num_blocks=10, block_size=4, cpu=4, max_batch_size=3, preemption_policy="swap")
    low = Sequence([1, 2, 3, 4, 5, 6, 7, 8] + [0] * 12, 1, Priority.LOW, arrival=1.0, num_samples=2)
    sched.add(low)
    sched.schedule()
    sched.append(low, 0)
    low_fork = Sequence(list(low.prompt_token_ids), 1, Priority.LOW, arrival=1.0)
    sched.fork(low, low_fork)
    sched.schedule()
    normal = Sequence([1, 2, 3, 4, 9, 9, 9, 9] + [0] * 9, 1, Priority.NORMAL, arrival=2.0, num_samples=2)
    sched.add(normal)
    sched.schedule()
    normal_fork = Sequence(list(normal.prompt_token_ids), 1, Priority.NORMAL, arrival=2.0)
    sched.fork(normal, normal_fork)
    sched.schedule()
    high = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 0], 1, Priority.HIGH, arrival=3.0)
    sched.add(high)
    sched.schedule()
    assert sched.running, "work waits on an idle engine"
    # The running finish one by one; the swapped come back; the high one gets its turn.
    for _ in range(20):
        if high.status is SeqStatus.RUNNING:
            break
        for running in list(sched.running):
            sched.finish(running)
        sched.schedule()
        assert sched.running or not (sched.waiting or sched.swapped)
    assert high.status is SeqStatus.RUNNING
    sched.check_invariants()
