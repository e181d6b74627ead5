"""The iteration-level scheduler: waiting, running and swapped queues over one BlockManager.

It is a plain synchronous policy object, like nano-vllm's: the engine calls ``add`` when a
request arrives, ``schedule`` whenever something changed (an arrival, a finish, an abort; no
timer), ``append`` as tokens are produced, and ``finish`` on every exit path. It knows nothing
about HTTP, asyncio or any runtime.

Two admission modes, chosen by the backend's capabilities:

* preemptible (in-process engine, llama.cpp slot swap): admit while blocks are free; when a
  running sequence needs a block and none is left, preempt the lowest-priority running
  sequence by swap or recompute and resume it first when room returns.
* not preemptible (remote runtimes whose streams cannot be paused): a request is admitted only
  if its worst-case growth (up to max_tokens) fits beside the worst-case growth of everything
  running, so an append never fails. Blocks are still allocated one at a time as tokens
  stream back; the headroom is bookkeeping, not memory.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from kvstream.kv.block_manager import UNKNOWN_TOKEN, BlockManager
from kvstream.kv.block_pool import NoFreeBlocks


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Priority(enum.IntEnum):
    """Per-request priority class; lower runs first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2

    @classmethod
    def parse(cls, value: object) -> Priority:
        """Accept 'high'|'normal'|'low' or 0|1|2 (body field or X-KVStream-Priority header)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            text = value.strip().lower()
            if text in cls.__members__.keys() | {m.lower() for m in cls.__members__}:
                return cls[text.upper()]
            if text.isdigit():
                value = int(text)
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1, 2):
            return cls(value)
        raise ValueError("priority must be one of high, normal, low (or 0, 1, 2)")


class SchedulerError(Exception):
    """A request the scheduler refuses; ``status`` is the HTTP status to answer with."""

    status = 400
    code = "invalid_request"


class NeverFits(SchedulerError):
    status = 400
    code = "context_length_exceeded"


class TooManySamples(SchedulerError):
    """A request whose choices (``n``, ``best_of``) outnumber the batch of a scheduler that
    admits a group's forks together (no ``split_group``), so it could never be."""

    status = 400
    code = "invalid_value"


class QueueFull(SchedulerError):
    status = 429
    code = "queue_full"


_seq_counter = itertools.count()
# fcfs order within each class; a C-level key, since the queue is ordered on every pass.
_ARRIVAL_ORDER = attrgetter("priority", "arrival")


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it."""

    prompt_token_ids: list[int]
    max_tokens: int
    priority: Priority = Priority.NORMAL
    seq_id: str = field(default_factory=lambda: f"seq-{next(_seq_counter)}")
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    admitted_at: float | None = None
    # False for a request that cannot be paused and resumed (remote runtimes: one using
    # features a resumed stream could not continue, such as tool calls).
    preemptible: bool = True
    # n choices: the prompt is computed once, then the table is forked n - 1 times; the
    # slots of the forks are reserved from admission until fork() takes them.
    num_samples: int = 1
    # The tenant's chain root (kv.hashing.tenant_root): its prefixes match only its own.
    cache_root: bytes | None = None
    # Most prompt tokens taken from the prefix cache at admission (None: as many as are
    # cached). A request scoring its prompt needs logits where it has no stored scores.
    max_reused_tokens: int | None = None
    overtaken: int = 0  # lpm: times a later arrival was admitted first
    unforked: int = 0  # forks still to come (reserved slots)
    forked: bool = False  # the forks were made (a re-admitted parent reserves none)
    # (prompt tokens, seconds): once it finishes, the cached blocks of those first tokens
    # are kept past ordinary cached blocks that long (BlockPool.retain); a client asked.
    cache_retention: tuple[tuple[int, float], ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Tokens this request may hold at most: the prompt once, each choice's output."""
        return len(self.prompt_token_ids) + self.max_tokens * self.num_samples

    @property
    def max_choice_tokens(self) -> int:
        """Tokens one of its choices may reach: the prompt and its output (what a model's
        context bounds: each choice is a sequence of its own)."""
        return len(self.prompt_token_ids) + self.max_tokens

    @property
    def remaining_tokens(self) -> int:
        return max(0, self.max_tokens - len(self.output_token_ids))


@dataclass
class SchedulerConfig:
    """The knobs of the scheduling policy (mirrors the `scheduler` config section)."""

    max_batch_size: int = 8
    preemption_policy: str = "swap"  # swap | recompute
    policy: str = "fcfs"  # fcfs | sjf | lpm
    max_queue_size: int = 256
    # lpm: a waiting request is passed over for better prefix matches at most this many
    # times; then it goes first (FCFS among such), so nobody starves behind a hot prefix.
    lpm_max_overtakes: int = 8
    # lpm orders only this many waiting requests, the first in arrival order, by the prefix
    # they share with the runtime (one lookup each, every pass); the others wait behind them
    # in arrival order, so that a pass costs the same with 64 or 4,096 waiting (SGLang falls
    # back to fcfs past 128 waiting, for the same reason).
    lpm_window: int = 64
    # sjf aging: a waiting request's expected size shrinks by this many tokens per second
    # waited, so a long request is eventually first however many short ones arrive.
    sjf_aging_tokens_per_s: float = 200.0
    max_model_len: int | None = None
    # Cached blocks nobody has used for this long are forgotten (prefix_cache.ttl_seconds);
    # None keeps them until the pool needs the space.
    cache_ttl_s: float | None = None
    # A waiting request whose prompt shares at least this many tokens, past what is cached,
    # with a running one that has not computed them yet waits for them to be computed and
    # then reads them from the prefix cache instead of computing its own copy (prompts that
    # share a document and arrive together). Requests behind it are admitted meanwhile.
    # 0: never wait. Only where the block manager knows what is computed (in-process).
    wait_for_shared_prefix_tokens: int = 32


@dataclass
class ScheduleOutput:
    """What one scheduling pass changed: whom to start, resume and pause, and bytes to move."""

    admitted: list[Sequence] = field(default_factory=list)
    resumed: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_in_copies: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    swap_out_copies: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    cow_copies: list[tuple[int, int]] = field(default_factory=list)  # (device, device)

    def __bool__(self) -> bool:
        return bool(self.admitted or self.resumed or self.preempted)


@dataclass
class SchedulerStats:
    preemptions: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    append_overflows: int = 0  # non-preemptible appends that found no block (should stay 0)
    swap_drops: int = 0  # swapped sequences sent back to be recomputed to unstick the engine


class Scheduler:
    """Admits, orders, preempts and resumes sequences; owns the three queues."""

    def __init__(
        self,
        block_manager: BlockManager,
        config: SchedulerConfig,
        *,
        preemptible: bool,
        clock: Callable[[], float] = time.monotonic,
        affinity: Callable[[Sequence], int] | None = None,
        split_group: Callable[[Sequence, int], Sequence] | None = None,
    ) -> None:
        """``affinity`` (lpm): prompt tokens of a sequence the runtime already holds, as its
        owner infers it (a remote runtime's slots, or this pool's prefix cache). ``split_group``:
        see the attribute."""
        self.bm = block_manager
        self.affinity = affinity
        # A group of n choices at the head of the queue that finds fewer free slots than it
        # has choices runs those that fit now: split_group(seq, keep) queues the others as a
        # group of their own and returns its sequence (the owner names it and keeps its
        # state); the scheduler then admits ``seq`` with ``keep`` choices. A group past the
        # batch is split to a batch at the head of the queue the same way. None: a group
        # waits for slots for all of its choices, holding the queue behind it, and one past
        # the batch is refused (TooManySamples).
        self.split_group = split_group
        self.config = config
        self.preemptible = preemptible
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.stats = SchedulerStats()
        # Non-preemptible mode: blocks each running sequence may still claim, and their sum.
        self._growth: dict[str, int] = {}
        # (kept incrementally: admission must stay O(1) with hundreds running).
        self._headroom = 0
        self._next_expiry = 0.0
        # Batch slots held for forks to come (Sequence.unforked, summed over running).
        self._reserved = 0

    # ----------------------------------------------------------------- intake
    def check_fits(self, seq: Sequence) -> None:
        """Raise NeverFits if ``seq`` could not run even on an empty pool (TooManySamples if
        its choices could not run together in an empty batch and are never split)."""
        if self.split_group is None and self._slots_for(seq) > self.config.max_batch_size:
            raise TooManySamples(
                f"This request samples {seq.num_samples} choices together, more than the batch of "
                f"{self.config.max_batch_size} sequences the engine runs at once."
            )
        limit = self.config.max_model_len
        if limit is not None and len(seq.prompt_token_ids) >= limit:
            raise NeverFits(
                f"The prompt has {len(seq.prompt_token_ids)} tokens, more than the model's context of "
                f"{limit} tokens holds with one token to generate."
            )
        if limit is not None and seq.max_choice_tokens > limit:
            raise NeverFits(
                f"This request needs {seq.max_choice_tokens} tokens ({len(seq.prompt_token_ids)} in the "
                f"prompt + max_tokens {seq.max_tokens}), more than the model's context of {limit} tokens."
            )
        # Preemptible, its choices grow and are preempted one by one: one must fit the pool
        # (n choices without max_tokens, each up to the context, were refused). Otherwise all
        # it may hold is reserved at admission.
        needed = seq.max_choice_tokens if self.preemptible else seq.max_total_tokens
        capacity = self.bm.pool.num_blocks * self.bm.block_size
        if self.bm.blocks_for(needed) > self.bm.pool.num_blocks:
            choices = f" for each of {seq.num_samples} choices" if needed != seq.max_choice_tokens else ""
            raise NeverFits(
                f"This request needs {needed} tokens ({len(seq.prompt_token_ids)} in the prompt + max_tokens "
                f"{seq.max_tokens}{choices}), more than the whole KV pool of {capacity} tokens."
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new request, or raise NeverFits / QueueFull at once."""
        self.check_fits(seq)
        if len(self.waiting) >= self.config.max_queue_size:
            raise QueueFull(f"The queue is full ({self.config.max_queue_size} requests waiting).")
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    # ------------------------------------------------------------- scheduling
    def _order_key(self, seq: Sequence, now: float) -> tuple[float, float, float]:
        policy = self.config.policy
        if policy == "sjf":
            waited = now - seq.arrival
            size = seq.max_total_tokens - self.config.sjf_aging_tokens_per_s * waited
            return (seq.priority, size, seq.arrival)
        if policy == "lpm" and self.affinity is not None and seq.overtaken < self.config.lpm_max_overtakes:
            # Longest prefix the runtime holds first (SGLang's lpm); those passed over too
            # often sort before every match.
            return (seq.priority, -self.affinity(seq), seq.arrival)
        return (seq.priority, -float("inf"), seq.arrival) if policy == "lpm" else (seq.priority, seq.arrival, 0.0)

    def _order_waiting(self, now: float) -> None:
        """Put the waiting queue in admission order (``_order_key``); lpm only within its
        window (``lpm_window``: the first in arrival order), the rest behind it by arrival."""
        if self.config.policy == "sjf":  # (sizes age with time: every key changes)
            self.waiting.sort(key=lambda s: self._order_key(s, now))
            return
        self.waiting.sort(key=_ARRIVAL_ORDER)  # (nearly sorted already: a linear pass)
        if self.config.policy == "lpm" and self.affinity is not None:
            window = self.config.lpm_window
            self.waiting[:window] = sorted(self.waiting[:window], key=lambda s: self._order_key(s, now))

    def _may_admit(self) -> bool:
        """Whether a pass could admit anyone: a batch slot is free, or a running sequence
        of a lower class than the best waiting one could be preempted for it."""
        if len(self.running) + self._reserved < self.config.max_batch_size:
            return True
        if not self.preemptible or not self.waiting:
            return False
        best = min(seq.priority for seq in self.waiting)
        return any(seq.preemptible and seq.priority > best for seq in self.running)

    def _expire_cache(self, now: float) -> None:
        """Drop cached blocks past the TTL before they can be matched; the scan over the
        free queue runs at most once per tenth of the TTL (and per second), not per call."""
        ttl = self.config.cache_ttl_s
        if ttl is None or now < self._next_expiry:
            return
        self._next_expiry = now + min(1.0, ttl / 10)
        self.bm.pool.drop_expired(ttl)

    def _recount_headroom(self) -> int:
        total = 0
        for seq in self.running:
            table = self.bm.tables.get(seq.seq_id)
            held = len(table.blocks) if table else 0
            total += max(0, self.bm.blocks_for(seq.max_total_tokens) - held)
        return total

    def _reserve_growth(self, seq: Sequence) -> None:
        if self.preemptible:
            return
        growth = max(0, self.bm.blocks_for(seq.max_total_tokens) - len(self.bm.tables[seq.seq_id].blocks))
        self._growth[seq.seq_id] = growth
        self._headroom += growth

    def _release_growth(self, seq: Sequence) -> None:
        self._headroom -= self._growth.pop(seq.seq_id, 0)

    def _blocks_to_admit(self, seq: Sequence) -> int:
        tokens = seq.prompt_token_ids + seq.output_token_ids
        needed = self.bm.blocks_needed(tokens, seq.cache_root, max_reused=seq.max_reused_tokens)
        if not self.preemptible:
            needed += self.bm.blocks_for(seq.max_total_tokens) - self.bm.blocks_for(len(tokens))
        return needed

    def schedule(self) -> ScheduleOutput:
        """Resume swapped sequences, then admit waiting ones, while slots and blocks allow."""
        out = ScheduleOutput()
        if not self.waiting and not self.swapped:
            return out
        now = self.clock()
        self._expire_cache(now)
        if not self.swapped and not self._may_admit():
            # The common case under load (an arrival while every slot is busy): ordering
            # the queue would change nothing.
            return out
        self._order_waiting(now)
        # A waiting request of a strictly higher class goes before the swapped (it may have
        # been what preempted them); otherwise the preempted resume first.
        urgent = self.waiting[0].priority if self.waiting else None
        for seq in sorted(self.swapped, key=lambda s: self._order_key(s, now)):
            if urgent is not None and urgent < seq.priority:
                break
            if not self._can_resume(seq) and not self._split_to_fit(seq, -1):
                break
            self._resume(seq, out)
        if not self.running and self.swapped:
            self._unstick(out, now)
        if self.swapped and (urgent is None or urgent >= min(s.priority for s in self.swapped)):
            return out  # the preempted resume first; nobody of their class jumps ahead of them
        position = 0  # waiting[:position] wait for a prefix another request is computing
        while position < len(self.waiting):
            seq = self.waiting[position]
            if self.swapped and seq.priority >= min(s.priority for s in self.swapped):
                return out
            if self._shares_prefix_in_flight(seq):
                position += 1
                continue
            if self.split_group is not None and self._slots_for(seq) > self.config.max_batch_size:
                self._split(seq, self.config.max_batch_size, position)  # a batch of choices at most at once
            # No free slot or not enough blocks: preempt a running request of a lower class
            # (preemptible backends only), or wait.
            short = self._shortfall(seq)
            if short != (0, 0):
                if not self._preempting_makes_room(seq.priority, *short) and not self._split_to_fit(seq, position):
                    # Head of line waits (admitting around it could starve it); preempting
                    # would not make it fit (the victims' blocks shared with swapped sequences
                    # stay), and would only stop work that could finish and free them.
                    return out
                while self._shortfall(seq) != (0, 0):
                    victim = self._pick_victim(below=seq.priority)
                    if victim is None:
                        return out  # head of line waits; admitting around it could starve it
                    self._preempt(victim, out)
            self.waiting.remove(seq)
            if self.config.policy == "lpm":
                # Aging: earlier arrivals of its class passed over (all in the window, or
                # before the position it was admitted from: behind the window the order is
                # arrival's).
                for other in self.waiting[: max(self.config.lpm_window, position)]:
                    other.overtaken += other.arrival < seq.arrival and other.priority == seq.priority
            if out.preempted:
                # Recompute victims re-entered the queue; put them in their place behind.
                self._order_waiting(now)
                position = 0
            seq.num_cached_tokens = self.bm.allocate(
                seq.seq_id, seq.prompt_token_ids + seq.output_token_ids, seq.cache_root, max_reused=seq.max_reused_tokens
            )
            self._reserve_growth(seq)
            self._reserve_forks(seq)
            seq.status = SeqStatus.RUNNING
            seq.admitted_at = now
            self.running.append(seq)
            out.admitted.append(seq)
        return out

    def _shortfall(self, seq: Sequence) -> tuple[int, int]:
        """(batch slots, device blocks) missing to admit waiting ``seq`` now; (0, 0) if none."""
        slots = len(self.running) + self._reserved + self._slots_for(seq) - self.config.max_batch_size
        blocks = self._blocks_to_admit(seq) - (self.bm.num_free_blocks - self._headroom)
        return max(0, slots), max(0, blocks)

    def _split_to_fit(self, seq: Sequence, position: int) -> bool:
        """Whether group ``seq`` (n choices, not forked yet), waiting at ``position`` or
        swapped (-1: preempted before it forked), can be admitted or resumed once split: the
        most of its choices that fit now stay in it, the others are queued right behind it
        (a swapped one's first in the queue) as a group of their own (``split_group``). Free
        lanes are used at once instead of idling until the whole group fits."""
        if self.split_group is None or seq.forked or seq.num_samples < 2:
            return False
        choices = seq.num_samples
        free = self.config.max_batch_size - len(self.running) - self._reserved
        keeps = range(min(choices - 1, free), 0, -1)
        if self.preemptible:  # (admission counts the prompt's blocks alone: fewer choices free none)
            keeps = keeps[:1]
        for keep in keeps:
            seq.num_samples = keep  # (blocks reserved at admission count the choices)
            fits = self._can_resume(seq) if seq.status is SeqStatus.SWAPPED else self._shortfall(seq) == (0, 0)
            seq.num_samples = choices
            if fits:
                self._split(seq, keep, position)
                return True
        return False

    def _split(self, seq: Sequence, keep: int, position: int) -> None:
        """Leave ``keep`` of ``seq``'s choices in it; the rest wait right behind its
        ``position`` in the queue (-1: first)."""
        assert self.split_group is not None
        rest = self.split_group(seq, keep)
        seq.num_samples = keep
        rest.status = SeqStatus.WAITING
        self.waiting.insert(position + 1, rest)

    def _preempting_makes_room(self, below: Priority, slots: int, blocks: int) -> bool:
        """Whether preempting every running sequence of a class below ``below`` would free
        ``slots`` slots and ``blocks`` device blocks: a block counts only when the victims
        hold all of its references (one shared with a swapped or other running sequence
        stays on the device), and, when victims are swapped out, only when one victim holds
        it: a swapped sequence keeps its shared blocks on the device, so forks of one prompt
        swapped one after the other pin the prompt's blocks there (admission would preempt
        them all and still not fit, leaving the engine idle with work waiting)."""
        victims = [s for s in self.running if self.preemptible and s.preemptible and s.priority > below]
        held: dict[int, int] = {}
        blocks_by_id = {}
        for victim in victims:
            for block in self.bm.tables[victim.seq_id].blocks:
                held[block.block_id] = held.get(block.block_id, 0) + 1
                blocks_by_id[block.block_id] = block
        most_refs = 1 if self.config.preemption_policy == "swap" else None
        freed = sum(1 for block_id, refs in held.items()
                    if blocks_by_id[block_id].ref_cnt == refs and (most_refs is None or refs <= most_refs))
        return len(victims) + sum(v.unforked for v in victims) >= slots and freed >= blocks

    def _can_resume(self, seq: Sequence) -> bool:
        """Whether swapped ``seq`` can come back now and decode at least one token: a slot,
        its host blocks, and the block its next token opens or copies (``blocks_to_resume``);
        without that last one it would preempt itself at once, come back, and again, the
        engine making no progress."""
        if len(self.running) + self._reserved + self._slots_for(seq) > self.config.max_batch_size:
            return False
        return self.bm.blocks_to_resume(seq.seq_id) <= self.bm.num_free_blocks

    def _resume(self, seq: Sequence, out: ScheduleOutput) -> None:
        copies = self.bm.swap_in(seq.seq_id)
        out.swap_in_copies += copies
        self.stats.swap_ins += 1
        self.stats.swapped_in_blocks += len(copies)
        self.swapped.remove(seq)
        self._reserve_forks(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        out.resumed.append(seq)

    def _unstick(self, out: ScheduleOutput, now: float) -> None:
        """Nothing runs and the first swapped sequence in order cannot come back (the device
        blocks it needs are pinned by the shared blocks other swapped sequences keep there):
        holding the order would idle the engine forever. The first that can come back
        resumes; if none can, the last in order drops its KV (it is recomputed later, mostly
        from the prefix cache), releasing what it pinned, until one can."""
        while self.swapped:
            order = sorted(self.swapped, key=lambda s: self._order_key(s, now))
            ready = next((s for s in order if self._can_resume(s)), None)
            if ready is not None:
                self._resume(ready, out)
                return
            dropped = order[-1]
            self.swapped.remove(dropped)
            self.bm.free(dropped.seq_id)
            dropped.status = SeqStatus.WAITING
            self.waiting.append(dropped)
            self._order_waiting(now)
            self.stats.swap_drops += 1

    def _shares_prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether ``seq`` should wait for a running request to compute a prefix it shares."""
        least = self.config.wait_for_shared_prefix_tokens
        tokens = seq.prompt_token_ids + seq.output_token_ids
        return least > 0 and seq.max_reused_tokens is None and self.bm.prefix_in_flight(tokens, seq.cache_root) >= least

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` as a copy of running ``parent`` (one of its n choices): it shares
        every block of the parent's table (copy-on-write) and takes a reserved slot."""
        assert parent.status is SeqStatus.RUNNING and parent.unforked > 0, "no fork reserved for this sequence"
        self.bm.fork(parent.seq_id, child.seq_id)
        parent.unforked -= 1
        parent.forked = True
        self._reserved -= 1
        child.status = SeqStatus.RUNNING
        child.admitted_at = parent.admitted_at
        child.num_cached_tokens = parent.num_cached_tokens
        self.running.append(child)

    # ---------------------------------------------------------------- growth
    def append(self, seq: Sequence, token_id: int = UNKNOWN_TOKEN) -> ScheduleOutput:
        """Record one generated token; preempts others (or ``seq`` itself) if memory is short.

        Returns what was preempted and the copies the backend must perform first.
        """
        out = ScheduleOutput()
        if not self.preemptible and len(seq.output_token_ids) >= seq.max_tokens:
            # Past its reservation (a runtime that generates more than KVStream assumed for
            # a request with no max_tokens): counted, but given no block, since every free
            # block is owed to someone's growth or to the next admission.
            self.stats.append_overflows += 1
            seq.output_token_ids.append(token_id)
            return out
        while True:
            try:
                copy = self.bm.append_token(seq.seq_id, token_id)
            except NoFreeBlocks:
                if not self.preemptible:  # unreachable under the headroom rule; never corrupt the table
                    self.stats.append_overflows += 1
                    seq.output_token_ids.append(token_id)
                    return out
                victim = self._pick_victim(below=None) or seq
                self._preempt(victim, out)
                if victim is seq:
                    return out
                continue
            seq.output_token_ids.append(token_id)
            if copy is not None:
                out.cow_copies.append(copy)
            elif self._growth.get(seq.seq_id) and len(self.bm.tables[seq.seq_id].token_ids) % self.bm.block_size == 1:
                # This token opened a new block: one less the sequence may still claim.
                self._growth[seq.seq_id] -= 1
                self._headroom -= 1
            return out

    # ------------------------------------------------------------ preemption
    def _pick_victim(self, below: Priority | None) -> Sequence | None:
        """The running sequence to preempt: lowest priority class, then latest arrival.

        With ``below`` set (admission of a waiting request), only sequences of a strictly
        lower priority class qualify, so equals never evict each other.
        """
        if not self.preemptible:
            return None
        candidates = [s for s in self.running if s.preemptible and (below is None or s.priority > below)]
        if not candidates:
            return None
        return max(candidates, key=lambda s: (s.priority, s.arrival))

    def _slots_for(self, seq: Sequence) -> int:
        """Batch slots ``seq`` takes when it runs: itself and the forks it has still to make."""
        return 1 if seq.forked else seq.num_samples

    def _reserve_forks(self, seq: Sequence) -> None:
        seq.unforked = self._slots_for(seq) - 1
        self._reserved += seq.unforked

    def _release_forks(self, seq: Sequence) -> None:
        self._reserved -= seq.unforked
        seq.unforked = 0

    def _preempt(self, seq: Sequence, out: ScheduleOutput) -> None:
        self.running.remove(seq)
        self._release_forks(seq)  # taken again at re-admission, if it still has to fork
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_policy == "swap" and self.bm.can_swap_out(seq.seq_id):
            copies = self.bm.swap_out(seq.seq_id)
            self.stats.swap_outs += 1
            self.stats.swapped_out_blocks += len(copies)
            out.swap_out_copies += copies
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
            return
        # Recompute: drop the KV; the prompt plus what was generated is prefilled again
        # (mostly from the prefix cache, since freed blocks keep their hashes).
        self.bm.free(seq.seq_id)
        seq.status = SeqStatus.WAITING
        self.waiting.insert(0, seq)

    # ----------------------------------------------------------------- exits
    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` from whatever queue holds it and free its blocks. Idempotent."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self._release_growth(seq)
        self._release_forks(seq)
        now = self.bm.pool.clock()  # type: ignore[operator]
        self.bm.free(seq.seq_id, [(tokens, now + seconds) for tokens, seconds in seq.cache_retention])
        seq.status = SeqStatus.FINISHED

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """The block manager's invariants plus the scheduler's budget and queue rules."""
        self.bm.check_invariants()
        assert len(self.running) + self._reserved <= self.config.max_batch_size, "sequence budget exceeded"
        assert self._reserved == sum(s.unforked for s in self.running), "fork reservations drifted"
        ids = [s.seq_id for s in self.running + self.waiting + self.swapped]
        assert len(ids) == len(set(ids)), "a sequence is in two queues"
        for seq in self.running:
            assert seq.seq_id in self.bm.tables and seq.status is SeqStatus.RUNNING
        for seq in self.swapped:
            assert seq.seq_id in self.bm.swapped and seq.status is SeqStatus.SWAPPED
        for seq in self.waiting:
            assert seq.seq_id not in self.bm.tables and seq.seq_id not in self.bm.swapped
        if not self.preemptible:
            assert self._headroom == self._recount_headroom(), "growth headroom bookkeeping drifted"
            assert self._headroom <= self.bm.num_free_blocks, "growth headroom overcommitted"
