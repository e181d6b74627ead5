"""AWQ on CUDA (issue 20): the Triton kernel (kvstream/hf/awq/triton_matmul.py) and AWQ models on
a GPU, resident and streamed from pinned host memory through GPU staging slots.

Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``), on its own and as the kernel of a real AWQ checkpoint's layers, resident
and streamed by copies; its compiled form is checked by compiling every variant to cubins
(tests/hf/triton_aot.py). The CUDA staging (pinned host memory, a copy stream, events) and the
kernel's numerics on tensor cores run only on a CUDA machine: the ``gpu`` tests below, which
``benchmarks/gpu_check.sh`` runs there. The interpreter cannot multiply bfloat16 (it computes on
the raw bits), so bfloat16 is tested on a GPU only.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import require_import

torch = require_import("torch")
require_import("triton")

from kvstream.hf.awq import linear as awq_linear  # noqa: E402
from kvstream.hf.awq import triton_matmul  # noqa: E402
from kvstream.hf.awq.checkpoint import CheckpointError  # noqa: E402
from kvstream.hf.awq.format import dequantize, quantize_rtn  # noqa: E402
from kvstream.hf.awq.model import load_awq_model  # noqa: E402
from kvstream.hf.awq.streaming import StreamingConfig  # noqa: E402
from tests.hf.tiny_models import tiny_llama  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(autouse=True)
def interpreted():
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)")


DTYPES = [torch.float32, torch.float16, torch.bfloat16] if CUDA else [torch.float32, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, in_features, out_features, group_size",
                         [(1, 256, 200, 128), (5, 128, 64, 32), (16, 576, 136, 64), (17, 192, 72, 64), (70, 128, 1544, 128)])
def test_the_kernel_matches_the_reference_matmul(dtype, rows, in_features, out_features, group_size):
    """Every row tile (16 and 64 rows, partly filled), output columns past the last full tile,
    each group size, split and unsplit input features, against ``x @ dequantize(W)``."""
    generator = torch.Generator().manual_seed(rows)
    packed = quantize_rtn(torch.randn(out_features, in_features, generator=generator), group_size)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    expected = x.float() @ dequantize(packed)
    got = triton_matmul.matmul(x.to(DEVICE), packed.qweight.to(DEVICE), packed.qzeros.to(DEVICE), packed.scales.to(DEVICE), group_size)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float().cpu(), expected, atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype])


def test_no_rows_give_no_rows():
    packed = quantize_rtn(torch.randn(64, 128), 64)
    out = triton_matmul.matmul(torch.empty(0, 128, device=DEVICE), packed.qweight.to(DEVICE), packed.qzeros.to(DEVICE),
                               packed.scales.to(DEVICE), 64)
    assert out.shape == (0, 64)


def test_small_inputs_split_their_features_and_large_ones_do_not():
    steps = 576 // triton_matmul.BLOCK_K  # 18
    block_m, splits = triton_matmul.launch_shape(1, 576, 576, processors=132)
    assert block_m == triton_matmul.SMALL_ROWS and splits > 1 and steps % splits == 0 and splits <= triton_matmul.MAX_SPLITS
    assert triton_matmul.launch_shape(17, 576, 576, 132)[0] == triton_matmul.LARGE_ROWS
    assert triton_matmul.launch_shape(4096, 576, 1536, 132) == (triton_matmul.LARGE_ROWS, 1)  # tiles enough
    assert triton_matmul.launch_shape(1, 64, 576, 132)[1] == 2  # no more splits than steps
    # 17 steps (prime) over 16 at most: a split must be a whole number of steps, so none.
    assert triton_matmul.launch_shape(1, 32 * 17, 576, 132)[1] == 1


def test_every_awq_kernel_variant_compiles_for_hopper_and_ampere_gpus():
    """The AWQ kernel's variants (three precisions x two row tiles) through Triton's whole
    compiler to sm_90 and sm_86 cubins, with no GPU, each within its block's shared memory."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-m", "tests.hf.triton_aot", "--awq", "90", "86"], env=env, capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(compiled) == 2 * 6 and {row["arch"] for row in compiled} == {90, 86}
    for row in compiled:
        assert 0 < row["cubin_bytes"] and row["shared_bytes"] <= row["shared_limit"], row


# ------------------------------------------------------------------ AWQ checkpoints
@pytest.fixture(scope="module")
def tiny_awq(tmp_path_factory):
    """A random small 4-layer Llama (hidden 128, GQA 4 / 2 heads: the interpreter's time grows
    with the weights) as a round-to-nearest AWQ checkpoint, and its tokenizer: made here, so
    that the GPU machine (without SmolLM2's file) has one too."""
    from kvstream.hf.awq.quantize import quantize_model, save_checkpoint

    model, tokenizer = tiny_llama(torch.device("cpu"), torch.float32, layers=4, hidden=128, intermediate=320, heads=4, kv_heads=2)
    state = quantize_model(model, tokenizer, 64, "", activation_aware=False)
    folder = tmp_path_factory.mktemp("awq-tiny") / "llama"
    save_checkpoint(folder, model, tokenizer, state, 64, None)
    return folder, tokenizer


def forward_logits(model, ids):
    with torch.no_grad():  # twice: the second forward runs on what the first staged ahead
        return [(model(ids, use_cache=False).logits, model(ids[:, :3], use_cache=False).logits) for _ in range(2)]


def test_the_triton_kernel_computes_an_awq_model_resident_and_streamed(tiny_awq, monkeypatch):
    """The model's layers on the Triton kernel give the ``dequant`` kernel's logits to float
    tolerance, and streamed by copies through staging slots (on a GPU: from pinned host memory
    on a copy stream) exactly its own resident logits."""
    from kvstream.hf.awq import model as awq_model

    folder, _ = tiny_awq
    ids = torch.randint(2, 512, (1, 9), generator=torch.Generator().manual_seed(4)).to(DEVICE)

    def run(kernel, config=None):
        monkeypatch.setattr(awq_model, "probe_kernel", lambda *args, **kwargs: awq_linear.KernelChoice(kernel, "test"))
        model, report = load_awq_model(folder, torch.float32, config, DEVICE)
        try:
            return forward_logits(model, ids), report.snapshot()
        finally:
            if report.streamer is not None:
                report.streamer.close()

    reference, _ = run("dequant")
    resident, snapshot = run("triton")
    assert snapshot["kernel"] == "triton"
    for got, want in zip(resident[0], reference[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    for config in (StreamingConfig("partial_resident", 1, 1, 2, staging="copy"), StreamingConfig("full_stream", 0, 0, 1, staging="copy")):
        streamed, snapshot = run("triton", config)
        assert snapshot["staging"] == ("pinned" if CUDA else "copy") and snapshot["streamed_bytes"] > 0
        for got, want in zip(streamed, resident, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_cpu_only_streaming_settings_are_refused_on_cuda_before_anything_loads(tiny_awq):
    folder, _ = tiny_awq
    for config in (StreamingConfig("partial_resident", 1, 1, 2, drop_page_cache=True),
                   StreamingConfig("partial_resident", 1, 1, 2, stream_embeddings=True)):
        with pytest.raises(CheckpointError, match="on CUDA the streamed layers are held in pinned host memory"):
            load_awq_model(folder, torch.float32, config, "cuda")


def test_a_cuda_streamer_refuses_the_cpu_only_stagings_before_touching_cuda(tiny_awq):
    """Mapped staging, page-cache dropping and a mapped head are CPU mechanisms: a streamer
    for a CUDA device refuses them at construction, before any CUDA call (so also here)."""
    from kvstream.hf.awq.model import decoder_layers
    from kvstream.hf.awq.streaming import LayerStreamer

    folder, _ = tiny_awq
    model, _ = load_awq_model(folder, torch.float32)
    layers = decoder_layers(model)
    plan = {1: [(name, m) for name, m in layers[1].named_modules() if isinstance(m, awq_linear.AWQLinear)]}
    for kwargs in ({"mapped": True}, {"file_ranges": {1: []}}, {"tail": [torch.zeros(4)]}):
        with pytest.raises(ValueError, match="on CUDA layers are staged by copies from pinned host memory"):
            LayerStreamer(layers, plan, 2, device=torch.device("cuda"), **kwargs)


# ------------------------------------------------------------------ on a GPU only
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_the_gpu_the_probe_picks_a_kernel_and_streaming_holds_layers_in_pinned_memory(tiny_awq, dtype):
    """On a GPU: the probe's kernel (triton where it is right and fastest) gives the CPU
    float32 model's logits to the precision's tolerance; streamed (two slots, K=0) the layers'
    packed tensors sit in pinned host memory, the slots on the GPU, and the logits are the
    resident run's bit for bit; the GPU holds less."""
    folder, _ = tiny_awq
    ids = torch.randint(2, 512, (2, 21), generator=torch.Generator().manual_seed(5))
    cpu_model, _ = load_awq_model(folder, torch.float32)
    with torch.no_grad():
        expected = cpu_model(ids, use_cache=False).logits
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model, report = load_awq_model(folder, dtype, None, "cuda")
    resident_gpu = torch.cuda.memory_allocated() - before
    assert report.kernel.name in ("triton", "dequant"), report.kernel
    print("probe:", report.kernel.name, report.kernel.why)
    with torch.no_grad():
        resident = model(ids.cuda(), use_cache=False).logits
    tolerance = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 1e-1}[dtype]
    torch.testing.assert_close(resident.float().cpu(), expected, atol=tolerance * expected.abs().max().item(), rtol=tolerance)
    del model
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    # Every layer streamed through two slots: the GPU holds two layers' packed weights, not four.
    streamed_model, streamed = load_awq_model(folder, dtype, StreamingConfig("partial_resident", 0, 0, 2), "cuda")
    try:
        streamed_gpu = torch.cuda.memory_allocated() - before
        streamer = streamed.streamer
        assert streamer.cuda is not None and streamed.snapshot()["staging"] == "pinned"
        assert all(t.is_pinned() for layer in streamer.order for _, p in streamer.sources[layer]
                   for t in (p.qweight, p.qzeros, p.scales))
        assert all(t.is_cuda for slot in streamer.slots for tensors in slot.values() for t in tensors)
        assert streamed_gpu < resident_gpu, (streamed_gpu, resident_gpu)
        with torch.no_grad():
            for _ in range(3):  # later forwards run on what earlier ones staged ahead
                assert torch.equal(streamed_model(ids.cuda(), use_cache=False).logits, resident)
    finally:
        streamed.streamer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_on_the_gpu_the_engine_streams_an_awq_model_with_the_resident_run_s_greedy_tokens(tiny_awq):
    """Through the engine (paged KV, batching, chunked prefill) on a GPU: a streamed AWQ
    model's greedy tokens equal the resident model's, prompts of several lengths batched."""
    from kvstream.hf.model_runner import ModelRunner, RunnerConfig
    from kvstream.hf.sampling import SamplingParams

    folder, tokenizer = tiny_awq
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 512, (length,), generator=generator).tolist() for length in (3, 17, 40, 90)]
    config = RunnerConfig(block_size=16, num_blocks=64, num_cpu_blocks=0, max_num_seqs=8, attention="auto",
                          max_num_batched_tokens=48, enable_prefix_caching=False, debug_invariants=True)
    outputs = []
    for streaming in (None, StreamingConfig("partial_resident", 1, 1, 2), StreamingConfig("full_stream", 0, 0, 3)):
        model, report = load_awq_model(folder, torch.bfloat16, streaming, "cuda")
        try:
            engine = ModelRunner(model, tokenizer, config)
            outputs.append(engine.generate_sync(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
        finally:
            if report.streamer is not None:
                report.streamer.close()
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]


# ------------------------------------------------------------------ the CUDA copy ordering, without CUDA
class _Timeline:
    """A double of the few ``torch.cuda`` stream and event calls ``CudaCopies`` makes, which
    logs them in order (CUDA's semantics: a ``wait_event`` waits for the event's latest
    ``record`` before it), so that the ordering protocol can be checked on a CPU."""

    def __init__(self):
        self.log: list[tuple] = []
        timeline = self

        class Stream:
            def __init__(self, device=None):
                self.name = "copy"

            def wait_event(self, event):
                timeline.log.append(("wait", self.name, event.name, event.recorded_at))

            def synchronize(self):
                timeline.log.append(("synchronize", self.name))

        class ComputeStream(Stream):
            def __init__(self):
                self.name = "compute"

        class Event:
            count = 0

            def __init__(self):
                Event.count += 1
                self.name, self.recorded_at = f"event{Event.count}", None

            def record(self, stream):
                self.recorded_at = len(timeline.log)
                timeline.log.append(("record", stream.name, self.name))

        class Switch:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                timeline.log.append(("stream", self.stream.name))

            def __exit__(self, *exc):
                timeline.log.append(("stream", "compute"))

        self.compute = ComputeStream()
        self.Stream, self.Event, self.stream = Stream, Event, Switch
        self.current_stream = lambda device=None: self.compute


def test_cuda_copies_overwrite_a_slot_only_after_its_last_user_is_queued_and_layers_wait_for_their_own_copy(
        tiny_awq, monkeypatch):
    """The CUDA staging protocol, run on the CPU with a double of torch.cuda's streams and
    events: every copy into a slot waits for an event the compute stream recorded after the
    slot's last user was queued (its hook ran, then its kernels), and every streamed layer's
    kernels wait for the event recorded right after the copy of its own weights into its slot;
    closing waits for the copy stream; the logits stay the resident run's."""
    from kvstream.hf.awq import model as awq_model
    from kvstream.hf.awq import streaming

    folder, _ = tiny_awq
    monkeypatch.setattr(awq_model, "probe_kernel", lambda *args, **kwargs: awq_linear.KernelChoice("dequant", "test"))
    ids = torch.randint(2, 512, (1, 7), generator=torch.Generator().manual_seed(8))
    resident, _ = load_awq_model(folder, torch.float32)
    with torch.no_grad():
        expected = resident(ids, use_cache=False).logits
    for slots in (1, 2, 3):
        timeline = _Timeline()
        for name in ("Stream", "Event", "stream", "current_stream"):
            monkeypatch.setattr(streaming.torch.cuda, name, getattr(timeline, name))
        model, report = load_awq_model(folder, torch.float32, StreamingConfig("full_stream", 0, 0, slots, staging="copy"))
        streamer = report.streamer
        streamer.cuda = streaming.CudaCopies(torch.device("cpu"), slots)  # the CPU run, ordered as on a GPU
        loads = []  # (log position, layer, slot) of each hook pointing a layer at its slot
        copies = []  # (first log position, layer, slot) of each copy (its stream entered, its wait, its record)
        original_copy = streamer.cuda.copy

        def logged_copy(sources, slot, index):
            layer = next(layer for layer, s in streamer.sources.items() if s is sources)
            copies.append((len(timeline.log), layer, index))
            original_copy(sources, slot, index)

        streamer.cuda.copy = logged_copy
        original_before = streamer._before_copied

        def logged_before(layer):
            original_before(layer)
            slot = next(i for i, s in enumerate(streamer.slots)
                        if streamer.plan[layer][0][1].qweight.data_ptr() == s[streamer.plan[layer][0][0]][0].data_ptr())
            loads.append((len(timeline.log), layer, slot))
            timeline.log.append(("hook", layer, slot))

        monkeypatch.setattr(streamer, "_before_copied", logged_before)
        try:
            with torch.no_grad():
                for _ in range(3):
                    assert torch.equal(model(ids, use_cache=False).logits, expected), slots
        finally:
            streamer.close()
        assert len(loads) == 3 * 4 and copies
        assert timeline.log[-1] == ("synchronize", "copy")  # closing waits for the copy stream
        for start, layer, slot in copies:
            # A copy runs on the copy stream: its wait, the copies, then the record of the slot's event.
            entered, wait, ready, left = timeline.log[start : start + 4]
            assert entered == ("stream", "copy") and left == ("stream", "compute")
            assert wait[:2] == ("wait", "copy") and ready == ("record", "copy", streamer.cuda.ready[slot].name)
            users = [p for p, _, s in loads if s == slot and p < start]
            # The compute stream's record it waits for came after the slot's every earlier user.
            assert wait[3] is not None and all(p < wait[3] for p in users), (slots, layer, slot)
        for position, layer, slot in loads:
            wait = next(entry for entry in reversed(timeline.log[:position]) if entry[:2] == ("wait", "compute"))
            latest = max((c for c in copies if c[2] == slot and c[0] < position), key=lambda c: c[0])
            # Its kernels wait for the record right after the copy of its own weights into its slot.
            assert latest[1] == layer and wait[2] == streamer.cuda.ready[slot].name and wait[3] == latest[0] + 2, \
                (slots, layer, slot)
