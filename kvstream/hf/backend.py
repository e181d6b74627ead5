"""``--backend hf``: the in-process engine behind the same API as every other backend.

Unlike the remote backends, this one owns the KV. The proxy's engine counts and checks each
request, then hands its Sequence to ``submit``; admission, batching and preemption happen in
the model runner's step loop over its own scheduler, which ``scheduler`` exposes so that
/status and /metrics show the real pool.

torch and transformers are imported when the model is loaded (``start``), not with this
module: choosing another backend never needs them, and a base install that asks for this one
is told in one line which extra to install.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import importlib.util
import logging
from collections.abc import AsyncIterator, Iterator
import queue
import threading
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

from kvstream.backends.base import Capabilities, InProcessBackend
from kvstream.config import Settings
from kvstream.hf.answer_reading import AnswerReader, AnswerReading, answer_reading, special_tag_texts
from kvstream.hf.best_of import Candidates
from kvstream.hf.call_streams import ArgumentsCallStream, JsonCallStream, call_entry
from kvstream.hf.generic_calls import GENERIC, with_tools_prompt
from kvstream.hf.low_priority import LARGE_CHARS, LowPriorityWorker, text_chars
from kvstream.hf.tool_call_syntax import CallReading
from kvstream.hf.tool_calls import ForcedNames
from kvstream.scheduler import Scheduler, SchedulerError, Sequence
from kvstream.types import (
    BackendError,
    BackendRejected,
    BackendUnavailable,
    Embeddings,
    GenerateRequest,
    InfillParts,
    ModelInfo,
    RuntimeLimits,
    Token,
    TokenLogprob,
    Usage,
    parameter_size,
)

if TYPE_CHECKING:
    from kvstream.hf.loader import LoadedModel
    from kvstream.hf.sampling import TokenLogprobs
    from kvstream.hf.token_bytes import TokenBytes
    from kvstream.hf.model_runner import ModelRunner, TokenEvent

logger = logging.getLogger(__name__)

MISSING_EXTRA = "the hf backend needs torch and transformers: pip install 'kvstream[hf]'"
# llama-server's default --batch-size, which sizes the parts of its /infill prompts (InfillWindow).
INFILL_BATCH = 2048


def missing_requirements() -> str | None:
    """None when the hf backend can run here, else the one-line install hint."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return MISSING_EXTRA
    return None


def runner_metric_families(runner: ModelRunner) -> Iterator[Any]:
    """The model runner's own series: steps, forward tokens, pool bytes, spill tiers."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    c = runner.counters
    yield CounterMetricFamily("kvstream_engine_steps", "Batched forward passes run by the in-process engine.", value=c.steps)
    tokens = CounterMetricFamily("kvstream_engine_forward_tokens", "Tokens computed by forward passes, by kind.", labels=["kind"])
    tokens.add_metric(["prefill"], c.prefill_tokens)
    tokens.add_metric(["decode"], c.decode_tokens)
    tokens.add_metric(["embedding"], c.embedding_tokens)
    yield tokens
    kv_bytes = GaugeMetricFamily("kvstream_kv_pool_bytes", "Bytes allocated to the KV pools, by tier.", labels=["tier"])
    kv_bytes.add_metric(["gpu"], runner.cache.device_bytes)
    kv_bytes.add_metric(["cpu"], runner.cache.host_bytes)
    yield kv_bytes
    store = runner.store
    if store is not None:
        yield CounterMetricFamily("kvstream_kv_spilled_blocks", "Cached blocks reclaimed by the pool and kept in a spill tier.", value=store.spilled)
        yield CounterMetricFamily("kvstream_kv_restored_blocks", "Blocks copied back from a spill tier instead of recomputed.", value=c.restored_blocks)
        tier_bytes = GaugeMetricFamily("kvstream_kv_spill_bytes", "Bytes held by each spill tier.", labels=["store"])
        tier_bytes.add_metric(["ram"], store.bytes_used)
        tier_bytes.add_metric(["disk"], store.disk.bytes_used if store.disk is not None else 0)
        yield tier_bytes


def weights_metric_families(weights: dict[str, Any]) -> Iterator[Any]:
    """The model weights' bytes: resident, streamed per forward, staged so far."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    yield GaugeMetricFamily("kvstream_weights_resident_bytes", "Bytes of model weights held in memory (staging slots excluded).", value=weights["resident_bytes"])
    if "streamed_bytes" in weights:
        yield GaugeMetricFamily("kvstream_weights_streamed_bytes", "Packed weight bytes staged from the checkpoint on every forward.", value=weights["streamed_bytes"])
        yield GaugeMetricFamily("kvstream_weights_mapped_bytes", "Embedding and LM head bytes left in the mapped checkpoint instead of memory.", value=weights["mapped_bytes"])
        yield GaugeMetricFamily("kvstream_weights_mapped_bytes_per_forward", "Of those, the bytes every forward reads whole (a mapped LM head).", value=weights["mapped_bytes_per_forward"])
    if "staged_bytes_total" in weights:
        yield GaugeMetricFamily("kvstream_weights_staging_bytes", "Bytes of the staging slots streamed layers are copied into.", value=weights["staging_bytes"])
        yield CounterMetricFamily("kvstream_weights_staged_bytes", "Packed weight bytes copied into staging slots.", value=weights["staged_bytes_total"])
        yield CounterMetricFamily("kvstream_weights_stall_seconds", "Time forwards waited for a layer's weights to be staged.", value=weights["stall_seconds_total"])


class HFStream:
    """One request in the model runner, seen from the event loop (a ``LocalStream``).

    The runner's thread delivers event batches through ``sink``; the first one resolves
    ``admitted`` (an error before admission resolves it too, and is raised by the stream).
    With n choices, each choice's end is a token with ``choice_finish_reason`` until the
    last, which ends the stream with usage summed over the choices.
    """

    def __init__(
        self, backend: HFBackend, seq: Sequence, token_bytes: TokenBytes | None = None, echo: str | None = None,
        tool_call: ForcedNames | None = None, reading: AnswerReading | None = None, candidates: Candidates | None = None,
        choices: int = 1,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._choices = choices  # the request's n (best_of: its candidates), every group's
        # best_of: the choices are candidates, held until all end and the best given out.
        self._candidates = candidates
        self._token_bytes = token_bytes  # spells each token's log-probabilities, when asked for
        self._echo = echo  # the prompt's text, sent first in every choice (echo); None once sent
        # A forced tool call: each choice's text is the call's JSON (a named call's: its
        # arguments alone), streamed out as tool_calls deltas as it is written (call_streams.py).
        self._forced_names = tool_call
        self._calls: dict[int, tuple[str, JsonCallStream]] | None = {} if tool_call else None
        # A reasoning model's thinking, tools the model may call (tool_choice "auto"): each
        # choice's text is read for them as it streams (answer_reading.py).
        self._reading = reading
        self._readers: dict[int, AnswerReader] | None = {} if reading is not None else None
        self._held_logprobs: dict[int, list[TokenLogprob]] = {}  # of text a reader holds back
        # Tokens finished choices spent thinking; None unless the answer is read for thinking.
        self._reasoning_tokens: int | None = 0 if reading is not None and reading.thinking_opened is not None else None
        self.admitted: asyncio.Future[None] = loop.create_future()
        self._backend = backend
        self._seq = seq
        self._loop = loop
        self._events: asyncio.Queue[list[TokenEvent]] = asyncio.Queue()
        self._finished = False

    def sink(self, batch: list[TokenEvent]) -> None:
        """Called on the runner's thread."""
        self._loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: list[TokenEvent]) -> None:
        if not self.admitted.done():
            self.admitted.set_result(None)
        self._events.put_nowait(batch)

    def __aiter__(self) -> AsyncIterator[Token]:
        return self._tokens() if self._candidates is None else self._best()

    async def _best(self) -> AsyncIterator[Token]:
        """best_of: every candidate's tokens held, then the best ones'."""
        assert self._candidates is not None
        async for token in self._tokens():
            if token.progress is not None:
                yield token
            elif token.finish_reason is None:
                self._candidates.add(token)
            else:
                for best in self._candidates.best(token):
                    yield best

    async def _tokens(self) -> AsyncIterator[Token]:
        seq, runner = self._seq, self._backend.runner
        generated = 0
        open_choices = self._choices
        while True:
            for event in await self._events.get():
                if event.kind == "admitted":
                    continue
                if event.kind == "progress":
                    yield Token(progress=event.progress)
                    continue
                if event.kind == "error":
                    self._finished = True
                    if isinstance(event.error, SchedulerError):
                        err = event.error
                        raise BackendError(str(err), err.status, code=err.code, retryable=err.status >= 429)
                    if isinstance(event.error, BackendError):  # the request's own (a constraint given up)
                        raise event.error
                    raise BackendError(f"the engine failed: {event.error!r}", 500, code="engine_error")
                if self._echo is not None:
                    entries = self._prompt_entries(event.prompt_logprobs)
                    for index in range(self._choices):
                        yield Token(text=self._echo, token_logprobs=entries, index=index, echo=True)
                    self._echo = None
                if event.kind == "prompt":
                    continue
                ended_by_eos = event.finish_reason == "stop" and event.token_id in runner.eos_ids
                if self._candidates is not None and event.logprobs is not None:
                    self._candidates.score(event.index, event.logprobs.logprob)
                logprobs = None
                if self._token_bytes is not None and event.logprobs is not None and not ended_by_eos:
                    logprobs = [self._token_bytes.logprob(event.token_id, event.logprobs)]  # type: ignore[arg-type]
                if event.finish_reason is None:
                    generated += 1
                    if self._readers is not None:
                        for token in self._read(event.index, event.token_id, event.text, logprobs, end=False):
                            yield token
                    elif self._calls is not None:
                        for token in self._forced(event.index, event.text):
                            yield token
                    else:
                        yield Token(text=event.text, token_id=event.token_id, token_logprobs=logprobs, index=event.index)
                    continue
                reason = event.finish_reason
                if self._readers is not None:
                    for token in self._read(event.index, event.token_id, event.text, logprobs, end=True,
                                            generated=not ended_by_eos):
                        yield token
                    reader = self._readers.pop(event.index)
                    if self._reasoning_tokens is not None:
                        self._reasoning_tokens += reader.reasoning_tokens
                    if reader.calls and reason == "stop":
                        reason = "tool_calls"
                elif self._calls is not None:
                    tokens, called = self._end_forced(event.index, event.text, reason)
                    for token in tokens:
                        yield token
                    if called and reason == "stop":
                        reason = "tool_calls"
                elif event.text or logprobs is not None or (reason == "length" and event.token_id is not None):
                    # (the last token at the limit counts even without text: a special token's id
                    # is in llama-server's ``tokens``)
                    yield Token(text=event.text, token_id=event.token_id, token_logprobs=logprobs, index=event.index)
                if not ended_by_eos and event.token_id is not None:  # None: echo alone, nothing generated
                    generated += 1
                open_choices -= 1
                if open_choices:
                    yield Token(index=event.index, choice_finish_reason=reason)
                    continue
                self._finished = True
                kept = max((tokens for tokens, _ in seq.cache_retention), default=None)
                written = None if kept is None else max(0, kept - seq.num_cached_tokens)
                usage = Usage(len(seq.prompt_token_ids), generated, seq.num_cached_tokens, self._reasoning_tokens, written)
                stop_sequence = event.stop_sequence if reason == "stop" else None
                yield Token(finish_reason=reason, usage=usage, index=event.index, stop_sequence=stop_sequence)
                return

    def _read(self, index: int, token_id: int | None, text: str, logprobs: list[TokenLogprob] | None,
              end: bool, generated: bool = True) -> list[Token]:
        """Choice ``index``'s next token, read into thinking, content and tool calls (with
        ``end``, the rest of the answer); a token's log-probabilities go out with the content
        that holds it (thinking and calls report none, as a forced call's tokens)."""
        readers, reading = self._readers, self._reading
        assert readers is not None and reading is not None
        reader = readers.get(index) or readers.setdefault(index, reading.reader())
        held = self._held_logprobs.setdefault(index, [])
        held.extend(logprobs or ())
        tokens = []
        for piece in reader.read(token_id, text, end, generated):
            if piece.call is not None:
                tokens.append(Token(delta={"tool_calls": [piece.call]}, index=index))
            elif piece.reasoning:
                if piece.text:
                    tokens.append(Token(delta={"reasoning_content": piece.text}, index=index))
            else:
                entries = list(held) if self._token_bytes is not None else None
                tokens.append(Token(text=piece.text, token_logprobs=entries, index=index))
            held.clear()
        if end:
            self._held_logprobs.pop(index, None)
        return tokens

    def _forced(self, index: int, text: str) -> list[Token]:
        """Choice ``index``'s forced call, ``text`` further: the tool_calls deltas that makes
        certain (the call's JSON streams out as it is written)."""
        assert self._calls is not None
        body, stream = self._calls.pop(index, None) or ("", self._forced_stream())
        self._calls[index] = (body + text, stream)
        return [Token(delta={"tool_calls": [delta]}, index=index) for delta in stream.feed(body + text)]

    def _forced_stream(self) -> JsonCallStream:
        names = self._forced_names
        assert names is not None
        return ArgumentsCallStream(0, name=names.names[0]) if names.named else JsonCallStream(0)

    def _end_forced(self, index: int, text: str, finish_reason: str) -> tuple[list[Token], bool]:
        """The end of choice ``index``'s forced call: its last deltas, or, cut before its
        arguments began, the call with none where its function is known, else its text; and
        whether it is a call."""
        from kvstream.hf.tool_calls import cut_call_name

        assert self._calls is not None and self._forced_names is not None
        body, stream = self._calls.pop(index, None) or ("", self._forced_stream())
        body += text
        deltas = stream.cut(body) if finish_reason == "length" else stream.close(body)
        if deltas is None and finish_reason == "length" and (name := cut_call_name(body, self._forced_names.names)):
            deltas = [call_entry(name, "", 0)]
        if deltas is None:
            return ([Token(text=body, index=index)] if body else []), False
        return [Token(delta={"tool_calls": [delta]}, index=index) for delta in deltas], True

    def _prompt_entries(self, scores: list[TokenLogprobs] | None) -> list[TokenLogprob] | None:
        """The echoed prompt's tokens with their log-probabilities (the first has none)."""
        if scores is None or self._token_bytes is None:
            return None
        prompt = self._seq.prompt_token_ids
        entries = [self._token_bytes.entry(prompt[0], None)]
        entries += [self._token_bytes.logprob(token, score) for token, score in zip(prompt[1:], scores, strict=True)]
        return entries

    def close(self) -> None:
        """Abort the request in the runner unless it finished (frees its blocks there)."""
        if not self._finished:
            self._finished = True
            self._backend.runner.abort(self._seq.seq_id)


class EngineThread(Executor):
    """One daemon thread running what is submitted to it, in order: the HF backend's model
    load, kernel probes and step loop (ModelRunner.start says why one thread). Not a
    ThreadPoolExecutor, whose threads Python joins at exit: a step loop still waiting for
    work would hang a server that exits without closing its backend."""

    def __init__(self, name: str = "kvstream-hf-engine") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """End the thread after the jobs before this call; ``wait``: until it has ended."""
        self._jobs.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(exc)


# OpenAI's own cap on the tokens of one embeddings request (all inputs together): at ~500
# tokens a second on two cores, ten minutes of the engine's turns between steps.
MAX_EMBEDDING_TOKENS = 300_000


def _non_text_parts(messages: list[dict[str, Any]]) -> list[str]:
    """The types of the content parts other than text in ``messages`` (images, audio...)."""
    kinds = {part.get("type") for message in messages if isinstance(message.get("content"), list)
             for part in message["content"] if isinstance(part, dict) and part.get("type") != "text"}
    return sorted(str(kind) for kind in kinds)


class HFBackend(InProcessBackend):
    """A HuggingFace causal LM run in-process by KVStream's paged model runner."""

    name = "hf"
    capabilities = Capabilities(preemptible=True)
    serves_n = True  # n choices fork the prompt's blocks (copy-on-write)
    serves_token_prompts = True
    serves_echo = True  # the prompt's log-probabilities come from the same forward pass
    serves_embeddings = True  # the decoder's mean-pooled last hidden states (embeddings.py)
    runtime_judges_length = False  # this is the runtime: prompt + max_tokens past the context is a 400

    def __init__(
        self,
        base_url: str | None = None,
        model: str | None = None,
        settings: Settings | None = None,
        *,
        preloaded: LoadedModel | None = None,
        **overrides: Any,
    ) -> None:
        """``preloaded``: a LoadedModel to serve instead of loading ``model`` (tests, embedding).

        Raises ValueError with the install hint when torch or transformers is missing."""
        super().__init__(None, model, settings, **overrides)
        if preloaded is None and (problem := missing_requirements()):
            raise ValueError(problem)
        self.preloaded = preloaded
        self.runner: Any = None  # ModelRunner once started
        self._large_requests = LowPriorityWorker()  # prepares prompts of megabytes (low_priority.py)
        self.loaded: LoadedModel | None = None
        self.model_name: str | None = None
        self._start_lock = asyncio.Lock()
        self._error: str | None = None
        self._model_facts: tuple[tuple[str, ...], dict[str, str], int, int] | None = None  # models()' capabilities, details, sizes
        self._renders_tools: bool | None = None  # whether the chat template shows the model tools
        self._engine_thread: EngineThread | None = None  # loads the model, then runs the steps

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        async with self._start_lock:
            if self.runner is not None:
                return
            # One thread loads the model, probes the kernels and then runs every step
            # (ModelRunner.start says why it must be the same thread).
            self._engine_thread = EngineThread()
            try:
                self.runner = await asyncio.get_running_loop().run_in_executor(self._engine_thread, self._build)
            except BaseException as exc:
                self._engine_thread.shutdown(wait=False)
                self._engine_thread = None
                if isinstance(exc, (OSError, ValueError)):
                    self._error = str(exc)
                    raise RuntimeError(f"hf backend: {exc}") from exc
                raise
            self.runner.start(self._engine_thread)

    def _build(self) -> ModelRunner:
        import torch

        from kvstream.hf.kv_cache import auto_num_blocks, pool_dtype
        from kvstream.hf.loader import load_model, read_chat_template
        from kvstream.hf.model_runner import ModelRunner, RunnerConfig

        backend, memory, sched = self.settings.backend, self.settings.memory, self.settings.scheduler
        prefix, attention = self.settings.prefix_cache, self.settings.attention
        if backend.threads:
            torch.set_num_threads(backend.threads)
        awq = self.settings.awq
        streaming = None
        if awq.stream_embeddings and not awq.streaming:  # it would be ignored: say so instead
            raise ValueError("--stream-embeddings (awq.stream_embeddings) needs --awq-streaming (awq.streaming)")
        if awq.streaming:
            from kvstream.hf.awq.streaming import StreamingConfig

            streaming = StreamingConfig(awq.mode, awq.keep_first_k, awq.keep_last_k, awq.staging_slots, awq.drop_page_cache, awq.staging,
                                        awq.stream_embeddings)
        # (Read before the model loads: a template that cannot be used fails the start at once.)
        template = read_chat_template(backend.chat_template) if backend.chat_template is not None else None
        loaded = self.preloaded or load_model(self.model, backend.gguf_file, memory.dtype, backend.device, streaming, memory.half_weights)
        if template is not None:  # the user's template instead of the model's (a copy: a preloaded one is shared)
            loaded = dataclasses.replace(loaded, tokenizer=copy.copy(loaded.tokenizer))
            loaded.tokenizer.chat_template = template
        self.loaded = loaded
        self.model_name = backend.served_model_name or loaded.name
        context = int(getattr(loaded.model.config, "max_position_embeddings", 0) or 0) or None
        kv_dtype = pool_dtype(memory.kv_dtype)
        num_blocks = memory.num_gpu_blocks
        if num_blocks == "auto":
            num_blocks = auto_num_blocks(loaded.model, memory.block_size, memory.kv_cache_bytes, kv_dtype)
        config = RunnerConfig(
            block_size=memory.block_size,
            num_blocks=num_blocks,
            num_cpu_blocks=memory.num_cpu_blocks,
            max_num_seqs=sched.max_batch_size,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            prefill_step_ms=sched.prefill_step_ms,
            preemption_mode=sched.preemption_policy,
            policy=sched.policy,
            enable_prefix_caching=prefix.enabled,
            max_prefix_length=prefix.max_prefix_length,
            cache_ttl_s=prefix.ttl_seconds,
            max_queue_size=sched.max_queue_size,
            max_model_len=context,
            model_identity=loaded.identity,
            attention=attention.backend,
            matmul=self.settings.matmul.backend,
            kv_cache_bits=memory.kv_cache_bits,
            host_cache_bytes=memory.host_cache_bytes,
            disk_cache_dir=str(memory.disk_cache_dir) if memory.disk_cache_dir else None,
            disk_cache_bytes=memory.disk_cache_bytes,
            kv_dtype=None if memory.kv_dtype == "auto" else memory.kv_dtype,
        )
        runner = ModelRunner(loaded.model, loaded.tokenizer, config)
        if runner.vocab_size:
            from kvstream.hf.token_bytes import first_bytes

            try:
                first_bytes(runner.token_bytes, runner.vocab_size)  # now, not at the first constrained step
            except Exception as exc:  # a tokenizer that cannot spell the model's padded ids: never fail the start for it
                logger.warning("the vocabulary's first bytes could not be read at start (%s); a constrained "
                               "answer will ask again", exc)
        logger.info(
            "hf engine: %s on %s, KV pool %d blocks x %d tokens (%.0f MiB), host swap %d blocks, batch %d",
            loaded.name, runner.device, config.num_blocks, config.block_size,
            runner.cache.device_bytes / 2**20, config.num_cpu_blocks, runner.config.max_num_seqs,
        )
        return runner

    async def close(self) -> None:
        self._large_requests.close()
        if self.runner is not None:
            await asyncio.to_thread(self.runner.close)
        if self._engine_thread is not None:
            # Joined, not left running: a daemon thread still inside torch or a kernel when
            # the interpreter exits is unwound there, and the process aborted ("terminate
            # called without an active exception", rc 134, in 4 of 10 runs that closed a backend).
            await asyncio.to_thread(self._engine_thread.shutdown, True)
            self._engine_thread = None

    @property
    def scheduler(self) -> Scheduler | None:
        """The model runner's scheduler (the real pool), once started."""
        return self.runner.scheduler if self.runner is not None else None

    # ----------------------------------------------------------------- info
    async def health(self) -> bool:
        return self.runner is not None

    async def models(self) -> list[ModelInfo]:
        if self.runner is None:
            raise BackendUnavailable(self._error or "the model is still loading")
        if self._model_facts is None:
            self._model_facts = self._facts()
        capabilities, details, size, size_vram = self._model_facts
        return [ModelInfo(self.model_name or "hf", context_length=self.runner.config.max_model_len,
                          capabilities=capabilities, details=details, size=size, size_vram=size_vram)]

    def _template_renders_tools(self) -> bool:
        """Whether the model's chat template shows it the tools of a request (probed once)."""
        from kvstream.hf.loader import chat_token_ids

        assert self.runner is not None
        if self._renders_tools is None:
            tokenizer = self.runner.tokenizer
            probe = [{"role": "user", "content": "x"}]
            tool = [{"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}}]
            try:
                self._renders_tools = chat_token_ids(tokenizer, probe, tools=tool) != chat_token_ids(tokenizer, probe)
            except Exception:  # noqa: BLE001 - a template that fails on this is no tool template
                self._renders_tools = False
        return self._renders_tools

    def _facts(self) -> tuple[tuple[str, ...], dict[str, str], int, int]:
        """What the model can be asked for (Ollama's capabilities: tools where its template
        renders them or they are offered the generic way, thinking where it shows ``<think>``
        blocks), Ollama's details, and the bytes of its resident weights (all of them, and of
        them on the GPU)."""
        from kvstream.hf.reasoning import thinks

        assert self.runner is not None
        tokenizer, model = self.runner.tokenizer, self.runner.model
        template = getattr(tokenizer, "chat_template", None)
        tools = self._template_renders_tools() or self._call_syntax() == GENERIC
        capabilities = ("completion", *(("tools",) if tools else ()), *(("thinking",) if thinks(template) else ()),
                        "embedding")
        weights = self.loaded.weights_snapshot() if self.loaded is not None else {}
        awq = weights.get("format") == "awq"
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        # Weights held as stored in half precision are buffers named weight (half_weights.py).
        weights_held = {id(t): t for t in model.parameters()} | {id(t): t for n, t in model.named_buffers() if n.endswith("weight")}
        parameters = sum(t.numel() for t in weights_held.values())
        details = {
            "format": "safetensors", "family": str(getattr(model.config, "model_type", "") or ""),
            "parameter_size": "" if awq else parameter_size(parameters),
            "quantization_level": "AWQ 4-bit" if awq else {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(dtype, dtype),
        }
        size = int(weights.get("resident_bytes") or 0)
        return capabilities, details, size, size if next(model.parameters()).device.type == "cuda" else 0

    def default_max_tokens(self) -> int | None:
        return self.settings.backend.default_max_tokens

    def default_seed(self) -> int | None:
        return self.settings.backend.seed

    def end_token_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.runner.eos_ids)) if self.runner is not None else ()

    def forward_passes(self) -> tuple[int, int] | None:
        if self.runner is None:
            return 0, 0
        return self.runner.counters.steps, self.runner.counters.step_requests

    async def limits(self) -> RuntimeLimits:
        if self.runner is None:
            return RuntimeLimits()
        config = self.runner.config
        return RuntimeLimits(config.num_blocks * config.block_size, config.max_model_len, config.max_num_seqs)

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"type": self.name, "url": "in-process", "model": self.model_name or self.model}
        if self.runner is not None:
            runner = self.runner
            info |= {
                "device": str(runner.device),
                "dtype": str(runner.compute_dtype).removeprefix("torch."),
                "kv_dtype": str(runner.kv_dtype).removeprefix("torch."),  # the pool's (memory.kv_dtype)
                "kv_device_bytes": runner.cache.device_bytes,
                "kv_host_bytes": runner.cache.host_bytes,
                "steps": runner.counters.steps,
                "forward_tokens": runner.counters.forward_tokens,
                "prefill_tokens": runner.counters.prefill_tokens,
                "decode_tokens": runner.counters.decode_tokens,
                "embedding_tokens": runner.counters.embedding_tokens,  # computed between the steps
                "prefill_pacing": runner.pacer.summary(),  # prompt tokens a step may take beside decodes
                # How the model's own tool calls are read (tool_call_syntax.py), None: not at all.
                "tool_call_syntax": self._call_syntax(),
                "chat_template": str(self.settings.backend.chat_template or "the model's"),
                "attention_backend": runner.attention.name,
                "attention_backend_why": runner.attention.why_not,  # why each faster tier is not running
                "matmul_backend": runner.matmul.name,
                "matmul_backend_why": runner.matmul.why_not,
                "native_ops": runner.native_ops.summary(),
                "decoder": runner.decoder.summary(),  # the direct decoder path (fast_decoder.py)
                # Echo with logprobs: prompt tokens scored from computed logits, and from the
                # scores kept per block (prompt_scores.py), and how many blocks are kept.
                "prompt_scores": {"scored_tokens": runner.counters.scored_tokens,
                                  "kept_score_tokens": runner.counters.kept_score_tokens,
                                  "kept_blocks": len(runner.prompt_scores)},
            }
        if self.loaded is not None:
            info["weights"] = self.loaded.weights_snapshot()
        return info

    def _call_syntax(self) -> str | None:
        from kvstream.hf.tool_call_syntax import call_syntax

        chosen = self.settings.backend.tool_call_syntax
        if chosen == "auto":
            shown = call_syntax(getattr(self.runner.tokenizer, "chat_template", None))
            return shown if shown is not None or self._template_renders_tools() else GENERIC
        return None if chosen == "none" else chosen

    def _chat_ids(self, request: GenerateRequest, messages: list[dict[str, Any]], generation_prompt: bool,
                  continue_final: bool = False) -> list[int]:
        """``messages`` through the template as ``request`` has them rendered: its tools
        (left out with ``tool_choice`` "none"; in the system message the generic way) and
        template switches; ``continue_final``: the last (assistant) message left open."""
        from kvstream.hf.loader import chat_token_ids
        from kvstream.hf.request_options import template_kwargs

        tools = request.extra.get("tools") if request.extra.get("tool_choice") != "none" else None
        kwargs = template_kwargs(request.extra)
        if self._generic_calls(request):
            messages = with_tools_prompt(messages, tools, request.extra.get("parallel_tool_calls") is False)
            tools = None
        return chat_token_ids(self.runner.tokenizer, messages, generation_prompt=generation_prompt, tools=tools,
                              template_kwargs=kwargs, continue_final=continue_final)

    def retained_prefixes(self, request: GenerateRequest, prompt_ids: list[int]) -> list[tuple[int, float]]:
        """Each breakpoint's prefix in tokens: the whole prompt, or the tokens it shares with
        the first ``messages`` messages rendered alone (without a generation prompt; 0: the
        tools alone), so a breakpoint never claims a token its prefix does not render. A
        template that cannot render such a prefix keeps that breakpoint's nothing."""
        kept = []
        for breakpoint in request.cache_breakpoints:
            if breakpoint.messages is None or not request.is_chat:
                kept.append((len(prompt_ids), breakpoint.seconds))
                continue
            try:
                prefix = self._chat_ids(request, (request.messages or [])[: breakpoint.messages], False)
            except Exception as exc:  # e.g. a template that wants a user message
                logger.debug("cache breakpoint after %d messages not kept: %s", breakpoint.messages, exc)
                continue
            shared = next((i for i, (a, b) in enumerate(zip(prefix, prompt_ids)) if a != b), min(len(prefix), len(prompt_ids)))
            kept.append((shared, breakpoint.seconds))
        return kept

    def _generic_calls(self, request: GenerateRequest) -> bool:
        """Whether the request's tools are offered the generic way (generic_calls.py): a
        chat offering tools, the model to decide (``tool_choice`` auto), no JSON
        ``response_format``, and generic the syntax chosen or the template's lack of one."""
        extra = request.extra
        if not request.is_chat or not extra.get("tools") or extra.get("tool_choice") not in (None, "auto"):
            return False
        if (extra.get("response_format") or {}).get("type", "text") != "text":
            return False
        return self._call_syntax() == GENERIC

    def metric_families(self) -> Iterator[Any]:
        if self.runner is not None:
            yield from runner_metric_families(self.runner)
        if self.loaded is not None:
            yield from weights_metric_families(self.loaded.weights_snapshot())

    # ------------------------------------------------------------ requests
    async def tokenize(self, request: GenerateRequest) -> list[int] | None:
        """The prompt's token ids, the request checked first (a field the engine refuses is a
        400 before it is queued). All of it off the event loop every client's stream is served
        from: a chat template over a few MB of messages and their tokenizing take seconds
        (benchmarks/loop_stall.py), a tool's schema or a grammar long to compile (compiled once,
        cached for submit, which runs on the loop). A request of megabytes of text is prepared
        at a lower CPU priority than the engine's steps (low_priority.py)."""
        if self.runner is None:
            raise BackendUnavailable(self._error or "the model is still loading")
        if text_chars(request.messages, request.prompt) > LARGE_CHARS:
            return await self._large_requests.run(self._prompt_ids, request)
        return await asyncio.to_thread(self._prompt_ids, request)

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        """``tokenize``'s work, on a worker thread: the prompt's ids, then the request's fields
        checked and its constraints read into their machines (cached for submit). Not for a
        prompt that leaves no room in the context: submit refuses it before building anything
        (NeverFits), and reading the schema of hundreds of tools into a machine (a second of
        pure Python, sharing the interpreter with every stream) would be spent on a refusal."""
        from kvstream.hf.engine_turns import yielding_to_engine
        from kvstream.hf.request_options import forces_call

        assert self.runner is not None
        ids = self._templated_ids(request)
        limit = self.runner.scheduler.config.max_model_len
        if limit is not None and len(ids) + (1 if request.max_tokens is None else request.max_tokens) > limit:
            return ids
        # Reading constraints is pure Python: it lets the engine step between slices of it
        # (beside it, a step waited for the interpreter's lock at each of its torch calls).
        with yielding_to_engine():
            self._checked_params(request)
            if request.is_chat and request.extra.get("tools") and request.extra.get("tool_choice") != "none" \
                    and not forces_call(request) and not self._generic_calls(request):
                self._call_hold(request, self._answer_reading(request, Sequence(ids, 1)))  # the hold on its own calls
        return ids

    def _templated_ids(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids: a chat's through the model's template (400 for what it
        cannot render), a completion's text, ids or fill-in-the-middle parts."""
        from kvstream.hf.loader import chat_token_ids
        from kvstream.hf.request_options import forces_call, template_kwargs

        assert self.runner is not None
        tokenizer = self.runner.tokenizer
        if request.is_chat:
            if request.extra.get("suffix"):
                raise BackendRejected("'suffix' is a completions field: a chat has no text after the answer.",
                                      param="suffix", code="invalid_value")
            # Tools go to the template, as the model was trained to see them; with
            # tool_choice "none" the client wants none called, and they are left out.
            tools = request.extra.get("tools") if request.extra.get("tool_choice") != "none" else None
            continuing = request.continue_final_message
            if continuing and (request.messages or [{}])[-1].get("role") != "assistant":
                raise BackendRejected("'continue_final_message' continues the assistant's message: the last message "
                                      "must be the assistant's.", param="continue_final_message", code="invalid_value")
            # A warm-up prefills the conversation's prefix: no assistant header after it, which
            # later requests would not share; nor does a continued assistant message have one.
            generation_prompt = not request.prefix_only and not continuing
            try:
                kwargs = template_kwargs(request.extra)
                if self._generic_calls(request):  # the tools in the system message instead
                    return self._chat_ids(request, request.messages or [], generation_prompt, continuing)
                ids = self._chat_ids(request, request.messages or [], generation_prompt, continuing)
                if tools and not forces_call(request) and ids == chat_token_ids(
                    tokenizer, request.messages or [], generation_prompt=generation_prompt, template_kwargs=kwargs,
                    continue_final=continuing,
                ):
                    # Its template drops them: the model would never see them (Ollama's answer
                    # too). A forced call is held to the tool's schema all the same.
                    raise BackendRejected(f"{self.model_name or 'this model'} does not support tools (its chat template "
                                          "does not render them; --chat-template can give it one that does)",
                                          param="tools", code="unsupported_parameter")
                return ids
            except BackendRejected:
                raise
            except Exception as exc:  # a template that rejects these messages (roles, tools...)
                kinds = _non_text_parts(request.messages or [])
                if kinds:
                    raise BackendRejected(f"{self.model_name or 'this model'} takes text only: its chat template cannot "
                                          f"render content parts of type {', '.join(kinds)}", param="messages",
                                          code="unsupported_content") from None
                raise BackendRejected(f"the model's chat template rejected the messages: {exc}", param="messages") from None
        suffix = request.extra.get("suffix")
        if suffix is not None and suffix != "":
            return self._fill_in_middle_ids(request, suffix)
        if request.prompt_token_ids is not None:
            vocab = self.runner.vocab_size
            if vocab is not None and max(request.prompt_token_ids) >= vocab:
                raise BackendRejected(f"Invalid value for 'prompt': token {max(request.prompt_token_ids)} is outside "
                                      f"the vocabulary of {vocab}.", param="prompt", code="invalid_value")
            return list(request.prompt_token_ids)
        return list(tokenizer(request.prompt or "").input_ids) or [tokenizer.bos_token_id or 0]

    def infill_tokens(self, parts: InfillParts) -> list[int] | None:
        from kvstream.hf.fill_in_middle import InfillWindow, fim_tokens, infill_prompt_ids, missing_tokens

        tokenizer = self._loaded_tokenizer()
        tokens = fim_tokens(tokenizer)
        if tokens is None:  # llama-server's answer, word for word: clients match on it
            raise BackendRejected(f"Infill is not supported by this model: {missing_tokens(tokenizer)}", 501,
                                  code="not_supported")
        context = self.runner.config.max_model_len or INFILL_BATCH  # type: ignore[union-attr]
        window = InfillWindow(min(INFILL_BATCH, context), context, max(0, parts.n_predict))
        return infill_prompt_ids(tokenizer, tokens, parts.prefix, parts.suffix, list(parts.other_files), parts.prompt,
                                 window)

    def chat_template(self) -> str | None:
        template = self.loaded.tokenizer.chat_template if self.loaded is not None else None
        return template if isinstance(template, str) else None

    def text_tokens(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int] | None:
        tokenizer = self._loaded_tokenizer()
        return list(tokenizer(text, add_special_tokens=add_special, split_special_tokens=not parse_special).input_ids)

    def token_bytes(self, token_ids: list[int]) -> list[bytes] | None:
        self._check_vocabulary(token_ids)
        return [self.runner.token_bytes(token) for token in token_ids]  # type: ignore[union-attr]

    def detokenize(self, token_ids: list[int]) -> str | None:
        self._check_vocabulary(token_ids)
        return self._loaded_tokenizer().decode(token_ids)

    def _loaded_tokenizer(self) -> Any:
        if self.runner is None:
            raise BackendUnavailable(self._error or "the model is still loading")
        return self.runner.tokenizer

    def _check_vocabulary(self, token_ids: list[int]) -> None:
        self._loaded_tokenizer()  # the model is loaded
        vocab = self.runner.vocab_size  # type: ignore[union-attr]
        outside = next((t for t in token_ids if t < 0 or (vocab is not None and t >= vocab)), None)
        if outside is not None:
            raise ValueError(f"token {outside} is outside the vocabulary of {vocab}")

    def _fill_in_middle_ids(self, request: GenerateRequest, suffix: Any) -> list[int]:
        """A completion between the prompt and ``suffix`` (fill_in_middle.py); 400 where the
        model has no FIM tokens or the request cannot be one."""
        from kvstream.hf.fill_in_middle import fim_prompt_ids, fim_tokens

        assert self.runner is not None
        if not isinstance(suffix, str):
            raise BackendRejected("Invalid type for 'suffix': expected a string.", param="suffix", code="invalid_type")
        if request.prompt_token_ids is not None or request.echo:
            raise BackendRejected("'suffix' takes a text prompt, without echo.", param="suffix", code="invalid_value")
        tokens = fim_tokens(self.runner.tokenizer)
        if tokens is None:
            raise BackendRejected(f"{self.model_name or 'this model'} cannot fill in the middle: its tokenizer has no "
                                  "fill-in-the-middle tokens (a code model's).", param="suffix", code="unsupported_parameter")
        return fim_prompt_ids(self.runner.tokenizer, tokens, request.prompt or "", suffix)

    def _blend_params(self, request: GenerateRequest) -> Any:
        """BlendParams when the request (or the configured default) asks for blend reuse."""
        from kvstream.hf.blend import BlendParams

        prefix = self.settings.prefix_cache
        if (request.reuse or prefix.reuse) != "blend" or (request.echo and request.logprobs is not None):
            return None  # (a scored prompt is computed whole: moved KV would change its scores)
        return BlendParams(blend_ratio=prefix.blend_ratio if request.blend_ratio is None else request.blend_ratio)

    def _sampling_params(self, request: GenerateRequest, max_tokens: int) -> Any:
        """The request's SamplingParams (request_options.py); 400 for what the engine refuses."""
        from kvstream.hf.request_options import sampling_params

        assert self.runner is not None
        return sampling_params(request, max_tokens, self.runner.vocab_size, generic_calls=self._generic_calls(request),
                               default_seed=self.default_seed(), token_of=self._token_of)

    def _checked_params(self, request: GenerateRequest) -> None:
        """The request's fields checked (a 400 for one refused) and its constraint's
        expression compiled and read into its machine: both cached for submit."""
        from kvstream.hf.pattern_machine import machine_for

        params = self._sampling_params(request, 1)
        if params.pattern is not None:
            machine_for(params.pattern)

    def _token_of(self, text: str) -> int | None:
        """The id of the one token ``text`` is (special tokens read as such), or None."""
        assert self.runner is not None
        ids = self.runner.tokenizer(text, add_special_tokens=False).input_ids
        return ids[0] if len(ids) == 1 else None

    def _answer_reading(self, request: GenerateRequest, seq: Sequence) -> AnswerReading | None:
        """How the answers of a chat are read for thinking and tool calls; None for the rest
        (completions, a forced call, a structured output: the constraint shapes the text)."""
        from kvstream.hf.request_options import forces_call

        assert self.runner is not None
        extra = request.extra
        if not request.is_chat or request.prefix_only or forces_call(request):
            return None
        if extra.get("response_format") is not None and extra["response_format"].get("type") != "text":
            return None
        if self._generic_calls(request):  # the constraint holds the answer from its first token: no thinking to read
            return AnswerReading(CallReading(GENERIC, single_call=extra.get("parallel_tool_calls") is False),
                                 tag_texts=special_tag_texts(self.runner.tokenizer))
        return answer_reading(self.runner.tokenizer, extra, seq.prompt_token_ids, self.settings.backend.tool_call_syntax)

    def _call_hold(self, request: GenerateRequest, reading: AnswerReading | None) -> Any:
        """The model's own calls held to the tools from their opening on (call_grammar.py;
        cached by the tools, so the second time for a request is cheap); None if unheld."""
        if reading is None or reading.calls is None:
            return None
        from kvstream.hf.call_grammar import call_hold

        return call_hold(reading.calls, request.extra["tools"], reading.thinking_opened, reading.tag_texts)

    def submit(self, request: GenerateRequest, seq: Sequence) -> HFStream:
        from kvstream.hf.request_options import forces_call
        from kvstream.hf.tool_calls import forced_names

        if self.runner is None:
            raise BackendUnavailable(self._error or "the model is still loading")
        choices = request.n if (request.best_of or 0) <= request.n else request.best_of
        self.runner.check_fits(seq, choices)  # before anything is built for a request refused (_prompt_ids)
        params = self._sampling_params(request, seq.max_tokens)
        if request.fill_in_middle or (request.extra.get("suffix") and not request.is_chat):  # its end tokens end it
            from kvstream.hf.fill_in_middle import end_ids

            ends = end_ids(self.runner.tokenizer)
            params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, *ends))
        reading = self._answer_reading(request, seq)
        hold = self._call_hold(request, reading) if not params.holds_answer else None
        if hold is not None:
            # (post_sampling_probs without a top_k to bound a held distribution: left unheld)
            with contextlib.suppress(ValueError):
                params = dataclasses.replace(params, pattern=hold.pattern, pattern_tokens=hold.tokens, triggers=hold.triggers)
        if params.thinking_budget is not None:
            # A budget counts thinking: none where the answer is not read for it (the model's
            # template shows no <think> block, or a constraint holds the answer).
            opened = reading.thinking_opened if reading is not None else None
            budget = params.thinking_budget if opened is not None else None
            params = dataclasses.replace(params, thinking_budget=budget, thinking_opened=bool(opened))
        echo = None
        if request.echo:
            echo = request.prompt if request.prompt_token_ids is None else self.runner.tokenizer.decode(request.prompt_token_ids)
        candidates = None
        if request.best_of is not None and request.best_of > request.n:
            # Each sampled token's log-probability scores its candidate (best_of.py).
            candidates = Candidates(request.n, with_logprobs=params.logprobs is not None)
            params = dataclasses.replace(params, logprobs=params.logprobs or 0)
        stream = HFStream(self, seq, self.runner.token_bytes if params.logprobs is not None else None, echo,
                          tool_call=forced_names(request.extra.get("tools"), request.extra.get("tool_choice")) if forces_call(request) else None,
                          reading=reading, candidates=candidates, choices=choices)
        self.runner.add_request(seq, params, stream.sink, blend=self._blend_params(request), n=choices,
                                progress=request.return_progress)
        return stream

    def embedding_width(self) -> int | None:
        """The decoder's hidden size: the width of its last hidden states (embeddings.py)."""
        return getattr(self.runner.model.config, "hidden_size", None) if self.runner is not None else None

    async def embed(self, inputs: list[str | list[int]], truncate: bool = False) -> Embeddings:
        """Each input's embedding (embeddings.py): short inputs several to a job, long ones a
        chunk per job, each job run between the engine's steps; every input is checked
        (empty, out of the vocabulary, past the context, the request's total) before any
        runs. A client that leaves cancels what has not run."""
        from kvstream.hf import embeddings
        from kvstream.hf.model_runner import EngineStopped

        runner = self.runner
        if runner is None:
            raise BackendUnavailable(self._error or "the model is still loading")
        context, vocab = runner.config.max_model_len, runner.vocab_size
        texts = [item for item in inputs if isinstance(item, str)]
        # Off the event loop: a 4 MB body of text is about a second of tokenizing.
        encoded = iter(await asyncio.to_thread(lambda: runner.tokenizer(texts).input_ids) if texts else [])
        token_lists = []
        for i, item in enumerate(inputs):
            ids = list(next(encoded)) if isinstance(item, str) else list(item)
            where = "'input'" if len(inputs) == 1 else f"'input[{i}]'"
            if not ids:
                raise BackendRejected(f"Invalid value for {where}: it is empty.", param="input", code="invalid_value")
            if vocab is not None and not 0 <= min(ids) <= max(ids) < vocab:
                bad = next(t for t in ids if not 0 <= t < vocab)
                raise BackendRejected(f"Invalid value for {where}: token {bad} is outside the vocabulary of {vocab}.",
                                      param="input", code="invalid_value")
            if context is not None and len(ids) > context:
                if not truncate:
                    raise BackendRejected(f"{where} has {len(ids)} tokens, more than the model's context of {context} tokens.",
                                          param="input", code="context_length_exceeded")
                ids = ids[:context]
            token_lists.append(ids)
        total = sum(map(len, token_lists))
        if total > MAX_EMBEDDING_TOKENS:
            raise BackendRejected(f"Requested {total} tokens, max {MAX_EMBEDDING_TOKENS} tokens per request (summed "
                                  "across inputs).", param="input", code="invalid_value")
        vectors: list[list[float]] = [[] for _ in token_lists]
        for group in embeddings.jobs(token_lists):
            computing, done = embeddings.work(runner.model, token_lists, group, counted=self._count_embedding_tokens), None
            while done is None:
                try:
                    future = runner.run_between_steps(computing.step)
                    done = await asyncio.wrap_future(future)
                except EngineStopped as exc:
                    raise BackendUnavailable(str(exc)) from None
                except SchedulerError:
                    raise  # QueueFull: as many jobs wait as requests may (a 429, as a full queue is)
                except asyncio.CancelledError:
                    future.cancel()
                    raise
                except Exception as exc:
                    logger.exception("an embedding failed")
                    raise BackendError(f"the engine failed: {exc!r}") from None
            for index, vector in zip(group, done, strict=True):
                vectors[index] = vector
        return Embeddings(vectors, total)

    def _count_embedding_tokens(self, tokens: int) -> None:
        """On the engine thread, as the runner counts its steps' tokens."""
        assert self.runner is not None
        self.runner.counters.embedding_tokens += tokens

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Token]:
        """Generate without KVStreamEngine in front (the engine uses ``submit``)."""
        prompt = await self.tokenize(request)
        stream = self.submit(request, Sequence(prompt or [0], request.max_tokens or 256))
        try:
            async for token in stream:
                yield token
        finally:
            stream.close()
