"""The in-process engine: KVStream's scheduler and block manager driving a real model.

Each ``step()`` is one iteration of continuous batching:

1. take in new requests, aborts and tokens decided beside the steps (thread-safe inboxes;
   everything else runs on the engine's own thread);
2. ``scheduler.schedule()`` resumes swapped sequences and admits waiting ones; the copies it
   returns (swap in, swap out) are carried out on the KV pool before anything is written;
3. each running sequence's last sampled token is appended to its block table, which may
   take a new block, copy a shared one (CoW) or preempt another sequence (swap/recompute);
4. one forward pass over a packed row holding every running sequence's uncomputed tokens
   (one per decode, a chunk per prefill, within ``max_num_batched_tokens``), logits only
   where a token is sampled;
5. the newly computed full blocks are committed to the prefix cache, tokens are sampled,
   detokenized and checked against stop conditions, and finished sequences free their blocks.
   A row whose constraint judges candidates slowly (a client's expression the ``regex``
   module follows, or a lazy grammar's trigger patterns) is decided on a side thread instead
   (side_decisions.py) and sits out the steps until its token is back, so that its matching
   time is not every row's.

Invariant kept for correctness: a block is shareable (hashed) only once its KV has been
written, and a sequence's ``num_computed`` tokens are exactly those whose KV is in the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from kvstream.config import default
from kvstream.hf import compat
from kvstream.hf import blend as blend_module
from kvstream.hf import engine_turns, fast_decoder, flash, flex, native_linear, native_ops
from kvstream.hf.attention import AttentionPlan, scattered_plan
from kvstream.hf.attention_tiers import TierChoice, choose_tier
from kvstream.hf.blend import BlendParams
from kvstream.hf.detokenize import IncrementalDetokenizer
from kvstream.hf.kv_cache import KVShape, PagedKVCache, auto_batch_size, pool_dtype
from kvstream.hf.kv_store import BlockCodec, DiskBlockStore, HostBlockStore
from kvstream.hf.sampling import (
    History, NoTokenToDraw, SamplingParams, TokenLogprobs, drawn_logprobs, logprobs_of, sample,
)
from kvstream.hf.json_schema import JSON_OBJECT, compile_schema
from kvstream.hf.lazy_grammar import LazyGrammar
from kvstream.hf.pattern_constraint import CLIENT_BUDGET_S, PatternConstraint, expression
from kvstream.hf.prefill_pacing import PrefillPacer
from kvstream.hf.prompt_scores import STORED_TOP, PromptScores
from kvstream.hf.side_decisions import SideDecider
from kvstream.hf.thinking_budget import ThinkingBudget, ThinkTokens
from kvstream.hf.token_bytes import TokenBytes
from kvstream.hf.block_manager import ReuseBlockManager
from kvstream.scheduler import (
    QueueFull,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
    ScheduleOutput,
    Sequence,
    SeqStatus,
)
from kvstream.types import BackendError, BackendRejected, PromptProgress

logger = logging.getLogger(__name__)


SCORE_LOGITS_BYTES = 256 * 2**20  # most memory one step's prompt scoring may hold in logits
# A step waits for tokens decided aside (side_decisions.py) up to this share of the last
# step's time, so that a row whose token comes back at once (most: a cheap expression's
# token takes a millisecond) rejoins the very next step instead of sitting one out. At most
# DECISION_GRACE_MAX_S: after a long prefill step a costly token would hold the next one long.
DECISION_GRACE_SHARE = 0.1
DECISION_GRACE_MAX_S = 0.01


class EngineStopped(RuntimeError):
    """The engine thread is not running: not started, or stopped before the job ran."""


@dataclass
class RunnerConfig:
    """Sizes and policies of the in-process engine. Settings it shares with the proxy take
    their one default from config.py; ``HFBackend`` fills them from the Settings object."""

    block_size: int = default("memory", "block_size")
    num_blocks: int = 1024  # config's "auto" is resolved by the caller (kv_cache.auto_num_blocks)
    num_cpu_blocks: int = default("memory", "num_cpu_blocks")
    max_num_seqs: int | Literal["auto"] = default("scheduler", "max_batch_size")  # "auto": kv_cache.auto_batch_size
    # Tokens in one forward pass (decodes count one each); long prompts are prefilled in
    # chunks of at most this, interleaved with running decodes.
    max_num_batched_tokens: int = default("scheduler", "max_num_batched_tokens")
    # While sequences decode, a step's prompt tokens are sized to keep it about this long
    # (prefill_pacing.py); 0: chunks of max_num_batched_tokens whatever they cost. The server
    # sets scheduler.prefill_step_ms (500); a runner built directly is unpaced, so that what
    # its steps compute depends on its requests alone, not on how fast the machine ran.
    prefill_step_ms: int = 0
    preemption_mode: str = default("scheduler", "preemption_policy")  # swap | recompute
    policy: str = default("scheduler", "policy")  # auto (= fcfs here) | fcfs | sjf | lpm
    enable_prefix_caching: bool = default("prefix_cache", "enabled")
    max_prefix_length: int | None = None  # longest prefix reused (tokens); None = no cap
    cache_ttl_s: float | None = None  # cached blocks unused this long are forgotten; None = kept
    max_queue_size: int = default("scheduler", "max_queue_size")
    max_model_len: int | None = None
    model_identity: str = "hf"
    # float16 | bfloat16 | float32: the KV pool's dtype when it differs from the model's (a
    # float32 CPU model with half-precision K/V: half the pool bytes, half what decode reads
    # at long context; the kernels widen K/V as they read them); None = the model's dtype.
    kv_dtype: str | None = None
    attention: str = "auto"  # auto | flash | native | flex | sdpa | eager: the tier, probed at start (attention_tiers.py)
    # auto | native | torch: what runs the linear layers for decode-sized batches (native_linear.py);
    # all but torch also put the norms and rotary embedding on native_ops.py's kernels
    matmul: str = "auto"
    # Spill tiers for cached blocks the pool reclaims (kv_store.py): host RAM within
    # host_cache_bytes (0: none), then disk_cache_dir within disk_cache_bytes (None: none).
    # kv_cache_bits 8 or 4 stores spilled and swapped blocks KIVI-quantized (None: model
    # precision); a swapped sequence's partial last block stays exact.
    kv_cache_bits: int | None = None
    host_cache_bytes: int = default("memory", "host_cache_bytes")
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = default("memory", "disk_cache_bytes")
    debug_invariants: bool = False  # check every invariant after every step (tests)


@dataclass
class TokenEvent:
    """What one step produced for one request, delivered to its sink."""

    kind: str  # "admitted" | "progress" (of the prompt) | "prompt" (its tokens' logprobs, echo) | "token" | "error"
    token_id: int | None = None
    text: str = ""
    finish_reason: str | None = None
    error: BaseException | None = None
    logits: torch.Tensor | None = None  # the first token's, when SamplingParams asks for them
    logprobs: TokenLogprobs | None = None  # this token's, when SamplingParams asks for them
    index: int = 0  # the choice this event belongs to (n > 1)
    prompt_logprobs: list[TokenLogprobs] | None = None  # "prompt": each prompt token's after the first
    stop_sequence: str | None = None  # the stop string that ended the choice, if one did
    progress: PromptProgress | None = None  # "progress": how far the prompt is computed


Sink = Callable[[list[TokenEvent]], None]


def _finishing_within(prefills: list[tuple[RunnerRequest, int]], tokens: int) -> set[int]:
    """The ids of the requests whose prompts (request, tokens left) finish within ``tokens``
    together, taken in order."""
    quick: set[int] = set()
    for req, todo in prefills:
        if todo <= tokens:
            quick.add(id(req))
            tokens -= todo
    return quick


@dataclass(eq=False)
class RunnerRequest:
    """A request inside the engine: its scheduler sequence plus decoding state."""

    seq: Sequence
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    sink: Sink
    generator: torch.Generator | None = None
    num_computed: int = 0  # tokens of the block table whose KV is in the pool
    pending: int | None = None  # sampled, not yet in the block table
    num_generated: int = 0
    admitted: bool = False
    events: list[TokenEvent] = field(default_factory=list)
    blend: BlendParams | None = None  # reuse: blend (moved chunks); None = exact reuse only
    moved_tokens: int = 0  # prompt tokens whose KV a blend moved instead of computing
    repaired_tokens: int = 0  # of those, recomputed by the repair
    approx_from: int | None = None  # first position holding moved (approximate) KV
    index: int = 0  # choice index among the request's n (forks carry 1..n-1)
    # The id aborting the client's request ends (its first sequence's): its choices' ids
    # are "<request_id>/<index>", its other groups' too (add_request).
    request_id: str = ""
    constraint: PatternConstraint | None = None  # a held answer: what may come next
    lazy: LazyGrammar | None = None  # a lazy grammar's wait for its trigger (the constraint then)
    thinking: ThinkingBudget | None = None  # a cap on its <think> block (thinking_budget.py)
    # Echo with logprobs: entry i scores prompt token i + 1 (kept scores of its prefix
    # first, then filled as prefill chunks run; kept across a recompute preemption, whose
    # rerun scores nothing twice). ``scoring`` until the prompt is scored.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    scoring: bool = False
    # Report the prompt's computation (llama-server's return_progress): from when (its first
    # admission), what the cache (or a blend) held then, and the most tokens reported computed,
    # so that reports only go forward (a recompute preemption computes the prompt again).
    reports_progress: bool = False
    progress_from: float = 0.0
    progress_cache: int = 0
    progress_reported: int = 0

    def __post_init__(self) -> None:
        self.request_id = self.request_id or self.seq.seq_id


@dataclass
class Decision:
    """A token decided on the side thread (side_decisions.py), with what the step would have
    computed beside it: its logprobs, the first token's logits (``keep_first_logits``), and a
    lazy grammar's constraint where the token triggered it."""

    token: int
    logprobs: TokenLogprobs | None
    first_logits: torch.Tensor | None
    triggered: PatternConstraint | None = None


@dataclass
class RunnerCounters:
    steps: int = 0
    step_requests: int = 0  # the requests each step held, summed (over steps: busy lanes per step)
    forward_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (re-admissions included)
    restored_blocks: int = 0  # blocks copied back from the spill tiers instead of recomputed
    blends: int = 0  # blend prefills run (reuse: blend requests whose moved chunks paid off)
    moved_tokens: int = 0  # tokens whose KV was moved (approximate reuse)
    repaired_tokens: int = 0  # moved tokens recomputed by the repair
    scored_tokens: int = 0  # prompt tokens scored from logits computed (echo with logprobs)
    kept_score_tokens: int = 0  # prompt tokens whose scores came from kept blocks instead
    embedding_tokens: int = 0  # tokens computed for embeddings (between the steps, embeddings.py)


class ModelRunner:
    """Continuous batching over a paged KV pool for one HF causal LM."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, config: RunnerConfig) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.kv_shape = KVShape.of(model.config)
        self.compute_dtype = next(model.parameters()).dtype
        self.kv_dtype = pool_dtype(config.kv_dtype) or self.compute_dtype
        if self.kv_dtype != self.compute_dtype:  # cached K/V of another precision is another cache
            config = replace(config, model_identity=f"{config.model_identity}:kv={config.kv_dtype}")
        self.attention = choose_tier(
            config.attention, model.config.num_attention_heads, self.kv_shape, self.compute_dtype, self.device, config.block_size,
            kv_dtype=self.kv_dtype,
        )
        config = replace(config, attention=self.attention.name)
        # The norms and rotary embedding go native unless torch's own ops are asked for (native_ops.py).
        self.native_ops = native_ops.install(model, config.matmul != "torch")
        self.matmul = native_linear.install(model, config.matmul)
        config = replace(config, matmul=self.matmul.name)
        if config.max_num_seqs == "auto":
            config = replace(config, max_num_seqs=auto_batch_size(config.num_blocks, config.block_size))
        self.config = config
        self.cache = PagedKVCache(
            self.kv_shape, config.num_blocks, config.block_size, config.num_cpu_blocks, self.kv_dtype, self.device,
            swap_bits=config.kv_cache_bits,
        )
        shape = self.kv_shape
        if self.attention.name == "flex":  # compile for this pool now, not in the first request
            flex.warm_up(model.config.num_attention_heads, shape.num_kv_heads, shape.head_dim, self.kv_dtype, self.device, config.block_size)
        elif self.attention.name == "flash":
            flash.warm_up(model.config.num_attention_heads, shape.num_kv_heads, shape.head_dim, self.compute_dtype, self.kv_dtype,
                          self.device, config.block_size)
        self.store = self._build_store()
        bm = ReuseBlockManager(
            config.num_blocks,
            config.block_size,
            config.num_cpu_blocks,
            enable_prefix_cache=config.enable_prefix_caching,
            max_prefix_length=config.max_prefix_length,
            model_identity=config.model_identity,
            spill=self.store,
        )
        self.bm = bm
        self.scheduler = Scheduler(
            bm,
            SchedulerConfig(
                max_batch_size=config.max_num_seqs,
                preemption_policy=config.preemption_mode,
                # auto is fcfs here: the pool's prefix cache is shared by every running
                # sequence (no per-slot cache to steer toward); lpm orders by its hits.
                policy="fcfs" if config.policy == "auto" else config.policy,
                max_queue_size=config.max_queue_size,
                max_model_len=config.max_model_len,
                cache_ttl_s=config.cache_ttl_s,
            ),
            preemptible=True,
            affinity=lambda seq: len(bm.cached_prefix(seq.prompt_token_ids, seq.cache_root)) * bm.block_size,
            split_group=self._split_group,
        )
        self.layers = blend_module.decoder_layers(model)
        try:
            self.rotary: blend_module.RotaryShift | None = blend_module.RotaryShift(model)
        except ValueError:
            self.rotary = None  # no RoPE found: blend requests fall back to exact reuse
        self.blend_costs = blend_module.BlendCosts()
        compat.use_paged_attention(self.model)
        # Decoder layers as direct kernel calls where a probe gives the same logits (fast_decoder.py).
        self.decoder = fast_decoder.install(
            model, config.matmul != "torch", self.kv_shape, self.kv_dtype, config.block_size, lambda cache, seqs: self._plan(seqs, cache)
        )
        self.eos_ids = self._eos_ids()
        self.token_bytes = TokenBytes(tokenizer)  # each token's bytes: JSON mode, logprobs
        self._think_tokens: ThinkTokens | None = None  # the thinking budget's closing text, once asked for
        # The width of a row of logits: what logit_bias may name (tokenizers may list fewer).
        self.vocab_size: int | None = getattr(model.config, "vocab_size", None)
        # Prompt positions one step may score (echo with logprobs): each holds a row of
        # float32 logits, and the log-softmax another, so a long prompt is scored in chunks.
        self.score_rows = max(16, SCORE_LOGITS_BYTES // (8 * (self.vocab_size or 32_000)))
        self.prompt_scores = PromptScores(config.block_size, bm.salt)  # scored prompts' blocks, for their prefixes
        self.counters = RunnerCounters()
        self.pacer = PrefillPacer(config.prefill_step_ms / 1000, config.max_num_batched_tokens)
        self.requests: dict[str, RunnerRequest] = {}
        self._finished: list[RunnerRequest] = []  # finished this step, events not yet sent
        self._inbox: list[RunnerRequest] = []
        self._aborts: list[str] = []
        self._between_steps: deque[tuple[Future, Callable[[], Any]]] = deque()  # run_between_steps' jobs
        # Rows whose token is decided beside the steps (side_decisions.py): those out on the
        # side thread (engine thread only), and the decisions back from it (under the lock).
        self.side = SideDecider()
        self._deciding: dict[str, RunnerRequest] = {}
        self._decided: list[tuple[RunnerRequest, Decision | Exception]] = []
        self._stepped = False  # whether the last step computed anything
        self._last_step_s = 0.0  # ... and how long its forward took
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | Future | None = None
        self._stopping = False
        self._closed = False

    def _build_store(self) -> HostBlockStore | None:
        """The spill tiers under the pool, when the config asks for any."""
        cfg = self.config
        if cfg.host_cache_bytes <= 0 and cfg.disk_cache_dir is None:
            return None
        shape = self.kv_shape
        codec = BlockCodec(shape.num_layers, cfg.block_size, shape.num_kv_heads, shape.head_dim, self.kv_dtype, cfg.kv_cache_bits)
        disk = None
        if cfg.disk_cache_dir is not None:
            disk = DiskBlockStore(cfg.disk_cache_dir, codec, cfg.disk_cache_bytes, identity=cfg.model_identity)
            if len(disk):
                logger.info("disk KV tier %s: %d blocks from earlier runs", cfg.disk_cache_dir, len(disk))
        return HostBlockStore(codec, cfg.host_cache_bytes, disk)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
        return ids

    # ------------------------------------------------------------- requests
    def add_request(
        self, seq: Sequence, params: SamplingParams, sink: Sink, blend: BlendParams | None = None, n: int = 1,
        progress: bool = False,
    ) -> RunnerRequest:
        """Queue a request (any thread). Raises NeverFits / QueueFull at once. ``blend``
        opts the request into approximate reuse of moved chunks (blend.py). With ``n`` > 1
        the prompt is computed once and its block table forked into n choices (copy-on-write),
        each sampled from the same logits; events carry the choice's ``index``. Choices past
        the free lanes wait as a group of their own (``_split_group``). ``progress``:
        "progress" events report the prompt's computation, one at admission (what the cache
        held) and one after each forward that computed some of it."""
        self.check_fits(seq, n)
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.preserved_tokens)
        req = RunnerRequest(seq, params, detokenizer, sink, params.make_generator())
        req.blend = blend
        req.reports_progress = progress
        if params.prompt_logprobs is not None:
            req.scoring = True
            seq.max_reused_tokens = 0  # until the kept scores say more (_take_inbox)
        if params.json_object or params.json_schema is not None or params.pattern is not None:
            # Special tokens (end of turn included) never belong to the JSON text: the answer
            # ends when the value closes, or (a schema's number, which could go on) with the
            # end of turn once whole.
            banned = {*self.tokenizer.all_special_ids, *self.eos_ids}
            end_ids = () if params.ignore_eos else self.eos_ids
            if params.pattern is not None:  # a client's: within a matching budget
                # A grammar's referenced tokens are read as their characters, special or not.
                tokens = {token: sentinel.encode() for token, sentinel in params.pattern_tokens}
                req.constraint = PatternConstraint(expression(params.pattern), self.token_bytes, banned - tokens.keys(),
                                                   end_ids, budget_s=CLIENT_BUDGET_S, tokens=tokens)
            else:  # a schema's, or JSON mode's: any one object
                schema = params.json_schema if params.json_schema is not None else JSON_OBJECT
                req.constraint = PatternConstraint(compile_schema(schema), self.token_bytes, banned, end_ids)
            if params.triggers is not None:  # a lazy grammar: free until a trigger
                req.lazy, req.constraint = LazyGrammar(req.constraint, params.triggers, self.token_bytes), None
        if params.thinking_budget is not None and req.constraint is None:
            # (a constraint held from the first token leaves no thinking; a lazy one is
            # triggered outside the thinking block only, call_grammar.py)
            if self._think_tokens is None:
                self._think_tokens = ThinkTokens.of(self.tokenizer)
            req.thinking = ThinkingBudget(params.thinking_budget, self._think_tokens, self.token_bytes, params.thinking_opened)
        with self._lock:
            if len(self.scheduler.waiting) + len(self._inbox) >= self.scheduler.config.max_queue_size:
                raise QueueFull(f"The queue is full ({self.scheduler.config.max_queue_size} requests waiting).")
            self._inbox.append(req)
            self._wake.notify()
        return req

    def check_fits(self, seq: Sequence, n: int = 1) -> None:
        """Raise NeverFits if ``seq`` with ``n`` choices could never run here (past the
        context or the pool); any number of choices fits the batch, run as lanes free."""
        seq.num_samples = n
        self.scheduler.check_fits(seq)

    def _group(self, req: RunnerRequest, first: int, size: int) -> RunnerRequest:
        """Choices ``first`` .. ``first + size - 1`` of waiting ``req``'s request as a group of
        their own: its first sequence (id "<request_id>/<first>") takes the prompt from the
        prefix cache the request's first group fills, then forks into the group's other
        choices. Only the first group scores the prompt and reports its progress; choice i
        keeps choice i's seed, so a seeded request gets the same choices on any batch."""
        seq = req.seq
        params = replace(req.params, prompt_logprobs=None) if req.scoring else req.params
        group = Sequence(list(seq.prompt_token_ids), seq.max_tokens, seq.priority, seq_id=f"{req.request_id}/{first}",
                         arrival=seq.arrival, preemptible=seq.preemptible, num_samples=size,
                         cache_root=seq.cache_root, cache_retention=seq.cache_retention)
        return RunnerRequest(
            group, params, IncrementalDetokenizer(self.tokenizer, params.stop, params.preserved_tokens), req.sink,
            params.make_generator(first), index=first, request_id=req.request_id, blend=req.blend,
            constraint=req.constraint.copy() if req.constraint is not None else None,
            lazy=req.lazy.copy() if req.lazy is not None else None,
            thinking=req.thinking.copy() if req.thinking is not None else None,
        )

    def _split_group(self, seq: Sequence, keep: int) -> Sequence:
        """The scheduler's ``split_group``: waiting group ``seq`` runs its first ``keep``
        choices now, the others wait as a group of their own (registered here)."""
        req = self.requests[seq.seq_id]
        rest = self._group(req, req.index + keep, seq.num_samples - keep)
        self.requests[rest.seq.seq_id] = rest
        return rest.seq

    def abort(self, seq_id: str) -> None:
        """Stop a request and free its blocks at the start of the next step (any thread)."""
        with self._lock:
            self._aborts.append(seq_id)
            self._wake.notify()

    def run_between_steps(self, job: Callable[[], Any]) -> Future:
        """Run ``job`` on the engine thread between two steps (call from any thread): work that
        needs the model but is no sequence, such as an embedding's forward. At most one job
        runs between two steps, and while sequences run the jobs get at most half the engine's
        time (``_loop``), so a queue of them slows the running generations, never stalls them.
        Raises QueueFull when as many jobs wait as requests may, EngineStopped when the engine
        is not running; the future fails with EngineStopped if the engine stops first, and a
        job whose future was cancelled does not run."""
        future: Future = Future()
        with self._lock:
            if self._thread is None or self._stopping:
                raise EngineStopped("the engine thread is not running (start() it)")
            if len(self._between_steps) >= self.scheduler.config.max_queue_size:
                raise QueueFull(f"The queue is full ({self.scheduler.config.max_queue_size} jobs waiting).")
            self._between_steps.append((future, job))
            self._wake.notify()
        return future

    def _run_one_between_steps(self) -> None:
        """Run the first job whose future was not cancelled (the cancelled ones are dropped)."""
        while True:
            with self._lock:
                if not self._between_steps:
                    return
                future, job = self._between_steps.popleft()
            if future.set_running_or_notify_cancel():
                break
        try:
            future.set_result(job())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(self._inbox or self._aborts or self._decided or s.waiting or s.running or s.swapped)

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            decided, self._decided = self._decided, []
        for req in inbox:
            if req.scoring:  # on this thread: the kept scores change as steps run
                self._resume_scoring(req)
            try:
                self.scheduler.add(req.seq)
            except SchedulerError as exc:  # the queue filled up between the check and now
                req.sink([TokenEvent("error", error=exc)])
                continue
            self.requests[req.seq.seq_id] = req
        for seq_id in aborts:
            # A request's choices (its forks, "<id>/<index>") end with it.
            for key in [seq_id] + [k for k in self.requests if k.startswith(seq_id + "/")]:
                req = self.requests.pop(key, None)
                if req is not None:
                    self.scheduler.finish(req.seq)
        for req, decision in decided:
            self._take_decision(req, decision)

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        """One iteration: schedule, grow, forward, sample, emit."""
        try:
            self._wait_briefly_for_decisions()
            self._take_inbox()
            self._step()
        except Exception as exc:  # never leave a request hanging or a block held
            logger.exception("engine step failed; failing the running requests")
            for req in list(self.requests.values()):
                if req.seq.status is SeqStatus.RUNNING:
                    self._finish(req, TokenEvent("error", error=exc))
        finally:
            self._deliver()
            if self.config.debug_invariants:
                self.check_invariants()

    def _step(self) -> None:
        sched = self.scheduler
        out = sched.schedule()
        self._apply(out)
        for seq in out.admitted:
            req = self.requests[seq.seq_id]
            self.counters.cached_tokens += seq.num_cached_tokens
            first = not req.admitted  # not again when re-admitted after a recompute preemption
            if first:
                req.admitted = True
                req.events.append(TokenEvent("admitted"))
            if req.blend is not None and self.rotary is not None:
                self._blend_prefill(req)
            if first and req.reports_progress:
                req.progress_from = time.perf_counter()
                req.progress_cache = req.num_computed
                self._report_progress(req, 0.0)  # nothing computed yet
        # Latest first: a victim chosen while growing is then one already grown this step
        # (or the grower itself), never one still holding an unappended token.
        for seq in sorted(sched.running, key=lambda s: (s.priority, s.arrival), reverse=True):
            req = self.requests[seq.seq_id]
            if req.pending is None or seq.status is not SeqStatus.RUNNING:
                continue
            self._apply(sched.append(seq, req.pending))
            if seq.status is SeqStatus.RUNNING:
                req.pending = None
        batch = self._plan_batch()
        self._stepped = bool(batch)
        if batch:
            prompt_tokens = sum(take for _, take in batch if take > 1)
            started = time.perf_counter()
            self._forward(batch)
            self._last_step_s = time.perf_counter() - started
            self.pacer.observe(prompt_tokens, self._last_step_s)

    def _apply(self, out: ScheduleOutput) -> None:
        """Carry out the KV copies of a scheduling decision, in a safe order: reads of host
        blocks freed by a swap-in happen before a swap-out may reuse them, and device blocks
        are saved before anyone writes to them again."""
        self._save_evicted()  # reclaimed cached blocks, before anything writes to them
        partial = self.bm.partial_copies
        if partial:  # their sources may have been handed out this pass: copy before any write
            self.cache.copy_blocks(partial)
            partial.clear()
        self.cache.swap_in(out.swap_in_copies)
        self.cache.swap_out(out.swap_out_copies, self._partial_host_blocks(out))
        self.cache.copy_blocks(out.cow_copies)
        self._restore_spilled()  # after the swap-out: a restored block may be one it freed
        for seq in out.admitted:
            self.requests[seq.seq_id].num_computed = seq.num_cached_tokens
        for seq in out.preempted:
            if seq.status is SeqStatus.WAITING:  # recompute: the KV is gone
                self.requests[seq.seq_id].num_computed = 0

    def _partial_host_blocks(self, out: ScheduleOutput) -> set[int]:
        """Host blocks receiving a swapped sequence's partly filled last block (a quantized
        swap pool keeps those exact)."""
        bm = self.scheduler.bm
        partial: set[int] = set()
        if self.cache.swap_bits is None or not out.swap_out_copies:
            return partial  # a full-precision swap pool keeps every block exact anyway
        for seq in out.preempted:
            swapped = bm.swapped.get(seq.seq_id)
            if swapped is None or not len(swapped.token_ids) % self.config.block_size:
                continue
            last = swapped.entries[-1]
            if isinstance(last, int):  # a host block id (a Block is still shared on the device)
                partial.add(last)
        return partial

    def _save_evicted(self) -> None:
        evicted = self.bm.pool.evictions
        if not evicted or self.store is None:
            return
        ids = torch.tensor([block_id for block_id, _, _ in evicted], dtype=torch.long, device=self.device)
        k = self.cache.k.index_select(1, ids).cpu()
        v = self.cache.v.index_select(1, ids).cpu()
        for i, (_, block_hash, token_ids) in enumerate(evicted):
            self.store.put(block_hash, token_ids, k[:, i], v[:, i])
        evicted.clear()

    def _restore_spilled(self) -> None:
        restores = self.bm.restores
        if not restores or self.store is None:
            return
        for block_id, record in restores:
            k, v = self.store.codec.decode(record, self.device)  # type: ignore[arg-type]
            self.cache.k[:, block_id] = k
            self.cache.v[:, block_id] = v
        self.counters.restored_blocks += len(restores)
        restores.clear()

    def persist_cache(self) -> None:
        """Spill every cached block of the pool too and write the RAM tier to disk, so that a
        restarted engine with the same disk_cache_dir finds them (called on close)."""
        if self.store is None:
            return
        pool = self.bm.pool
        assert pool.evictions is not None  # logging is on whenever there is a store
        for block in pool.blocks:
            if block.block_hash is not None and pool.lookup(block.block_hash, block.token_ids or ()) is block:
                pool.evictions.append((block.block_id, block.block_hash, block.token_ids or ()))
        self._save_evicted()
        self.store.persist()

    def close(self) -> None:
        """Stop the thread, then persist the cache, close the disk tier and free the pools."""
        self.stop()
        self.side.close()
        if self.store is not None and not self._closed:
            self.persist_cache()
            self.store.close()
        self._closed = True
        self.cache.release()

    # ---------------------------------------------------------------- blend
    @torch.inference_mode()
    def _blend_prefill(self, req: RunnerRequest) -> None:
        """Prefill a just-admitted ``reuse: blend`` request by moving matched chunks' KV,
        repairing the most deviant tokens and computing the rest (see blend.py). Leaves the
        prompt's last token to the normal step, which samples from it."""
        params = req.blend
        assert params is not None
        bm = self.bm
        table = bm.tables[req.seq.seq_id]
        if table.root is not None:
            return  # a tenant's prompt takes no other's chunks: the content index is shared
        plan = blend_module.find_moved_chunks(bm.pool, table.token_ids, req.num_computed, self.config.block_size)
        if not self.blend_costs.worth_it(plan, params, self.kv_shape.num_layers):
            return
        block_ids = [b.block_id for b in table.blocks]
        bs = self.config.block_size
        slots_of = lambda positions: torch.tensor(  # noqa: E731
            [block_ids[p // bs] * bs + p % bs for p in positions], dtype=torch.long, device=self.device
        )
        approx = plan.approx_positions()
        with blend_module.Stopwatch() as watch:
            src = torch.tensor(
                [slot + i for _, slot, _ in plan.copies for i in range(bs)], dtype=torch.long, device=self.device
            )
            delta = torch.tensor([dst - start for dst, _, start in plan.copies for _ in range(bs)], device=self.device)
            dst = slots_of(approx)
            keys = self.cache.flat_k.index_select(1, src)
            self.cache.flat_k.index_copy_(1, dst, self.rotary.shift(keys, delta))  # type: ignore[union-attr]
            self.cache.flat_v.index_copy_(1, dst, self.cache.flat_v.index_select(1, src))
        self.blend_costs.observe_move(watch.seconds, len(approx))
        bm.mark_approximate(req.seq.seq_id, approx[0])
        req.approx_from = approx[0]

        span = list(range(plan.start, plan.end))
        repaired: list[int] = []
        layer = params.select_layer
        if params.blend_ratio > 0 and self.layers is not None and layer < len(self.layers) - 1:
            # True keys at the selection layer for every token, by running the first layers
            # only; the moved tokens whose keys moved furthest from them get recomputed.
            before = self.cache.flat_k[layer].index_select(0, dst).float()
            self._forward_positions(table, span, num_layers=layer + 1)
            after = self.cache.flat_k[layer].index_select(0, dst).float()
            deviation = (after - before).flatten(1).norm(dim=1)
            repaired = blend_module.select_for_repair(deviation, approx, params.blend_ratio)
        seams = {p for start in plan.run_starts for p in range(start, min(start + params.seam_tokens, plan.end))}
        moved = set(approx)
        compute = sorted({p for p in span if p not in moved} | set(repaired) | seams)
        self._forward_positions(table, compute)
        req.num_computed = plan.end
        bm.commit(req.seq.seq_id, req.num_computed)  # the exact blocks before the first moved token
        req.moved_tokens = len(moved - set(compute))
        req.repaired_tokens = len(approx) - req.moved_tokens
        self.counters.blends += 1
        self.counters.moved_tokens += req.moved_tokens
        self.counters.repaired_tokens += req.repaired_tokens

    def _forward_positions(self, table, positions: list[int], num_layers: int | None = None) -> None:
        """One sequence's tokens at ``positions`` through the model (or its first
        ``num_layers`` layers), in chunks of at most max_num_batched_tokens, in order."""
        block_ids = [b.block_id for b in table.blocks]
        step = self.config.max_num_batched_tokens
        for i in range(0, len(positions), step):
            chunk = positions[i : i + step]
            plan = scattered_plan(self.cache, block_ids, chunk, self.config.attention)
            ids = torch.tensor([[table.token_ids[p] for p in chunk]], dtype=torch.long, device=self.device)
            pos = torch.tensor([chunk], dtype=torch.long, device=self.device)
            if num_layers is None:
                last = torch.tensor([len(chunk) - 1], dtype=torch.long, device=self.device)
                compat.forward_logits(self.model, ids, pos, plan, last)
            else:
                compat.forward_first_layers(self.model, self.layers, num_layers, ids, pos, plan)  # type: ignore[arg-type]
            self.counters.forward_tokens += len(chunk)
            self.counters.prefill_tokens += len(chunk) if num_layers is None else 0

    def _plan_batch(self) -> list[tuple[RunnerRequest, int]]:
        """(request, tokens to compute) for this forward: every decode, then prefill chunks
        within the token budget (the pacer's while anything decodes): first the prompts that
        finish within half of it, then the rest, each in admission order."""
        decodes, prefills = [], []
        for seq in self.scheduler.running:
            req = self.requests[seq.seq_id]
            if seq.seq_id in self._deciding:  # its next token is not known yet
                continue
            todo = len(self.scheduler.bm.tables[seq.seq_id].token_ids) - req.num_computed
            if todo == 1:
                decodes.append((req, 1))
            elif todo > 1:
                prefills.append((req, todo))
        batch = decodes
        budget = self.pacer.budget(len(decodes))
        prefills.sort(key=lambda item: item[0].seq.admitted_at or 0.0)
        # A short prompt admitted behind a long one's chunks is computed in the next step, not
        # after the whole long prompt (a chat's first token 20 s late behind a 6,000-token
        # prompt here); the long one keeps at least half of every step.
        quick = _finishing_within(prefills, budget // 2)
        if quick and not decodes:  # their first tokens wait on this step as a decode's next token does
            budget = self.pacer.budget(len(quick))
            quick = _finishing_within(prefills, budget // 2)
        prefills.sort(key=lambda item: id(item[0]) not in quick)  # (stable: admission order within each)
        scoring = self.score_rows  # every scored prompt position carries a row of logits
        for req, todo in prefills:
            if budget <= 0 and batch:
                break
            take = min(todo, max(budget, 1))
            if req.scoring:
                if scoring <= 0 and batch:
                    continue
                take = min(take, max(scoring, 1))
                scoring -= take
            batch.append((req, take))
            budget -= take
        return batch

    @torch.inference_mode()
    def _forward(self, batch: list[tuple[RunnerRequest, int]]) -> None:
        bm = self.scheduler.bm
        ids: list[int] = []
        positions: list[int] = []
        plan_seqs = []
        logit_rows: list[int] = []
        sampled: list[RunnerRequest] = []
        scored: list[tuple[RunnerRequest, int]] = []  # (request, prompt token scored) per prompt row
        prompt_rows: list[int] = []
        for req, take in batch:
            table = bm.tables[req.seq.seq_id]
            start = req.num_computed
            if req.params.prompt_logprobs is not None:
                # The row at position p predicts prompt token p + 1.
                end = min(start + take, len(req.seq.prompt_token_ids) - 1)
                for position in range(max(start, len(req.prompt_logprobs)), end):
                    prompt_rows.append(len(ids) + position - start)
                    scored.append((req, req.seq.prompt_token_ids[position + 1]))
            ids += table.token_ids[start : start + take]
            positions += range(start, start + take)
            plan_seqs.append(([b.block_id for b in table.blocks], start, take))
            if start + take == len(table.token_ids):
                logit_rows.append(len(ids) - 1)
                sampled.append(req)
        device = self.device
        started = time.perf_counter()
        rows = torch.tensor(logit_rows + prompt_rows, dtype=torch.long, device=device)
        id_row = torch.tensor([ids], dtype=torch.long, device=device)
        position_row = torch.tensor([positions], dtype=torch.long, device=device)
        try:
            logits = compat.forward_logits(self.model, id_row, position_row, self._plan(plan_seqs), rows)
        except flex.FlexKernelError as exc:
            # A shape the start-up probe did not cover failed to compile. The K/V written
            # before the failure are rewritten identically, so the step reruns as sdpa.
            self._leave_flex(exc)
            logits = compat.forward_logits(self.model, id_row, position_row, self._plan(plan_seqs), rows)
        counters = self.counters
        counters.steps += 1
        counters.step_requests += len(batch)
        counters.forward_tokens += len(ids)
        if sum(take for _, take in batch if take > 1) >= len(ids) // 2:  # mostly prefill: feeds the blend cost model
            self.blend_costs.observe_prefill(time.perf_counter() - started, len(ids))
        for req, take in batch:
            if take == 1 and req in sampled:
                counters.decode_tokens += 1
            else:
                counters.prefill_tokens += take
            req.num_computed += take
            bm.commit(req.seq.seq_id, req.num_computed)
            if req.reports_progress and req.num_generated == 0 and req.num_computed > req.progress_reported:
                self._report_progress(req, (time.perf_counter() - req.progress_from) * 1000)
        if scored:
            self._score_prompts(logits[len(logit_rows):], scored)
            logits = logits[: len(logit_rows)]
        if not sampled:
            return
        if any(r.params.max_tokens == 0 for r in sampled):  # echo alone: the prompt is all it asked for
            keep = [row for row, r in enumerate(sampled) if r.params.max_tokens > 0]
            for req in sampled:
                if req.params.max_tokens == 0:
                    self._prompt_done(req)
                    self._finish(req, TokenEvent("token", finish_reason="length"))
            sampled = [sampled[row] for row in keep]
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
            if not sampled:
                return
        # A request of n choices forks now, its prompt computed: every choice samples its
        # first token from this same row of logits.
        rows = list(range(len(sampled)))
        for row, req in enumerate(list(sampled)):
            if req.num_generated == 0:
                self._prompt_done(req)
            if req.seq.unforked:
                for fork in self._fork(req):
                    sampled.append(fork)
                    rows.append(row)
        if len(rows) > len(logits):
            logits = logits[torch.tensor(rows, device=logits.device)]
        params = [r.params for r in sampled]
        histories = [History(r.seq.prompt_token_ids, r.seq.output_token_ids) if p.adjusts_logits else None
                     for r, p in zip(sampled, params, strict=True)]
        forced = [r.thinking.forced() if r.thinking is not None else None for r in sampled]
        aside = [row for row, r in enumerate(sampled) if forced[row] is None and (
            r.lazy.slow_to_search if r.lazy is not None else r.constraint is not None and r.constraint.slow_to_judge)]
        if aside:  # decided on the side thread; the others now
            for row in aside:
                self._decide_aside(sampled[row], logits[row], histories[row])
            keep = [row for row in range(len(sampled)) if row not in aside]
            if not keep:
                return
            sampled, params, histories, forced = ([items[row] for row in keep] for items in (sampled, params, histories, forced))
            logits = logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
        constraints = [r.constraint for r in sampled]
        drawn_from: dict[int, torch.Tensor] = {}
        failed: dict[int, Exception] = {}
        tokens = sample(logits, params, [r.generator for r in sampled], histories,
                        constraints if any(c is not None for c in constraints) else None,
                        forced if any(f is not None for f in forced) else None, drawn_from, failed)
        for row, error in failed.items():  # that request ends, the others go on
            self._fail_alone(sampled[row], error)
        wanted = [row for row, p in enumerate(params)
                  if p.logprobs is not None and row not in drawn_from and row not in failed]
        logprobs = dict(zip(wanted, logprobs_of(
            logits, wanted, [tokens[row] for row in wanted], [params[row].logprobs for row in wanted]), strict=True))
        for row, probs in drawn_from.items():  # post_sampling_probs
            logprobs[row] = drawn_logprobs(probs, tokens[row], params[row].logprobs or 0)
        for row, (req, token) in enumerate(zip(sampled, tokens, strict=True)):
            if row in failed:
                continue
            first = logits[row].float().cpu() if req.params.keep_first_logits and req.num_generated == 0 else None
            try:
                self._emit(req, token)
            except Exception as exc:  # its own constraint, detokenizer or stop strings: it alone ends
                self._fail_alone(req, exc)
                continue
            if first is not None:
                req.events[-1].logits = first  # the event _emit just queued
            if row in logprobs:
                req.events[-1].logprobs = logprobs[row]

    def _report_progress(self, req: RunnerRequest, elapsed_ms: float) -> None:
        """How far ``req``'s prompt is computed now, ``elapsed_ms`` after its computation
        began, queued as a "progress" event."""
        req.progress_reported = req.num_computed
        progress = PromptProgress(len(req.seq.prompt_token_ids), req.progress_cache, req.num_computed, elapsed_ms)
        req.events.append(TokenEvent("progress", progress=progress))

    def _score_prompts(self, logits: torch.Tensor, scored: list[tuple[RunnerRequest, int]]) -> None:
        """Each scored prompt row's log-probability of the prompt token that follows it, with
        the request's alternatives (echo with logprobs), in prompt order."""
        # At least STORED_TOP alternatives: what is kept serves later requests asking for more.
        entries = logprobs_of(logits, list(range(len(scored))), [token for _, token in scored],
                              [max(req.params.prompt_logprobs or 0, STORED_TOP) for req, _ in scored])
        for (req, _), entry in zip(scored, entries, strict=True):
            req.prompt_logprobs.append(entry)
        self.counters.scored_tokens += len(scored)

    def _prompt_done(self, req: RunnerRequest) -> None:
        """The prompt is computed: keep its scores for later prompts sharing its blocks, and
        hand them over (echo with logprobs), once, before the first token; a later
        re-admission may take its prefix from the cache again."""
        if not req.scoring:
            return
        req.scoring = False
        seq = req.seq
        seq.max_reused_tokens = None
        self.prompt_scores.keep(seq.prompt_token_ids, seq.cache_root, req.prompt_logprobs)
        k = req.params.prompt_logprobs or 0
        scores = [s if len(s.top) <= k else TokenLogprobs(s.logprob, s.top[:k]) for s in req.prompt_logprobs]
        req.events.append(TokenEvent("prompt", prompt_logprobs=scores))

    def _resume_scoring(self, req: RunnerRequest) -> None:
        """A scored prompt takes the kept scores of its leading blocks, and may reuse the KV
        of all but the last of those blocks (prompt_scores.py)."""
        if (req.params.prompt_logprobs or 0) > STORED_TOP:
            return  # more alternatives than are kept: computed whole
        req.prompt_logprobs = self.prompt_scores.known_prefix(req.seq.prompt_token_ids, req.seq.cache_root)
        req.seq.max_reused_tokens = len(req.prompt_logprobs)
        self.counters.kept_score_tokens += len(req.prompt_logprobs)

    def _plan(self, plan_seqs: list[tuple[list[int], int, int]], cache: PagedKVCache | None = None) -> AttentionPlan:
        """A step's attention plan over the pool (``cache``: another pool, the start-up probes')."""
        heads = self.model.config.num_attention_heads
        return AttentionPlan.build(cache or self.cache, plan_seqs, self.config.attention, heads, flex.IN_PLACE_MIN_CONTEXT)

    def _leave_flex(self, exc: Exception) -> None:
        """Run the sdpa tier from now on, and say why in /status."""
        logger.warning("flex attention failed at run time, falling back to sdpa: %s", exc)
        why_not = {**self.attention.why_not, "flex": f"failed at run time: {exc}"}
        self.attention = TierChoice("sdpa", why_not)
        self.config = replace(self.config, attention="sdpa")

    def _fork(self, req: RunnerRequest) -> list[RunnerRequest]:
        """The request's other n - 1 choices: tables sharing all of its blocks, the same
        computed prompt, their own sampling streams (seeded apart)."""
        seq, params = req.seq, req.params
        forks = []
        for index in range(req.index + 1, req.index + seq.num_samples):
            child = Sequence(list(seq.prompt_token_ids), seq.max_tokens, seq.priority, seq_id=f"{req.request_id}/{index}", arrival=seq.arrival)
            self.scheduler.fork(seq, child)
            fork = RunnerRequest(
                child, params, IncrementalDetokenizer(self.tokenizer, params.stop, params.preserved_tokens), req.sink,
                params.make_generator(index),
                num_computed=req.num_computed, admitted=True, index=index, request_id=req.request_id,
                constraint=req.constraint.copy() if req.constraint is not None else None,
                lazy=req.lazy.copy() if req.lazy is not None else None,
                thinking=req.thinking.copy() if req.thinking is not None else None,
            )
            self.requests[child.seq_id] = fork
            forks.append(fork)
        return forks

    def _decide_aside(self, req: RunnerRequest, scores: torch.Tensor, history: History | None) -> None:
        """Decide ``req``'s next token on the side thread (side_decisions.py): its constraint
        judges candidates slowly, or its lazy grammar searches a client's patterns. The
        request sits out the steps until the token is back (``_take_decision``); the
        constraint (or the lazy grammar) takes the token there too, where ``_emit`` would."""
        params, constraint, lazy, generator = req.params, req.constraint, req.lazy, req.generator
        first = scores.float().cpu() if params.keep_first_logits and req.num_generated == 0 else None
        scores = scores.clone()  # (one row, not the step's whole logits)

        @torch.inference_mode()
        def decide() -> Decision:
            drawn: dict[int, torch.Tensor] = {}
            token = sample(scores[None], [params], [generator], [history], [constraint], None, drawn)[0]
            if params.logprobs is None:
                logprobs = None
            elif 0 in drawn:
                logprobs = drawn_logprobs(drawn[0], token, params.logprobs or 0)
            else:
                logprobs = logprobs_of(scores[None], [0], [token], [params.logprobs])[0]
            triggered = None
            if not self._ends(req, token):
                if lazy is not None:
                    triggered = lazy.advance(token)
                elif constraint is not None:
                    constraint.advance(token)
            return Decision(token, logprobs, first, triggered)

        def deliver(decision: Decision | Exception) -> None:
            with self._lock:
                self._decided.append((req, decision))
                self._wake.notify()

        self._deciding[req.seq.seq_id] = req
        self.side.submit(decide, deliver)

    def _take_decision(self, req: RunnerRequest, decision: Decision | Exception) -> None:
        """A token decided on the side thread, emitted as a step's would be (dropped if the
        request was aborted meanwhile)."""
        self._deciding.pop(req.seq.seq_id, None)
        if self.requests.get(req.seq.seq_id) is not req:
            return
        if isinstance(decision, Exception):
            self._fail_alone(req, decision)
            return
        try:
            self._emit(req, decision.token, decided=decision)
        except Exception as exc:
            self._fail_alone(req, exc)
            return
        if decision.first_logits is not None:
            req.events[-1].logits = decision.first_logits
        if decision.logprobs is not None:
            req.events[-1].logprobs = decision.logprobs

    def _wait_briefly_for_decisions(self) -> None:
        """Before a step, give the tokens out on the side thread ``DECISION_GRACE_SHARE`` of
        the last step's time to come back, ``DECISION_GRACE_MAX_S`` at most (the other rows
        wait as long: a tenth of a step)."""
        if not self._deciding or not self._stepped:
            return
        deadline = time.perf_counter() + min(DECISION_GRACE_SHARE * self._last_step_s, DECISION_GRACE_MAX_S)
        with self._lock:
            while len(self._decided) < len(self._deciding) and not (self._inbox or self._aborts or self._stopping):
                left = deadline - time.perf_counter()
                if left <= 0:
                    return
                self._wake.wait(left)

    def _await_decision(self, timeout_s: float = 0.05) -> None:
        """After a step that computed nothing while tokens are decided aside: sleep until one
        is back (or anything else arrives) instead of stepping in a busy loop that takes the
        core the decision needs."""
        if not self._deciding or self._stepped:
            return
        with self._lock:
            if not (self._decided or self._inbox or self._aborts or self._stopping or self._between_steps):
                self._wake.wait(timeout_s)

    def _ends(self, req: RunnerRequest, token: int) -> bool:
        """Whether ``token`` ends ``req``'s answer by itself (an end of text or a stop token)."""
        return (token in self.eos_ids and not req.params.ignore_eos) or token in req.params.stop_token_set

    def _emit(self, req: RunnerRequest, token: int, decided: Decision | None = None) -> None:
        """Queue ``token``'s event for ``req`` (or end it); ``decided``: the token was decided
        aside, where its constraint or lazy grammar took it already."""
        req.num_generated += 1
        params, index = req.params, req.index
        if req.constraint is not None and req.constraint.failed:  # a client's expression ran past its budget
            self._finish(req, TokenEvent("error", error=BackendRejected(
                "The answer cannot be held to the request's grammar or expression: matching it took too long.",
                code="constraint_too_costly")))
            return
        if self._ends(req, token):
            self._finish(req, TokenEvent("token", token, req.detokenizer.flush(), "stop", index=index))
            return
        text = req.detokenizer.add(token)
        if req.lazy is not None:  # the token may be (or end) its trigger: the constraint takes it then
            req.constraint = decided.triggered if decided is not None else req.lazy.advance(token)
            if req.lazy.failed is not None:  # (a client's costly expression, as below; else llama-server's 500)
                why = f"The answer cannot be held to the request's lazy grammar: {req.lazy.failed}."
                error = (BackendRejected(why, code="constraint_too_costly") if req.lazy.costly
                         else BackendError(why, 500, code="grammar_trigger_failed", retryable=False))
                self._finish(req, TokenEvent("error", error=error))
                return
            if req.constraint is not None:
                req.lazy = None
        elif req.constraint is not None and decided is None:
            req.constraint.advance(token)
        if req.thinking is not None:
            req.thinking.advance(token)
        if req.detokenizer.stopped:
            self._finish(req, TokenEvent("token", token, text, "stop", index=index, stop_sequence=req.detokenizer.matched_stop))
        elif req.constraint is not None and req.constraint.done:  # JSON mode: the object is closed
            self._finish(req, TokenEvent("token", token, text + req.detokenizer.flush(), "stop", index=index))
        elif req.num_generated >= params.max_tokens:
            self._finish(req, TokenEvent("token", token, text + req.detokenizer.flush(), "length", index=index))
        else:
            req.pending = token
            req.events.append(TokenEvent("token", token, text, index=index))

    def _fail_alone(self, req: RunnerRequest, error: Exception) -> None:
        """End ``req`` with ``error`` raised by its own part of a step (its sampling values,
        constraint or detokenizer), the step going on for the others: a 400 where its own
        values left nothing to draw, else the engine's error (logged)."""
        if isinstance(error, NoTokenToDraw):
            error = BackendRejected(str(error), code="invalid_value")
        elif not isinstance(error, BackendError):
            logger.error("request %s failed in its step; the others go on", req.seq.seq_id, exc_info=error)
        if self.requests.get(req.seq.seq_id) is req:  # (not if it ended before raising)
            self._finish(req, TokenEvent("error", error=error))

    def _finish(self, req: RunnerRequest, event: TokenEvent) -> None:
        req.events.append(event)
        self.scheduler.finish(req.seq)
        self.requests.pop(req.seq.seq_id, None)
        self._finished.append(req)

    def _deliver(self) -> None:
        """Hand each request the events of this step (one callback per request per step)."""
        finished, self._finished = self._finished, []
        for req in list(self.requests.values()) + finished:
            if req.events:
                events, req.events = req.events, []
                req.sink(events)

    # -------------------------------------------------------------- threads
    def start(self, executor: Executor | None = None) -> None:
        """Run steps on a background thread whenever there is work: a new one, or
        ``executor``'s. Pass the single-thread executor that loaded the model (HFBackend
        does): torch's CPU kernels and ours parallelize with OpenMP, whose workers spin
        between parallel regions only while the process has no more OpenMP threads than
        CPUs, and every thread that runs a parallel region brings a team of its own. With
        the model loaded on one thread and stepped on another, each of the ~200 kernel calls
        of a decode step paid a sleeping worker's wake-up (c=1 through the server: 16 tok/s
        instead of 25-27)."""
        if self._thread is not None:
            return
        self._stopping = False
        if executor is not None:
            self._thread = executor.submit(self._loop)
            return
        thread = threading.Thread(target=self._loop, name="kvstream-hf-engine", daemon=True)
        thread.start()
        self._thread = thread

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if isinstance(self._thread, threading.Thread):
            self._thread.join()
        elif self._thread is not None:
            self._thread.result()
        self._thread = None

    def _loop(self) -> None:
        # While sequences run, jobs (embeddings) get at most as much of the engine's time as
        # the steps: a job runs only when the steps since the last one have taken as long as
        # it did. One at a time before every step, a 2,048-input embedding request made each
        # token of a running stream wait for a 256-token forward (20 ms steps became 400 ms
        # for minutes); now such a stream runs at least half its speed (benchmarks/loop_stall.py).
        job_debt_s = 0.0
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self.has_work() and not self._between_steps:
                        engine_turns.set_busy(self, False)
                        self._wake.wait()
                    if self._stopping:
                        return
                generating = self.has_work()
                engine_turns.set_busy(self, generating)  # other threads' pure Python gives it turns
                if not generating:
                    job_debt_s = 0.0  # nothing to share with: jobs back to back
                if job_debt_s <= 0.0:
                    started = time.perf_counter()
                    self._run_one_between_steps()
                    if generating:
                        job_debt_s += time.perf_counter() - started
                if self.has_work():
                    started = time.perf_counter()
                    self.step()
                    job_debt_s = max(0.0, job_debt_s - (time.perf_counter() - started))
                    self._await_decision()
        finally:
            engine_turns.set_busy(self, False)
            with self._lock:
                left, self._between_steps = self._between_steps, deque()
            for future, _ in left:
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineStopped("the engine stopped before this job ran"))

    # ----------------------------------------------------------------- sync
    def generate_sync(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion on the calling thread; the generated ids of each (tests,
        benchmarks and the Python API; the engine thread must not be running)."""
        assert self._thread is None, "generate_sync drives the engine itself"
        plist = params if isinstance(params, list) else [params] * len(prompts)
        results: list[list[int]] = [[] for _ in prompts]
        errors: list[BaseException] = []

        def sink_for(i: int) -> Sink:
            def sink(events: list[TokenEvent]) -> None:
                for e in events:
                    if e.kind == "token" and e.token_id is not None:  # None: max_tokens 0, nothing generated
                        results[i].append(e.token_id)
                    elif e.kind == "error":
                        errors.append(e.error)  # type: ignore[arg-type]

            return sink

        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            self.add_request(Sequence(list(prompt), p.max_tokens), p, sink_for(i))
        while self.has_work():
            self.step()
            self._await_decision()
        if errors:
            raise errors[0]
        return results

    # ---------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Scheduler and block-manager invariants, plus the engine's own: computed tokens
        never exceed a table, and a running sequence always has something to compute."""
        self.scheduler.check_invariants()
        for seq in self.scheduler.running:
            req = self.requests[seq.seq_id]
            assert req.num_computed <= len(self.scheduler.bm.tables[seq.seq_id].token_ids)

    def is_idle(self) -> bool:
        return not self.has_work() and self.scheduler.bm.is_idle()

    def kv_bytes(self) -> dict[str, int]:
        return {"device": self.cache.device_bytes, "host": self.cache.host_bytes}

