"""Layer streaming: run a model whose packed weights do not all stay in memory.

Embeddings, norms, the LM head and the first/last ``keep_first_k`` / ``keep_last_k``
decoder layers stay resident. The other layers' packed tensors (``qweight``, ``qzeros``,
``scales``) stay memory-mapped from the checkpoint. With ``staging="copy"`` they are copied into one of
``staging_slots`` preallocated slots just before their layer runs; the copy for the next
streamed layers runs on a background thread while the current one computes (a memmove that
releases the GIL; the stager runs no torch code, whose calls would hold it), so a forward
waits on disk or page cache only where compute is shorter than the copy. The layer's
``AWQLinear`` modules are pointed at the slot, then the slot is reused ``staging_slots``
layers later.

Modes (``StreamingConfig.mode``):

- ``full_resident``: nothing streamed (the reference for the others);
- ``partial_resident``: layers outside the first/last K streamed whole;
- ``ffn_only_stream``: outside the first/last K, only the MLP projections streamed
  (attention stays resident: the MLP is about two thirds of a layer's bytes);
- ``full_stream``: every decoder layer streamed, K ignored.

With ``staging="mapped"`` (CPU; the default) there are no slots: a streamed layer computes straight from
the mapped checkpoint, and the background thread only faults the next layer's pages in, and
only where one has left the page cache (``mincore`` tells, one forward in ``CHECK_EVERY``
while none has; ``MADV_POPULATE_READ`` reads them from disk and maps them): nothing is
copied, and a warm forward runs about as fast as a resident one. On this CPU a copy from the page cache moves each byte twice more than the
kernel's own read, on the cores the forward computes on (streamed forwards ran at
0.64-0.79x the resident one with copies).

With ``drop_page_cache``, each layer's checkpoint pages are dropped once staged (unmapped
from this process, then evicted from the kernel's page cache), so every forward reads the
streamed layers from disk: what happens anyway when the weights are larger than memory, made
explicit so that the page cache does not evict other things to hold them, and so that the
disk-bound case can be measured on a machine with memory to spare. ``mapped`` drops a
layer's pages once it has computed (when the next streamed layer starts).

On CUDA (``device``) the streamed layers' packed tensors are held in pinned host memory
(copied there from the checkpoint at load: the GPU's memory, not the host's, is what streaming
saves there) and staged into slots in GPU memory, ``copy`` only: each copy is issued on a copy
stream as the engine thread reaches a layer, ``staging_slots - 1`` layers ahead, after an event
the compute stream records at that moment (every layer before it, so the slot's last user,
has then been queued ahead of it), and the compute stream waits for the copy's own event
before the layer's kernels. Nothing blocks the engine thread and no stager thread is needed:
the copy engine overlaps the copy of layer i+1 with the compute of layer i. Written and
reviewed, never run on a GPU here.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from kvstream.hf.awq.format import PackedLinear
from kvstream.hf.awq.linear import AWQLinear, derive_buffers

Mode = Literal["full_resident", "partial_resident", "ffn_only_stream", "full_stream"]
MODES: tuple[str, ...] = ("full_resident", "partial_resident", "ffn_only_stream", "full_stream")
STAGINGS: tuple[str, ...] = ("copy", "mapped")


@dataclass(frozen=True)
class StreamingConfig:
    """Which layers' weights are streamed, and through how many staging slots."""

    mode: Mode = "partial_resident"
    keep_first_k: int = 2
    keep_last_k: int = 2
    staging_slots: int = 2
    drop_page_cache: bool = False
    # Computed from the mapping (CPU), or copied into slots first. Mapped is the default: on
    # CPU it ran faster warm and cold in every measured round (benchmarks/awq_streaming.py)
    # and holds no slots; the copies take the cores the forward computes on.
    staging: Literal["copy", "mapped"] = "mapped"
    # The token embeddings and the LM head read from the mapped checkpoint too (tied or not),
    # instead of held in memory: the head then reads its whole table from the page cache every
    # forward, as a streamed layer does (the input lookup only its tokens' rows): faulted in
    # ahead where it has left the page cache, dropped with ``drop_page_cache`` as the layers
    # are (the input table, read by rows, is not). None (the default) is on where it can be:
    # on the CPU, where the head keeps its table as stored. A resident head reads the same
    # bytes every token as a mapped one, so warm it costs nothing (benchmarks/awq_streaming.py:
    # within the rounds' noise), and what streaming is asked for is the memory: a tied table is
    # most of a small model's resident bytes (SmolLM2: 54 of 61 MB at K=2) and a large share
    # of mid-sized ones' (Llama-3.2-1B's 128k x 2048 in float16, 0.5 GB). False keeps it held.
    stream_embeddings: bool | None = None

    def maps_head(self, on_gpu: bool) -> bool:
        """Whether the head's table is left in the mapping (``stream_embeddings`` resolved):
        the CUDA path holds its tables on the GPU."""
        return (not on_gpu) if self.stream_embeddings is None else self.stream_embeddings

    def check(self, num_layers: int) -> None:
        """Raise ValueError naming the setting the model cannot take."""
        if self.mode not in MODES:
            raise ValueError(f"streaming mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.keep_first_k < 0 or self.keep_last_k < 0:
            raise ValueError("keep_first_k and keep_last_k must be >= 0")
        if self.mode != "full_stream" and self.keep_first_k + self.keep_last_k > num_layers:
            raise ValueError(
                f"keep_first_k {self.keep_first_k} + keep_last_k {self.keep_last_k} is more than the model's {num_layers} layers"
            )
        if self.staging_slots < 1:
            raise ValueError("staging_slots must be >= 1")
        if self.staging not in STAGINGS:
            raise ValueError(f"staging {self.staging!r} is not one of {', '.join(STAGINGS)}")

    def streamed_parts(self, layer: int, num_layers: int) -> tuple[str, ...]:
        """Submodule names of ``layer`` whose projections are streamed ("" = all of it)."""
        if self.mode == "full_resident":
            return ()
        if self.mode == "full_stream":
            return ("",)
        if layer < self.keep_first_k or layer >= num_layers - self.keep_last_k:
            return ()
        return ("mlp",) if self.mode == "ffn_only_stream" else ("",)


# Mapped, warm: every how many forwards the upcoming layers' pages are checked to be still
# in the page cache (a mincore per page range: about 2 of the 3 ms a 96-layer token spent in
# the hooks, benchmarks/awq_mapped.py --engine). Pages leave it only under memory pressure;
# once a check finds some gone, every forward checks until one finds none, so a layer
# evicted between checks is read on demand by the kernel for at most this many forwards.
# Dropping pages (``drop_page_cache``) checks every forward.
CHECK_EVERY = 4


class LayerStreamer:
    """Stages the packed weights of streamed layers into slots, one layer ahead per spare
    slot, from forward pre-hooks on the decoder layers (``mapped``: faults them in, no slots)."""

    def __init__(
        self,
        layers: torch.nn.ModuleList,
        plan: dict[int, list[tuple[str, AWQLinear]]],
        slots: int,
        file_ranges: dict[int, list[tuple[str, int, int]]] | None = None,
        mapped: bool = False,
        tail: list[torch.Tensor] | None = None,
        tail_file_ranges: list[tuple[str, int, int]] | None = None,
        device: torch.device | None = None,
    ) -> None:
        """``file_ranges``: per streamed layer, the (file, start, end) byte ranges its packed
        tensors occupy in the checkpoint, whose pages are dropped once staged (``mapped``:
        once computed); None keeps them. ``slots``: how many layers are staged at once (the
        one computing and ``slots - 1`` ahead), into slot buffers unless ``mapped``.
        ``tail``: mapped tensors every forward reads whole after the decoder layers (a mapped
        LM head: ``stream_embeddings``), checked as the first streamed layer starts (one
        mincore: ~30 us for SmolLM2's 56 MB table) and faulted in on a thread of their own
        where they have left the page cache, so that the forward's layers hide the read
        (a bulk fault-in read SmolLM2's table at 1.0-1.4 GB/s here, the head's own page faults
        at 0.5-0.6); with ``tail_file_ranges`` (their byte ranges in the checkpoint) dropped
        just before, as a layer's pages are once computed. ``device``: a CUDA device puts the
        slots there and the sources in pinned host memory (copies only, no file ranges)."""
        self.device = torch.device(device or "cpu")
        self.cuda: CudaCopies | None = None
        if self.device.type == "cuda" and (mapped or file_ranges is not None or tail):
            raise ValueError("on CUDA layers are staged by copies from pinned host memory: no mapped staging, "
                             "page-cache dropping or mapped LM head")
        self.layers = layers
        self.file_ranges = file_ranges
        self.mapped = mapped
        self.depth = slots
        self._computed_last: int | None = None  # mapped: the layer whose pages go next
        self._forwards = 0  # mapped: forwards begun (the first streamed layer's hooks)
        self._gone_now = self._gone_last = False  # mapped: a check found pages gone, this forward / the last
        self._fds: dict[str, int] = {}
        self.plan = plan  # layer index -> its streamed (relative name, module), sources mapped
        for modules in plan.values():
            for _, module in modules:
                module.streamed = True
        self.order = sorted(plan)
        self.position = {layer: i for i, layer in enumerate(self.order)}
        self.sources = {layer: [(name, m.packed()) for name, m in plan[layer]] for layer in self.order}
        if self.device.type == "cuda":
            self.sources = {layer: [(name, pinned(p)) for name, p in self.sources[layer]] for layer in self.order}
        # Mapped: each layer's tensors as the fewest page ranges (one per file region: a
        # layer's tensors are usually stored together), one madvise each rather than one per
        # tensor (21 a layer, ~7 us each, even on pages already mapped).
        self.page_ranges = {
            layer: merged_page_ranges([t for _, p in self.sources[layer] for t in (p.qweight, p.qzeros, p.scales)])
            for layer in self.order
        } if mapped else {}
        first = self.sources[self.order[0]] if self.order else []
        self.slots = [
            {name: tuple(torch.empty_like(t, device=self.device) for t in (p.qweight, p.qzeros, p.scales)) for name, p in first}
            for _ in range(0 if mapped else slots)
        ]
        if self.device.type == "cuda":
            self.cuda = CudaCopies(self.device, slots)
        # Per slot, per projection: buffers for its zeros x scales and scales in the dequant
        # kernel's order, computed there when that kernel runs (allocating them per forward
        # fragmented the heap). The stager does not compute them: its torch calls hold the
        # GIL, and the engine thread waiting for it made a streamed forward 2x a resident one.
        modules = dict(plan[self.order[0]]) if self.order else {}
        self.derived = [
            {name: derive_buffers(p.qzeros.shape[0], p.out_features, modules[name].dtype, self.device) for name, p in first}
            for _ in range(slots)
        ]
        # Mapped: a module computes from its own mapped tensors for good, so it is pointed at
        # them and at its derive buffers (those of the slot its place in the order gives it)
        # once, here; only what it derived is forgotten before each forward (the buffers are
        # shared with the layers ``slots`` apart), through its instance dict (see ``load``).
        self._instance_dicts: dict[int, list[dict]] = {}
        if mapped:
            for layer in self.order:
                derived = self.derived[self.position[layer] % slots]
                for name, module in plan[layer]:
                    module.load(module.qweight, module.qzeros, module.scales, derive_into=derived[name])
                self._instance_dicts[layer] = [vars(module) for _, module in plan[layer]]
            # One mincore vector per page range, reused on the engine thread.
            self._vectors = {layer: [ctypes.create_string_buffer((end - start) // PAGE) for start, end in self.page_ranges[layer]]
                             for layer in self.order}
        expected = {name: tuple(t.shape for t in (p.qweight, p.qzeros, p.scales)) for name, p in first}
        for layer in self.order:  # every streamed layer fits the same slots
            shapes = {name: tuple(t.shape for t in (p.qweight, p.qzeros, p.scales)) for name, p in self.sources[layer]}
            if shapes != expected:
                raise ValueError(f"decoder layer {layer} has other projection shapes than layer {self.order[0]}: it cannot be streamed")
        self.layer_bytes = {  # packed bytes each streamed layer stages (biases stay resident)
            layer: sum(p.nbytes() - (p.bias.numel() * p.bias.element_size() if p.bias is not None else 0)
                       for _, p in self.sources[layer])
            for layer in self.order
        }
        self.bytes_per_forward = sum(self.layer_bytes.values())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstream-stage")
        # layer -> (its copy or faulting in, None when there was nothing to do; its slot)
        self._pending: dict[int, tuple[Future[int] | None, int]] = {}
        self._next_slot = 0
        self._lock = threading.Lock()
        self.staged_bytes = 0
        self.stall_s = 0.0  # time forwards waited for a copy
        self.tail = tail or []
        self.tail_ranges = merged_page_ranges(self.tail)
        self._tail_vectors = [ctypes.create_string_buffer((end - start) // PAGE) for start, end in self.tail_ranges]
        self.tail_file_ranges = tail_file_ranges
        self._tail_pending: Future[None] | None = None
        self._tail_read = False  # a forward has reached the tail since it was last dropped
        # Its own thread: the tail's read runs beside the layers' staging, not queued behind it.
        self._tail_pool = ThreadPoolExecutor(1, thread_name_prefix="kvstream-tail")
        self._hooks = [layers[layer].register_forward_pre_hook(self._make_hook(layer)) for layer in self.order]

    @property
    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for slot in self.slots for bufs in slot.values() for t in bufs)

    def _stage(self, layer: int, slot: int) -> int:
        # A plain memmove, not torch's copy: it allocates nothing and starts no OpenMP team
        # on this thread (which cost ~200 MB of per-thread heap arenas, measured), and ctypes
        # releases the GIL around it, so it overlaps the layer computing on the engine thread.
        # Mapped: one madvise per merged page range, which faults the pages in (also without
        # the GIL), and no per-tensor Python work on this thread (it would contend for the GIL
        # with the forward).
        staged = self.layer_bytes[layer]
        if self.cuda is not None:
            self.cuda.copy(self.sources[layer], self.slots[slot], slot)
        elif self.mapped:
            for start, end in self.page_ranges[layer]:
                # Only where a page has left the page cache: populating pages already there
                # still walks each one, on a core the forward computes on (benchmarks/awq_mapped.py).
                if not pages_cached(start, end):
                    populate_pages(start, end)
        else:
            for name, packed in self.sources[layer]:
                for target, source in zip(self.slots[slot][name], (packed.qweight, packed.qzeros, packed.scales)):
                    ctypes.memmove(target.data_ptr(), source.data_ptr(), source.numel() * source.element_size())
            if self.file_ranges is not None:
                self._drop(layer)
        with self._lock:
            self.staged_bytes += staged
        return staged

    def _drop(self, layer: int) -> None:
        """Unmap ``layer``'s checkpoint pages and evict them from the page cache."""
        assert self.file_ranges is not None
        self._evict([t for _, packed in self.sources[layer] for t in (packed.qweight, packed.qzeros, packed.scales)],
                    self.file_ranges[layer])

    def _evict(self, tensors: list[torch.Tensor], file_ranges: list[tuple[str, int, int]]) -> None:
        for tensor in tensors:
            unmap_pages(tensor)
        for path, start, end in file_ranges:
            with self._lock:  # the stager (copies) and the engine thread (the tail) both evict
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def _before_tail(self, layer: int) -> None:
        """The tail's pages (see ``__init__``), as a forward reaches its first streamed layer:
        dropped (the last forward's head has read them), then faulted in where gone, beside
        the layers' staging, the whole forward ahead of the head."""
        position = self.position[layer]
        if position == 0 and self.tail_file_ranges is not None and self._tail_read:
            if self._tail_pending is not None:
                self._tail_pending.result()
                self._tail_pending = None
            self._evict(self.tail, self.tail_file_ranges)
            self._tail_read = False
        if position == 0:
            if not all(pages_cached(start, end, vector) for (start, end), vector in zip(self.tail_ranges, self._tail_vectors)):
                self._tail_pending = self._tail_pool.submit(self._fault_in_tail)
            self._tail_read = True

    def _fault_in_tail(self) -> None:
        for start, end in self.tail_ranges:
            if not pages_cached(start, end):
                populate_pages(start, end)

    def _make_hook(self, layer: int):
        def hook(module: torch.nn.Module, args: object) -> None:
            self.before(layer)

        return hook

    def before(self, layer: int) -> None:
        """Layer ``layer`` is about to run: its weights in a slot (``mapped``: in memory),
        the next ones on the way."""
        if self.mapped:
            self._before_mapped(layer)
        else:
            self._before_copied(layer)
        if self.tail_ranges:
            self._before_tail(layer)

    def _wait(self, future: Future[int]) -> None:
        started = time.perf_counter()
        future.result()
        self.stall_s += time.perf_counter() - started

    def _before_mapped(self, layer: int) -> None:
        # Run before every streamed layer of every forward, so kept to what a warm model needs:
        # a mincore per upcoming layer and a dict store per projection (re-pointing each module
        # as copies do, and a fresh mincore vector, cost a warm 96-layer token ~5 ms: ~50 us a
        # layer with the caches cold from the weights streaming past).
        if self.file_ranges is not None:
            if self._computed_last is not None and self._computed_last != layer:
                self._drop(self._computed_last)  # it has computed: the forward is past it
            self._computed_last = layer
        pending = self._pending.pop(layer, None)
        if pending is None:  # not looked at ahead: the first forward, or an unplanned order
            self.drain()
            self._stage(layer, 0)
        elif pending[0] is not None:
            self._wait(pending[0])
        for instance in self._instance_dicts[layer]:
            instance["_derived"] = None
        position = self.position[layer]
        if position == 0:
            self._forwards += 1
            self._gone_last, self._gone_now = self._gone_now, False
        checking = (self.file_ranges is not None or self._gone_last or self._gone_now
                    or self._forwards % CHECK_EVERY == 1 % CHECK_EVERY)  # the first forward, then every CHECK_EVERY
        for ahead in range(1, self.depth):
            upcoming = self.order[(position + ahead) % len(self.order)]
            if upcoming in self._pending or upcoming == layer:
                continue
            if checking and not all(pages_cached(start, end, vector)
                                    for (start, end), vector in zip(self.page_ranges[upcoming], self._vectors[upcoming])):
                self._gone_now = True
                self._pending[upcoming] = (self._pool.submit(self._stage, upcoming, 0), 0)
            else:
                # Warm (or not checked this forward): nothing to fault in, so no hand-off to
                # the stager (a submit and a wait cost more than the check, ~30 us a layer).
                with self._lock:
                    self.staged_bytes += self.layer_bytes[upcoming]
                self._pending[upcoming] = (None, 0)

    def _before_copied(self, layer: int) -> None:
        if self.cuda is not None:
            # Every layer queued before this one (the last user of any slot staged into
            # below) is ahead of this event on the compute stream.
            self.cuda.mark_queued()
        pending = self._pending.pop(layer, None)
        if pending is None:
            self.drain()  # an unplanned order (a partial forward): start the ring afresh
            slot = self._next_slot
            self._next_slot = (slot + 1) % self.depth
            self._stage(layer, slot)
        else:
            future, slot = pending
            if future is not None:
                self._wait(future)
        if self.cuda is not None:
            self.cuda.wait(slot)  # on the compute stream: the engine thread does not block
        for name, module in self.plan[layer]:
            module.load(*self.slots[slot][name], derive_into=self.derived[slot][name])
        # Prefetch into the slots no running layer uses: up to (slots - 1) layers ahead.
        position = self.position[layer]
        for ahead in range(1, self.depth):
            upcoming = self.order[(position + ahead) % len(self.order)]
            if upcoming in self._pending or upcoming == layer:
                continue
            target = (slot + ahead) % self.depth
            if self.cuda is not None:  # queued on the copy stream: nothing to hand a thread
                self._stage(upcoming, target)
                self._pending[upcoming] = (None, target)
            else:
                self._pending[upcoming] = (self._pool.submit(self._stage, upcoming, target), target)
            self._next_slot = (target + 1) % self.depth

    def drain(self) -> None:
        """Wait for every copy (and faulting in) in flight and forget it."""
        for future, _ in self._pending.values():
            if future is not None:
                future.result()
        self._pending.clear()
        if self._tail_pending is not None:
            self._tail_pending.result()
            self._tail_pending = None

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.drain()
        if self.cuda is not None:  # no copy still writing a slot when the slots are freed
            self.cuda.stream.synchronize()
        self._pool.shutdown(wait=True)
        self._tail_pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def pinned(packed: PackedLinear) -> PackedLinear:
    """``packed``'s tensors copied into pinned (page-locked) host memory, which the GPU's
    copy engine reads directly and asynchronously."""
    def pin(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)

    return PackedLinear(pin(packed.qweight), pin(packed.qzeros), pin(packed.scales), packed.group_size, packed.bias)


class CudaCopies:
    """Host-to-GPU copies into staging slots on a stream of their own, ordered against the
    compute stream by events: a copy waits until the compute stream has passed the point
    ``mark_queued`` last recorded (the slot's last user queued before it), and a layer's
    kernels wait until their slot's copy is done (``wait``)."""

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.queued = torch.cuda.Event()
        self.ready = [torch.cuda.Event() for _ in range(slots)]

    def mark_queued(self) -> None:
        self.queued.record(torch.cuda.current_stream(self.device))

    def copy(self, sources: list[tuple[str, PackedLinear]], slot: dict[str, tuple[torch.Tensor, ...]], index: int) -> None:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.queued)
            for name, packed in sources:
                for target, source in zip(slot[name], (packed.qweight, packed.qzeros, packed.scales), strict=True):
                    target.copy_(source, non_blocking=True)
            self.ready[index].record(self.stream)

    def wait(self, index: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ready[index])


PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_DONTNEED = 4
_libc = ctypes.CDLL(None, use_errno=True)


MADV_WILLNEED = 3
MADV_POPULATE_READ = 22  # Linux 5.14+


def merged_page_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The pages ``tensors`` occupy, as (start, end) address ranges, page-aligned outward,
    touching or overlapping ranges merged."""
    spans = sorted((t.data_ptr() // PAGE * PAGE, -(-(t.data_ptr() + t.numel() * t.element_size()) // PAGE) * PAGE)
                   for t in tensors if t.numel())
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def populate_pages(start: int, end: int) -> None:
    """Fault the mapped pages of addresses [start, end) in (page-aligned; read from disk where
    the page cache lacks them), so that the kernel reading them next does not wait on the
    disk. Before Linux 5.14 (EINVAL): only asks the kernel to read ahead (``MADV_WILLNEED``)."""
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_POPULATE_READ) != 0:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_WILLNEED)


_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def pages_cached(start: int, end: int, vector: ctypes.Array | None = None) -> bool:
    """Whether every page of the mapped addresses [start, end) (page-aligned) is in the page
    cache (``mincore``; one byte per page, bit 0 set when resident). False where it cannot
    tell, so that the caller populates. ``vector``: a buffer of one byte per page to reuse."""
    if vector is None:
        vector = ctypes.create_string_buffer((end - start) // PAGE)
    if _libc.mincore(start, end - start, vector) != 0:
        return False
    return b"\x00" not in vector.raw.translate(_LOW_BIT)  # the other bits are unspecified


_LOW_BIT = bytes(i & 1 for i in range(256))


def unmap_pages(tensor: torch.Tensor) -> None:
    """Drop this process's pages of a memory-mapped tensor (whole pages inside it only; they
    are read back from the file on the next touch). The page cache may still hold them."""
    start = -(-tensor.data_ptr() // PAGE) * PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE * PAGE
    if end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)
