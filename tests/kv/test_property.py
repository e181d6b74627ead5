"""Hypothesis drives random allocate / append / fork / share-prefix / swap out / swap in / free /
evict sequences and checks every invariant after every step, then that all is freed."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from kvstream.kv import BlockManager, NoFreeBlocks
from kvstream.scheduler import NeverFits, Priority, QueueFull, Scheduler, SchedulerConfig, Sequence, TooManySamples

# A small vocabulary and a few fixed prefixes make prefix hits and shared blocks frequent.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5]]
tokens = st.lists(st.integers(0, 9), min_size=1, max_size=12)


class BlockManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")
    swapped = Bundle("swapped")

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.bm = BlockManager(12, 4, 6, model_identity="prop", clock=lambda: self.now)
        self.counter = 0
        # What each sequence's tokens must be, tracked independently of the manager.
        self.expected: dict[str, list[int]] = {}

    def _new_id(self) -> str:
        self.counter += 1
        return f"s{self.counter}"

    @rule(target=seqs, prefix=st.sampled_from(PREFIXES + [[]]), suffix=tokens)
    def allocate(self, prefix, suffix):
        seq_id = self._new_id()
        prompt = prefix + suffix
        free_before = self.bm.num_free_blocks
        try:
            cached = self.bm.allocate(seq_id, prompt)
        except NoFreeBlocks:
            assert self.bm.num_free_blocks == free_before  # all or nothing
            return None
        assert cached % 4 == 0 and cached < len(prompt)
        self.expected[seq_id] = list(prompt)
        return seq_id

    @rule(seq=seqs, token=st.integers(0, 9))
    def append(self, seq, token):
        if seq not in self.bm.tables:
            return
        try:
            self.bm.append_token(seq, token)
        except NoFreeBlocks:
            return
        self.expected[seq].append(token)

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent not in self.bm.tables:
            return None
        child = self._new_id()
        self.bm.fork(parent, child)
        self.expected[child] = list(self.expected[parent])
        return child

    @rule(target=swapped, seq=consumes(seqs))
    def swap_out(self, seq):
        if seq not in self.bm.tables:
            return None
        try:
            self.bm.swap_out(seq)
        except NoFreeBlocks:
            assert seq in self.bm.tables
            return None
        return seq

    @rule(target=seqs, seq=consumes(swapped))
    def swap_in(self, seq):
        if seq not in self.bm.swapped:
            return None
        try:
            self.bm.swap_in(seq)
        except NoFreeBlocks:
            assert seq in self.bm.swapped
            return None
        assert self.bm.tables[seq].token_ids == self.expected[seq]
        return seq

    @rule(seq=consumes(seqs))
    def free(self, seq):
        self.bm.free(seq)
        self.expected.pop(seq, None)

    @rule(seq=consumes(seqs), tokens=st.integers(0, 16), seconds=st.sampled_from([1.0, 5.0]))
    def free_retaining(self, seq, tokens, seconds):
        self.bm.free(seq, retain=[(tokens, self.now + seconds)])
        self.expected.pop(seq, None)

    @rule(seconds=st.sampled_from([0.5, 2.0, 6.0]))
    def tick(self, seconds):
        self.now += seconds

    @rule()
    def evict_all_cached(self):
        self.bm.pool.drop_expired(ttl_seconds=-1)

    @invariant()
    def invariants_hold(self):
        self.bm.check_invariants()
        for seq_id, table in self.bm.tables.items():
            assert table.token_ids == self.expected[seq_id]

    def teardown(self):
        for seq_id in list(self.bm.tables) + list(self.bm.swapped):
            self.bm.free(seq_id)
        self.bm.check_invariants()
        assert self.bm.is_idle(), "blocks leaked"


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class SchedulerMachine(RuleBasedStateMachine):
    """Random arrivals (some of several choices), forks, token appends, finishes and aborts
    through the scheduler, for both admission modes, with groups of choices split to the free
    lanes or admitted whole; budgets, fork reservations and block invariants hold at every
    step."""

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler | None = None
        self.live: list[Sequence] = []
        self.groups: list[Sequence] = []  # every accepted arrival and split-off rest, ended or not
        self.choices = 0  # the accepted arrivals' choices: the groups' must always add up to them
        # A clock that ticks per arrival: orders (fcfs, sjf aging) must not depend on how
        # fast the machine runs, or hypothesis cannot replay an example.
        self.now = 0.0

    @precondition(lambda self: self.sched is None)
    @rule(preemptible=st.booleans(), policy=st.sampled_from(["swap", "recompute"]), order=st.sampled_from(["fcfs", "sjf", "lpm"]),
          split=st.booleans())
    def configure(self, preemptible, policy, order, split):
        bm = BlockManager(10, 4, 4 if preemptible else 0, model_identity="sched")
        config = SchedulerConfig(max_batch_size=3, preemption_policy=policy, policy=order, max_queue_size=6)
        affinity = lambda seq: len(bm.cached_prefix(seq.prompt_token_ids)) * bm.block_size  # noqa: E731
        self.sched = Scheduler(bm, config, preemptible=preemptible, clock=lambda: self.now, affinity=affinity,
                               split_group=self._split if split else None)

    def _split(self, group: Sequence, keep: int) -> Sequence:
        rest = Sequence(list(group.prompt_token_ids), group.max_tokens, group.priority, arrival=group.arrival,
                        num_samples=group.num_samples - keep)
        self.live.append(rest)
        self.groups.append(rest)
        return rest

    @precondition(lambda self: self.sched is not None)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=tokens, max_tokens=st.integers(1, 12), prio=st.sampled_from(list(Priority)),
          samples=st.sampled_from([1, 2, 3, 5]))
    def arrive(self, prefix, suffix, max_tokens, prio, samples):
        self.now += 1.0
        if not self.sched.preemptible:  # (choices are forked in-process only: a runtime's requests are one sequence)
            samples = 1
        seq = Sequence(prefix + suffix, max_tokens, prio, arrival=self.now, num_samples=samples)
        try:
            self.sched.add(seq)
        except (NeverFits, QueueFull, TooManySamples):  # the only refusals; anything else is a bug
            return
        self.live.append(seq)
        self.groups.append(seq)
        self.choices += samples
        self.sched.schedule()

    @precondition(lambda self: self.sched is not None and self.sched.running)
    @rule(data=st.data())
    def step(self, data):
        seq = data.draw(st.sampled_from(self.sched.running))
        if seq.remaining_tokens == 0:
            self.sched.finish(seq)
            self.live.remove(seq)
        else:
            self.sched.append(seq, data.draw(st.integers(0, 9)))
        self.sched.schedule()

    @precondition(lambda self: self.sched is not None and any(s.unforked for s in self.sched.running))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from([s for s in self.sched.running if s.unforked]))
        child = Sequence(list(parent.prompt_token_ids), parent.max_tokens, parent.priority, arrival=parent.arrival)
        self.sched.fork(parent, child)
        self.live.append(child)
        self.sched.schedule()

    @precondition(lambda self: self.sched is not None and self.live)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.sched.finish(seq)
        self.live.remove(seq)
        self.sched.schedule()

    @invariant()
    def budgets_hold(self):
        if self.sched is not None:
            self.sched.check_invariants()
            for seq in self.sched.running:
                assert len(seq.output_token_ids) <= seq.max_tokens or self.sched.preemptible
            assert sum(g.num_samples for g in self.groups) == self.choices, "a split lost or doubled choices"
            # Everything queued fits an idle engine (or was refused): after a scheduling pass
            # something runs whenever something waits.
            assert self.sched.running or not (self.sched.waiting or self.sched.swapped), "work waits on an idle engine"

    def teardown(self):
        if self.sched is None:
            return
        for seq in list(self.live):
            self.sched.finish(seq)
        self.sched.check_invariants()
        assert self.sched.bm.is_idle(), "blocks leaked"
        assert self.sched.stats.append_overflows == 0


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
