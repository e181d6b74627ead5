"""The native linear kernel (native_linear.cpp) against F.linear, and how the engine installs it."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvstream.hf import native_linear
from kvstream.hf.native_linear import MatmulBackendError, NativeLinear, install
from tests.hf.conftest import built_kernel, started_backend


@pytest.fixture(scope="module")
def kernel():
    return built_kernel(native_linear.load, "the native linear kernel")


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))


# (out features, in features): K a multiple of 8 or not (the scalar tail), N a multiple of
# the 3-row weight tile or not, SmolLM2's own shapes.
SHAPES = [(1536, 576), (576, 1536), (192, 576), (7, 64), (5, 20), (4, 13), (1, 8), (2, 1)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16, 64])
def test_kernel_matches_f_linear(kernel, n, k, rows):
    generator = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=generator)
    x = torch.randn(rows, k, generator=generator)
    assert close(kernel.native_linear(x, w), F.linear(x, w))


def test_rows_with_a_stride_are_read_in_place(kernel):
    """A slice of wider rows (the packed row's hidden states are such views)."""
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(6, 100, generator=generator)
    w = torch.randn(9, 64, generator=generator)
    x = wide[:, 8:72]
    assert x.stride(0) == 100
    assert close(kernel.native_linear(x, w), F.linear(x.contiguous(), w))


def test_a_row_gets_the_same_bits_alone_in_any_batch_and_on_any_thread_count(kernel):
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(300, 576, generator=generator)
    x = torch.randn(23, 576, generator=generator)
    batch = kernel.native_linear(x, w)
    for i in (0, 4, 22):
        assert torch.equal(kernel.native_linear(x[i : i + 1], w)[0], batch[i])
        assert torch.equal(kernel.native_linear(x[i : i + 5], w)[0], batch[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel.native_linear(x, w), batch)
    finally:
        torch.set_num_threads(threads)


def test_the_kernels_are_built_with_openmp(kernel):
    """at::parallel_for is inline OpenMP: built without -fopenmp every kernel of ours would run
    on one thread (they did, until native_build passed the flag)."""
    if torch.get_num_threads() < 2 or sys.platform == "darwin":
        pytest.skip("torch runs one thread here" if torch.get_num_threads() < 2 else "built without OpenMP on macOS")
    assert kernel.parallel_threads(64) == min(torch.get_num_threads(), 64)


def test_threads_calling_at_once_all_get_their_answers(kernel):
    """Calls from several threads at once each get the answer a lone call gives."""
    generator = torch.Generator().manual_seed(4)
    w = torch.randn(3000, 576, generator=generator)
    inputs = [torch.randn(rows, 576, generator=generator) for rows in (1, 3, 8, 16)]
    want = [kernel.native_linear(x, w) for x in inputs]
    failures = []

    def hammer(i):
        for _ in range(30):
            if not torch.equal(kernel.native_linear(inputs[i], w), want[i]):
                failures.append(i)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_the_kernel_releases_the_gil_while_it_runs(kernel):
    """The server's event loop keeps running while the engine computes. With a switch
    interval of seconds this thread keeps the GIL until it blocks, so the ticker (which
    sleeps between ticks, never holding the GIL long) can only tick while a kernel call
    has released it: a call that held it would leave the count unchanged."""
    generator = torch.Generator().manual_seed(5)
    w = torch.randn(49152, 576, generator=generator)  # SmolLM2's LM head: tens of ms at 64 rows
    x = torch.randn(64, 576, generator=generator)
    ticks = [0]
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.0001)

    interval = sys.getswitchinterval()
    ticker = threading.Thread(target=tick)
    ticker.start()
    during = []
    try:
        sys.setswitchinterval(5.0)
        for _ in range(3):
            before = ticks[0]
            kernel.native_linear(x, w)
            during.append(ticks[0] - before)
    finally:
        sys.setswitchinterval(interval)
        stop.set()
        ticker.join()
    assert max(during) > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize(("n", "k"), [(1536, 576), (7, 64), (4, 13)])
@pytest.mark.parametrize("rows", [1, 4, 7, 64])
def test_half_weights_give_the_bits_of_their_widened_float32_copy(kernel, dtype, n, k, rows):
    """Half weights (an AWQ checkpoint's tied embeddings) are widened in registers, exactly:
    the same products in the same order as the float32 kernel on the upcast matrix."""
    generator = torch.Generator().manual_seed(n + k + rows)
    w = (torch.randn(n, k, generator=generator) * 0.05).to(dtype)
    x = torch.randn(rows, k, generator=generator)
    got = kernel.native_linear(x, w)
    assert got.dtype == torch.float32
    assert torch.equal(got, kernel.native_linear(x, w.float()))
    assert close(got, F.linear(x, w.float()))


def test_bad_inputs_are_errors_not_reads(kernel):
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.native_linear(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match="float32 inputs"):
        kernel.native_linear(torch.randn(2, 16).half(), w.half())
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16 weights"):
        kernel.native_linear(torch.randn(2, 16), w.to(torch.int8))
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and weight \[N, K\]"):
        kernel.native_linear(torch.randn(2, 15), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel.native_linear(torch.randn(2, 16), torch.randn(16, 8).t())


class Tiny(nn.Module):
    """Two linear layers and an embedding whose table the head shares (tied, as SmolLM2's)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed = nn.Embedding(50, 16, dtype=dtype)
        self.up = nn.Linear(16, 40, bias=True, dtype=dtype)
        self.down = nn.Linear(40, 16, bias=False, dtype=dtype)
        self.head = nn.Linear(16, 50, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.down(torch.relu(self.up(self.embed(ids)))))


def test_install_switches_linear_layers_in_place_and_keeps_their_outputs(kernel):
    torch.manual_seed(3)
    model = Tiny()
    ids = torch.randint(0, 50, (1, 9))
    params = {name: p.data_ptr() for name, p in model.named_parameters()}
    with torch.inference_mode():
        want = model(ids)
        choice = install(model)
        got = model(ids)
    assert (choice.name, choice.modules, choice.why_not) == ("native", 3, {})
    assert all(type(m) is NativeLinear for m in (model.up, model.down, model.head))
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == params  # nothing copied
    assert model.head.weight is model.embed.weight
    assert close(got, want)


def test_large_batches_and_autograd_take_f_linear(kernel, monkeypatch):
    model = Tiny()
    install(model)
    calls = []
    real = kernel.native_linear
    counting = SimpleNamespace(native_linear=lambda x, w: calls.append(len(x)) or real(x, w))
    monkeypatch.setattr(native_linear, "load", lambda: (counting, "test"))
    with torch.inference_mode():
        model(torch.randint(0, 50, (1, native_linear.MAX_ROWS)))
        assert calls == [native_linear.MAX_ROWS] * 3
        calls.clear()
        x = torch.randn(1, native_linear.MAX_ROWS + 1, 16)
        assert torch.equal(model.up(x), F.linear(x, model.up.weight, model.up.bias)) and calls == []
    out = model(torch.randint(0, 50, (1, 4)))  # grad enabled: F.linear, so backward works
    out.sum().backward()
    assert calls == [] and model.up.weight.grad is not None


def test_a_switched_model_cast_or_given_a_strided_weight_afterwards_runs_f_linear(kernel):
    model = Tiny()
    install(model)
    ids = torch.randint(0, 50, (1, 6))
    with torch.inference_mode():
        model.to(torch.float64)
        assert model(ids).dtype == torch.float64  # the kernel takes float32 only: F.linear ran
        model.to(torch.float32)
        strided = nn.Parameter(torch.randn(40, 16).t(), requires_grad=False)  # [16, 40], not contiguous
        assert not strided.is_contiguous()
        model.down.weight = strided
        x = torch.randn(1, 3, 40)
        assert torch.equal(model.down(x), F.linear(x, strided))


def test_backend_torch_leaves_or_puts_back_nn_linear(kernel):
    model = Tiny()
    assert install(model).name == "native"
    choice = install(model, "torch")  # the same model handed to a second engine
    assert choice.name == "torch" and "not requested" in choice.why_not["native"]
    assert all(type(m) is nn.Linear for m in (model.up, model.down, model.head))


def test_what_the_kernel_cannot_take_is_said_and_native_by_name_refuses():
    model = Tiny(torch.bfloat16)
    choice = install(model)
    assert choice.name == "torch" and "no float32 nn.Linear" in choice.why_not["native"]
    assert type(model.up) is nn.Linear
    with pytest.raises(MatmulBackendError, match="matmul backend native cannot run: no float32"):
        install(model, "native")
    with pytest.raises(MatmulBackendError, match="unknown matmul backend 'fast'"):
        install(Tiny(), "fast")


def test_a_kernel_that_disagrees_is_not_installed(kernel, monkeypatch):
    wrong = SimpleNamespace(native_linear=lambda x, w: F.linear(x, w) * 1.01)
    monkeypatch.setattr(native_linear, "load", lambda: (wrong, "test"))
    model = Tiny()
    choice = install(model)
    assert choice.name == "torch" and "disagrees with F.linear" in choice.why_not["native"]
    assert type(model.up) is nn.Linear
    with pytest.raises(MatmulBackendError, match="disagrees"):
        install(model, "native")


def test_a_missing_compiler_keeps_f_linear(monkeypatch):
    monkeypatch.setattr(native_linear, "load", lambda: (None, "RuntimeError: no compiler"))
    choice = install(Tiny())
    assert choice.why_not == {"native": "not built: RuntimeError: no compiler"}


async def test_status_names_the_matmul_backend(smollm2, kernel):
    for requested, expected in (("torch", "torch"), ("auto", "native")):
        async with started_backend(smollm2, matmul={"backend": requested}) as backend:
            info = backend.describe()
            assert info["matmul_backend"] == expected == backend.runner.config.matmul
            layers = [m for m in smollm2[0].modules() if isinstance(m, nn.Linear)]
            assert all((type(m) is NativeLinear) == (expected == "native") for m in layers)
            assert expected == "native" or "not requested" in info["matmul_backend_why"]["native"]


async def test_native_by_name_that_cannot_run_stops_the_engine_at_start(smollm2, monkeypatch):
    monkeypatch.setattr(native_linear, "load", lambda: (None, "RuntimeError: no compiler"))
    with pytest.raises(RuntimeError, match="hf backend: matmul backend native cannot run: not built: RuntimeError: no compiler"):
        async with started_backend(smollm2, matmul={"backend": "native"}):
            pass
