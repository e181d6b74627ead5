"""AWQ checkpoints and layer streaming (issue 20): the packed layout bit for bit, the kernels
against a reference, checkpoints made here and read back, streamed execution identical to
resident, the bytes that stay resident, and every bad checkpoint refused with one clear error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REQUIRE_REAL, require_import

torch = require_import("torch")

from kvstream.hf.awq import linear as awq_linear  # noqa: E402
from kvstream.hf.awq.checkpoint import CheckpointError, SafetensorsIndex  # noqa: E402
from kvstream.hf.awq.format import AWQ_ORDER, dequantize, pack, quantize_rtn, unpack  # noqa: E402
from kvstream.hf.awq.linear import AWQLinear  # noqa: E402
from kvstream.hf.awq.model import decoder_layers, load_awq_model  # noqa: E402
from kvstream.hf.awq.streaming import StreamingConfig  # noqa: E402


# ------------------------------------------------------------------ the layout, bit for bit
def test_eight_columns_pack_into_one_int32_in_awq_order():
    row = torch.arange(8, dtype=torch.int32).unsqueeze(0)  # column c holds the value c
    packed = pack(row)
    # Nibble i holds column AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7): 0x75316420.
    assert packed.tolist() == [[0x75316420]]
    assert sum(c << (4 * i) for i, c in enumerate(AWQ_ORDER)) == 0x75316420
    assert torch.equal(unpack(packed), row)


def test_pack_round_trips_and_dequantize_matches_an_elementwise_reference():
    generator = torch.Generator().manual_seed(1)
    values = torch.randint(0, 16, (64, 24), generator=generator, dtype=torch.int32)
    assert torch.equal(unpack(pack(values)), values)
    weight = torch.randn(24, 64, generator=generator)  # [out, in]
    layer = quantize_rtn(weight, 32)
    assert layer.qweight.shape == (64, 3) and layer.qzeros.shape == (2, 3) and layer.scales.shape == (2, 24)
    assert layer.scales.dtype == torch.float16 and layer.qweight.dtype == torch.int32
    q, z = unpack(layer.qweight), unpack(layer.qzeros)
    expected = torch.empty(64, 24)
    for k in range(64):  # the definition, one weight at a time
        for n in range(24):
            expected[k, n] = (q[k, n] - z[k // 32, n]) * layer.scales[k // 32, n].float()
    assert torch.equal(dequantize(layer), expected)
    step = layer.scales.float().repeat_interleave(32, dim=0)
    assert ((dequantize(layer) - weight.T).abs() <= step / 2 + 1e-6).all()  # round to nearest
    assert torch.equal(dequantize(layer, columns=slice(8, 16)), expected[:, 8:16])


def test_fake_quantize_is_exactly_the_packed_round_trip():
    from kvstream.hf.awq.format import dequantize, fake_quantize, quantize_rtn

    weight = torch.randn(24, 256) * 0.05
    assert torch.equal(fake_quantize(weight, 64), dequantize(quantize_rtn(weight, 64)).T)


def test_shapes_the_layout_cannot_take_are_refused():
    with pytest.raises(ValueError, match="group size 100"):
        quantize_rtn(torch.randn(8, 200), 100)
    with pytest.raises(ValueError, match="in_features 96 is not a multiple of the group size 64"):
        quantize_rtn(torch.randn(8, 96), 64)
    with pytest.raises(ValueError, match="out_features 12"):
        quantize_rtn(torch.randn(12, 64), 32)


@pytest.mark.parametrize("kernel", ["dequant", "int4mm"])
def test_each_kernel_matches_the_reference_matmul(kernel, monkeypatch):
    monkeypatch.setattr(awq_linear, "CHUNK_BYTES", 64 * 128 * 4)  # several chunks of columns
    generator = torch.Generator().manual_seed(2)
    packed = quantize_rtn(torch.randn(96, 128, generator=generator), 64)
    packed.bias = torch.randn(96, generator=generator)
    layer = AWQLinear(packed)
    layer.kernel = kernel
    x = torch.randn(2, 5, 128, generator=generator)
    reference = x @ dequantize(packed) + packed.bias
    try:
        y = layer(x)
    except (RuntimeError, AttributeError) as exc:  # int4mm is not on every build: the probe says so
        assert kernel == "int4mm", exc
        return
    assert y.shape == (2, 5, 96)
    assert torch.allclose(y, reference, atol=1e-4, rtol=1e-4)


def built_native_kernel() -> str:
    """How the native AWQ kernel was built; skips the test where it could not be (fails under
    KVSTREAM_REQUIRE_REAL)."""
    from kvstream.hf.awq import native

    module, why = native.load()
    if module is None:
        if REQUIRE_REAL:
            pytest.fail(f"the native AWQ kernel did not build: {why}")
        pytest.skip(f"the native AWQ kernel did not build here: {why}")
    return why


@pytest.mark.parametrize(("group_size", "out"), [(64, 320), (128, 328), (32, 72)])
def test_the_native_kernel_matches_the_reference_and_a_row_ignores_its_batch(group_size, out):
    """Decode rows (up to native.MAX_ROWS) through the compiled kernel, more through its dequantizer;
    a row's output is bit-identical alone and batched (its sums run in a fixed order), whichever
    register tile it lands in (rows go 4, 2, then 1 at a time). ``out`` 328 and 72: word counts
    (41, 9) that leave a tail after the kernel's 8-word units."""
    from kvstream.hf.awq import native

    why = built_native_kernel()
    generator = torch.Generator().manual_seed(5)
    packed = quantize_rtn(torch.randn(out, 256, generator=generator), group_size)
    layer = AWQLinear(packed)
    layer.kernel = "native"
    weight = dequantize(packed)
    x = torch.randn(native.MAX_ROWS + 3, 256, generator=generator)
    for rows in (1, 2, 3, 7, native.MAX_ROWS, native.MAX_ROWS + 1):
        y = layer(x[:rows])
        # float32 rounding of outputs up to ~75: the AVX-512 build sums x (1 + n/16), whose
        # rounding is ~3x that of sum x n (up to 3e-4 here, 1e-4 before); a layout error is O(1)
        assert torch.allclose(y, x[:rows] @ weight, atol=5e-4, rtol=1e-4), rows
    tensors = (layer.qweight, layer.qzeros, layer.scales, layer.packed_order)
    assert native.gemv(x[:0], *tensors, group_size).shape == (0, out)
    alone = [layer(x[i : i + 1]) for i in range(7)]
    for rows in (2, 3, 7, native.MAX_ROWS):
        batched = layer(x[:rows])
        for i in range(min(rows, 7)):
            assert torch.equal(batched[i : i + 1], alone[i]), (rows, i)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        native.gemv(x[:1, :128], *tensors, group_size)
    with pytest.raises(RuntimeError, match="float16"):
        native.gemv(x[:1], layer.qweight, layer.qzeros, layer.scales.float(), layer.packed_order, group_size)
    if why.startswith("AVX2 + FMA"):  # the vector path checks the column layout it relies on
        with pytest.raises(RuntimeError, match="permute"):
            native.gemv(x[:1], *tensors[:3], torch.arange(out).flip(0), group_size)


def test_one_kernel_call_for_several_projections_gives_each_its_own_bits():
    """``gemv_many`` (a layer's Q/K/V or gate/up in one call, the threads sharing out all their
    words): each output bit for bit what its projection alone gives, for widths that leave a
    tail after the 8-word units and at every register tile; inputs that cannot share a call
    are refused."""
    from kvstream.hf.awq import native

    built_native_kernel()
    generator = torch.Generator().manual_seed(11)
    layers = [AWQLinear(quantize_rtn(torch.randn(out, 256, generator=generator), 64)) for out in (320, 72, 8, 328)]
    tensors = [(m.qweight, m.qzeros, m.scales, m.packed_order) for m in layers]
    x = torch.randn(native.MAX_ROWS, 256, generator=generator)
    for rows in (0, 1, 2, 3, 5, native.MAX_ROWS):
        outputs = native.gemv_many(x[:rows], tensors, 64)
        assert [tuple(y.shape) for y in outputs] == [(rows, m.out_features) for m in layers]
        for y, parts in zip(outputs, tensors):
            assert torch.equal(y, native.gemv(x[:rows], *parts, 64)), rows
    narrower = AWQLinear(quantize_rtn(torch.randn(64, 128, generator=generator), 64))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        native.gemv_many(x[:1], [tensors[0], (narrower.qweight, narrower.qzeros, narrower.scales, narrower.packed_order)], 64)
    with pytest.raises(RuntimeError, match="one qweight"):
        native.gemv_many(x[:1], [], 64)


def test_fused_call_gives_each_module_its_forward_and_refuses_what_cannot_share_a_call():
    """``AWQLinear.fused_call``: decode-sized through one kernel call, past the kernel's rows
    through each module's own, biases added, bits equal to each module's ``forward``; None
    for modules of another kernel or group size (the direct decoder then calls them one by one)."""
    from kvstream.hf.awq import native

    built_native_kernel()
    generator = torch.Generator().manual_seed(12)
    packed = [quantize_rtn(torch.randn(out, 128, generator=generator), 64) for out in (96, 32, 32)]
    packed[1] = type(packed[1])(packed[1].qweight, packed[1].qzeros, packed[1].scales, 64, torch.randn(32, generator=generator))
    layers = [AWQLinear(p) for p in packed]
    for layer in layers:
        layer.kernel = "native"
    call = AWQLinear.fused_call(layers)
    x = torch.randn(native.MAX_ROWS + 2, 128, generator=generator)
    with torch.inference_mode():
        for rows in (1, 4, native.MAX_ROWS, native.MAX_ROWS + 2):
            for y, layer in zip(call(x[:rows]), layers):
                assert torch.equal(y, layer(x[:rows])), rows
    other_group = AWQLinear(quantize_rtn(torch.randn(32, 128, generator=generator), 32))
    other_group.kernel = "native"
    assert AWQLinear.fused_call([layers[0], other_group]) is None
    layers[2].kernel = "dequant"
    assert AWQLinear.fused_call(layers) is None


def test_the_native_dequantizer_gives_the_reference_weights_for_any_range_of_words():
    """What prefill chunks under the native kernel multiply: bit-identical to the reference
    dequantization, any range of words, written into a reused buffer; bad ranges are errors."""
    from kvstream.hf.awq import native

    built_native_kernel()
    generator = torch.Generator().manual_seed(6)
    layer = AWQLinear(quantize_rtn(torch.randn(328, 128, generator=generator), 64))
    reference = dequantize(layer.packed())  # [in, out]
    buffer = torch.full((128 * 328 + 5,), float("nan"))
    tensors = (layer.qweight, layer.qzeros, layer.scales, layer.packed_order, 64)
    for first, last in ((0, 41), (0, 1), (3, 17), (40, 41)):
        w = native.dequantize(*tensors, first, last, buffer)
        assert w.shape == (128, 8 * (last - first))
        assert torch.equal(w, reference[:, 8 * first : 8 * last])
    for first, last in ((0, 0), (5, 3), (0, 42)):
        with pytest.raises(RuntimeError, match="shape mismatch"):
            native.dequantize(*tensors, first, last, buffer)
    with pytest.raises(RuntimeError, match="buffer shape"):
        native.dequantize(*tensors, 0, 41, buffer[:100])
    with pytest.raises(RuntimeError, match="buffer must be contiguous"):
        native.dequantize(*tensors, 0, 41, torch.empty(2 * 128 * 328)[::2])
    with pytest.raises(RuntimeError, match="buffer float32"):
        native.dequantize(*tensors, 0, 41, buffer.double())
    with pytest.raises(RuntimeError, match="float16"):
        native.dequantize(*tensors[:2], layer.scales.float(), *tensors[3:], 0, 41, buffer)
    # Tensors the caller passes strided are read as they are meant (made contiguous first).
    strided = torch.stack([layer.qweight, layer.qweight], dim=-1)[..., 0]
    assert not strided.is_contiguous()
    assert torch.equal(native.dequantize(strided, *tensors[1:], 0, 41, buffer), reference)
    x = torch.randn(native.MAX_ROWS + 5, 128, generator=generator)  # past the gemv: dequantizer + BLAS
    layer.kernel = "native"
    assert torch.allclose(layer(x), x @ reference, atol=1e-4, rtol=1e-4)


def test_without_a_compiler_the_probe_keeps_the_torch_kernels_and_says_why(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp_extension

    from kvstream.hf.awq import native

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    native.load.cache_clear()
    awq_linear.probe_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="kvstream.hf.native_build"):
            assert native.load() == (None, "RuntimeError: Ninja is required to load C++ extensions")
            choice = awq_linear.probe_kernel(128, 64, 64, torch.float32)
        assert choice.name in ("dequant", "int4mm")
        assert [r.getMessage() for r in caplog.records] == [
            "awq_gemv.cpp not built (RuntimeError: Ninja is required to load C++ extensions); using the pure-torch path"]
    finally:
        native.load.cache_clear()
        awq_linear.probe_kernel.cache_clear()


def test_ninja_from_the_pip_package_is_found_without_an_activated_venv(monkeypatch, tmp_path):
    import shutil

    ninja = pytest.importorskip("ninja")  # the hf and test extras install it
    from kvstream.hf import native_build

    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH, as when .venv/bin/kvstream runs unactivated
    assert shutil.which("ninja") is None
    assert native_build.put_ninja_on_path()
    assert shutil.which("ninja") == str(Path(ninja.BIN_DIR) / "ninja")
    # A system's ninja on PATH (another version): the package's still goes first, once, so
    # that every start builds with the same ninja (two versions rebuilt each other's builds).
    system = tmp_path / "ninja"
    system.write_text("#!/bin/sh\necho 1.11.1\n")
    system.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("ninja") == str(system)
    assert native_build.put_ninja_on_path() and native_build.put_ninja_on_path()
    assert shutil.which("ninja") == str(Path(ninja.BIN_DIR) / "ninja")
    assert os.environ["PATH"] == os.pathsep.join([ninja.BIN_DIR, str(tmp_path)])


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_live_build_waited_for(tmp_path, monkeypatch, caplog):
    """torch's builder waits, without a timeout, while its ``lock`` file exists: one left by a
    build killed midway would hang every later start. KVStream builds under an flock (which
    dies with its process) and clears such a leftover; a live build is waited for, saying so."""
    import fcntl
    import threading

    import torch.utils.cpp_extension as cpp_extension

    from kvstream.hf import native_build
    from kvstream.hf.awq import native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    avx512 = native.AVX512_FLAGS if torch.backends.cpu.get_cpu_capability() == "AVX512" else ()
    folder = native_build.build_folder("kvstream_awq_gemv", native.SOURCE, extra_flags=avx512)
    assert folder.is_relative_to(tmp_path)
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # what a killed build leaves
    calls = []

    def builder(name, sources, build_directory, **kwargs):
        calls.append((build_directory, (Path(build_directory) / "lock").exists()))
        raise RuntimeError("stop here")

    monkeypatch.setattr(cpp_extension, "load", builder)
    holder = open(folder / "kvstream.flock", "a")  # another process building now
    fcntl.flock(holder, fcntl.LOCK_EX)
    native.load.cache_clear()
    result = []
    try:
        with caplog.at_level("INFO", logger="kvstream.hf.native_build"):
            waiting = threading.Thread(target=lambda: result.append(native.load()))
            waiting.start()
            waiting.join(0.5)
            assert waiting.is_alive() and calls == []  # waits for the live build
            fcntl.flock(holder, fcntl.LOCK_UN)
            waiting.join(10)
    finally:
        holder.close()
        native.load.cache_clear()
    assert result == [(None, "RuntimeError: stop here")]
    assert calls == [(str(folder), False)]  # the leftover was gone before torch's builder ran
    assert "left by a build that did not finish" in caplog.text
    assert "waiting for another process building in" in caplog.text  # the wait is said, not silent


def test_a_kernel_build_is_keyed_by_its_source_text_not_where_it_lies(tmp_path, monkeypatch, caplog):
    """The same source in two checkouts shares one build (torch's ninja file names the path it
    compiled, so each checkout used to rebuild the other's), a changed source, flag or torch
    installation gets a folder of its own, and the builder compiles the copy inside that folder."""
    import torch.utils.cpp_extension as cpp_extension

    from kvstream.hf import native_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    first, second = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"
    for path in (first, second):
        path.parent.mkdir()
        path.write_text("// kernel\n")
    folder = native_build.build_folder("kvstream_k", first)
    assert folder == native_build.build_folder("kvstream_k", second)
    assert folder != native_build.build_folder("kvstream_k", first, extra_flags=("-DX",))
    assert folder != native_build.build_folder("kvstream_k", first, vector=False)
    second.write_text("// kernel, changed\n")
    assert folder != native_build.build_folder("kvstream_k", second)
    # Another virtual environment's torch (its headers' folder in the ninja file): its own folder.
    with monkeypatch.context() as patch:
        patch.setattr(native_build.torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
        assert folder != native_build.build_folder("kvstream_k", first)
    assert folder == native_build.build_folder("kvstream_k", first)
    built = []

    def builder(name, sources, build_directory, **kwargs):
        built.append((name, sources, build_directory))
        (Path(build_directory) / f"{name}.so").touch()  # what a finished build leaves
        return SimpleNamespace()

    monkeypatch.setattr(cpp_extension, "load", builder)
    third = tmp_path / "c" / "k.cpp"
    third.parent.mkdir()
    shutil.copyfile(first, third)
    with caplog.at_level("INFO", logger="kvstream.hf.native_build"):
        for path in (first, third, second):
            assert native_build.load_extension("kvstream_k", path)[0] is not None
    source = folder / "k.cpp"
    assert built[0][1:] == built[1][1:] == ([str(source)], str(folder)) and source.read_text() == "// kernel\n"
    assert built[2][2] != str(folder)  # the changed text builds apart
    # "building" is said where a build is to come: the first time, and for the changed text.
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["building k.cpp"] * 2


def test_the_kernel_probe_picks_a_correct_kernel_and_says_why():
    choice = awq_linear.probe_kernel(128, 64, 64, torch.float32)
    assert choice.name in ("dequant", "int4mm", "native") and choice.why
    assert awq_linear.probe_kernel(128, 64, 64, torch.float32) is choice  # not re-timed per load


def test_clipping_search_clips_heavy_tailed_groups_and_never_loses_on_its_calibration_rows():
    """A heavy-tailed group spends its 16 levels on its few large values; the search clips
    groups where that cuts the error of the group's share of the outputs, and no group's
    share is worse than unclipped on the calibration rows (1.0 is a candidate ratio)."""
    from kvstream.hf.awq.format import dequantize, quantize_rtn
    from kvstream.hf.awq.quantize import search_clip

    torch.manual_seed(0)
    weight = torch.distributions.StudentT(2.0).sample((16, 128)) * 0.02  # heavy tails, as trained weights have
    x = torch.randn(256, 128)

    def share_errors(w: torch.Tensor) -> torch.Tensor:  # [rows, groups]
        delta = dequantize(quantize_rtn(w, 64)).T - weight  # the quantized (clipped) error
        return torch.einsum("tng,ong->ton", x.view(-1, 2, 64), delta.view(16, 2, 64)).pow(2).mean(0)

    clipped = search_clip(x, weight, 64)
    changed = (clipped != weight).view(16, 2, 64).any(-1)  # [rows, groups] clipped
    assert changed.sum() >= 8, "the search clipped (almost) nothing"
    after, before = share_errors(clipped), share_errors(weight)
    assert (after <= before * (1 + 1e-5)).all()
    assert (after[changed] < before[changed]).all()


# ------------------------------------------------------------------ checkpoints of SmolLM2
@pytest.fixture(scope="session")
def rtn_folder(tmp_path_factory):
    """SmolLM2 as a round-to-nearest AWQ checkpoint (made in under a second)."""
    from kvstream.hf.awq.quantize import choose_group_size, quantize_model, save_checkpoint
    from kvstream.hf.loader import load_model

    loaded = load_model(None, device="cpu")
    size = choose_group_size(loaded.model, None)
    state = quantize_model(loaded.model, loaded.tokenizer, size, "", activation_aware=False)
    out = tmp_path_factory.mktemp("awq") / "smollm2-rtn"
    save_checkpoint(out, loaded.model, loaded.tokenizer, state, size, None)
    return out


def test_the_checkpoint_is_autoawq_shaped(rtn_folder):
    config = json.loads((rtn_folder / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                             "version": "gemm", "modules_to_not_convert": None}
    index = SafetensorsIndex(rtn_folder)
    name = "model.layers.0.mlp.down_proj"
    assert index.refs[f"{name}.qweight"].shape == (1536, 576 // 8) and index.refs[f"{name}.qweight"].dtype == torch.int32
    assert index.refs[f"{name}.qzeros"].shape == (1536 // 64, 576 // 8)
    assert index.refs[f"{name}.scales"].shape == (1536 // 64, 576) and index.refs[f"{name}.scales"].dtype == torch.float16
    assert f"{name}.weight" not in index and "lm_head.weight" not in index  # tied to the embeddings
    # every other tensor in float16, as AutoAWQ writes them
    assert index.refs["model.embed_tokens.weight"].dtype == torch.float16 and index.refs["model.norm.weight"].dtype == torch.float16


def test_the_checkpoint_s_packed_tensors_map_32_byte_aligned(rtn_folder):
    """The header is padded so that the data starts 64-byte aligned: every mapped packed
    tensor starts on a 32-byte boundary (the kernel's loads then never straddle two cache
    lines), and safetensors' own reader still reads the file, tensor for tensor."""
    import struct

    from safetensors import safe_open

    path = rtn_folder / "model.safetensors"
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
    assert (8 + size) % 64 == 0
    index = SafetensorsIndex(rtn_folder)
    packed = [name for name in index.refs if name.rsplit(".", 1)[1] in ("qweight", "qzeros", "scales")]
    assert packed and all(index.mapped(name).data_ptr() % 32 == 0 for name in packed)
    with safe_open(path, "pt") as f:
        for name in ("model.layers.3.mlp.up_proj.qweight", "model.layers.3.mlp.up_proj.scales", "model.norm.weight"):
            assert torch.equal(f.get_tensor(name), index.load(name))


def test_kvstream_awq_align_realigns_a_checkpoint_written_elsewhere(rtn_folder, tmp_path):
    """A checkpoint as ``save_file`` may write it (the header padded to a multiple of 8 bytes
    only: here the packed tensors 16 bytes off a 32-byte boundary, as the 96-layer one of
    benchmarks/awq_alignment.py had them) comes out of ``kvstream awq align`` with every packed tensor
    aligned and every tensor's bytes unchanged; a second run changes nothing; a file that is
    not safetensors is one line and exit 2."""
    import struct

    folder = tmp_path / "elsewhere"
    shutil.copytree(rtn_folder, folder)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + size].rstrip(b" ")
    header += b" " * ((16 - (8 + len(header))) % 32)
    path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + size :])
    before = SafetensorsIndex(folder)
    packed = [n for n in before.refs if n.rsplit(".", 1)[1] in ("qweight", "qzeros", "scales")]
    assert any(before.refs[n].start % 32 for n in packed)
    expected = {n: before.load(n).clone() for n in before.refs}  # read before the file is replaced

    def align(target):
        return subprocess.run([sys.executable, "-m", "kvstream.cli.main", "awq", "align", str(target)],
                              capture_output=True, text=True, timeout=120)

    out = align(folder)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"1 of 1 safetensors files realigned; {len(packed)} of {len(packed)} packed tensors start 32-byte aligned" in out.stdout
    after = SafetensorsIndex(folder)
    assert all(torch.equal(after.load(n), tensor) for n, tensor in expected.items())
    assert "0 of 1 safetensors files realigned" in align(folder).stdout
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"not a safetensors file at all")
    bad = align(tmp_path / "junk")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "not a readable safetensors checkpoint" in bad.stderr


@pytest.fixture(scope="module")
def resident(rtn_folder):
    model, report = load_awq_model(rtn_folder, torch.float32)
    ids = torch.randint(0, 40000, (2, 37), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # 74 rows (the dequant kernel) and 4 rows (the native one, where it built: decode-sized)
        logits = (model(ids, use_cache=False).logits, model(ids[:1, :4], use_cache=False).logits)
    return ids, logits, report


@pytest.mark.parametrize(
    "config",
    [StreamingConfig("partial_resident", 2, 2, 2, staging="copy"), StreamingConfig("partial_resident", 0, 0, 1, staging="copy"),
     StreamingConfig("ffn_only_stream", 2, 2, 2, staging="copy"), StreamingConfig("full_stream", 0, 0, 3, staging="copy"),
     StreamingConfig("partial_resident", 2, 2, 2, drop_page_cache=True, staging="copy"),
     StreamingConfig("partial_resident", 2, 2, 2, staging="mapped"), StreamingConfig("full_stream", 0, 0, 1, staging="mapped"),
     StreamingConfig("ffn_only_stream", 1, 1, 3, drop_page_cache=True, staging="mapped"),
     StreamingConfig("partial_resident", 2, 2, 2, drop_page_cache=True, staging="mapped", stream_embeddings=True)],
    ids=["partial-k2", "partial-k0-one-slot", "ffn-only", "full-stream-3-slots", "pages-dropped", "mapped",
         "mapped-no-prefetch", "mapped-pages-dropped", "mapped-head-dropped-too"],
)
def test_streamed_and_resident_give_identical_logits(rtn_folder, resident, config):
    ids, expected, full = resident
    model, report = load_awq_model(rtn_folder, torch.float32, config)
    try:
        assert report.kernel == full.kernel  # probed once per process: a timing, not redrawn per load
        with torch.no_grad():
            for _ in range(2):  # the second forward runs on what the first prefetched
                assert torch.equal(model(ids, use_cache=False).logits, expected[0])
                assert torch.equal(model(ids[:1, :4], use_cache=False).logits, expected[1])
        assert report.streamer.staged_bytes >= 2 * report.streamed_bytes > 0
    finally:
        report.streamer.close()


def test_embeddings_of_a_streamed_model_equal_the_resident_model_s(rtn_folder):
    """An embedding's chunked decoder forward (a DynamicCache, no engine step) goes through
    the streamed layers' hooks like any forward: the same vector as the resident model's."""
    from kvstream.hf.embeddings import Embedding, EmbeddingBatch

    ids = list(range(1000, 1300))  # two chunks of 256

    def vector(model):
        embedding, result = Embedding(model, ids), None
        while result is None:
            result = embedding.step()
        return result + EmbeddingBatch(model, [ids[:40], ids[:7], ids[50:100]]).step()  # and a padded batch

    resident_model, _ = load_awq_model(rtn_folder, torch.float32)
    model, report = load_awq_model(rtn_folder, torch.float32, StreamingConfig("partial_resident", 1, 1, 2, staging="copy"))
    try:
        assert vector(model) == vector(resident_model)
        assert report.streamer.staged_bytes > 0
    finally:
        report.streamer.close()


@pytest.mark.parametrize("kernel", ["dequant", "int4mm", "native"])
def test_every_kernel_streams_with_the_resident_run_s_logits(rtn_folder, monkeypatch, kernel):
    """Whichever kernel the probe picks on a machine, copied and mapped streaming give its
    resident run's logits: nothing a kernel derives from a layer's packed tensors (int4mm's
    repacked weights, dequant's zeros x scales) outlives the tensors it came from (copied
    staging reuses one slot's tensors for every other layer)."""
    from kvstream.hf.awq import model as awq_model

    if kernel == "native":
        built_native_kernel()
    monkeypatch.setattr(awq_model, "probe_kernel", lambda *args, **kwargs: awq_linear.KernelChoice(kernel, "test"))
    ids = torch.randint(0, 40000, (1, 6), generator=torch.Generator().manual_seed(11))

    def logits(config):
        model, report = load_awq_model(rtn_folder, torch.float32, config)
        try:
            assert report.kernel.name == kernel
            with torch.no_grad():  # twice: the second forward runs on what the first staged
                out = [(model(ids, use_cache=False).logits, model(ids[:, :2], use_cache=False).logits) for _ in range(2)]
            if report.streamer is not None:  # and nothing derived from a streamed layer kept resident
                assert not any(hasattr(m, "_int4") for modules in report.streamer.plan.values() for _, m in modules)
            return out
        finally:
            if report.streamer is not None:
                report.streamer.close()

    expected = logits(None)[0]
    for staging in ("copy", "mapped"):
        for got in logits(StreamingConfig("partial_resident", 1, 1, 2, staging=staging)):
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), staging


def test_mapped_staging_faults_a_layer_in_with_the_fewest_page_ranges():
    from kvstream.hf.awq.streaming import PAGE, merged_page_ranges

    buffer = torch.zeros(64 * PAGE // 4, dtype=torch.int32)
    base = buffer.data_ptr() // PAGE * PAGE
    words = PAGE // 4
    offset = (buffer.data_ptr() - base) // 4
    first = buffer[words - offset : 3 * words - offset]  # pages 1-2 of the allocation's pages
    second = buffer[3 * words - offset + 5 : 4 * words - offset]  # inside page 3: touches, merged
    apart = buffer[10 * words - offset + 7 : 12 * words - offset + 1]  # pages 10-12, unaligned ends
    empty = buffer[:0]
    assert merged_page_ranges([apart, second, empty, first]) == [
        (base + PAGE, base + 4 * PAGE), (base + 10 * PAGE, base + 13 * PAGE)]


def test_populating_pages_falls_back_to_read_ahead_on_an_older_kernel(monkeypatch):
    from types import SimpleNamespace

    from kvstream.hf.awq import streaming

    calls = []

    def madvise(address, length, advice):
        calls.append((address.value, length.value, advice))
        return -1 if advice == streaming.MADV_POPULATE_READ else 0  # EINVAL before Linux 5.14

    monkeypatch.setattr(streaming, "_libc", SimpleNamespace(madvise=madvise))
    streaming.populate_pages(streaming.PAGE, 3 * streaming.PAGE)
    assert calls == [(streaming.PAGE, 2 * streaming.PAGE, streaming.MADV_POPULATE_READ),
                     (streaming.PAGE, 2 * streaming.PAGE, streaming.MADV_WILLNEED)]


def test_pages_cached_tells_resident_pages_from_absent_ones():
    """mincore on an anonymous mapping: untouched pages are not resident, touched ones are."""
    import ctypes
    import mmap

    from kvstream.hf.awq.streaming import PAGE, pages_cached

    region = mmap.mmap(-1, 8 * PAGE)
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(region))
        assert not pages_cached(start, start + 8 * PAGE)
        for page in range(4):
            region[page * PAGE] = 1
        assert pages_cached(start, start + 4 * PAGE)
        assert not pages_cached(start, start + 5 * PAGE)  # one page short is not all there
        vector = ctypes.create_string_buffer(5)  # reused, as the engine thread does: no stale answer
        assert not pages_cached(start, start + 5 * PAGE, vector)
        region[4 * PAGE] = 1
        assert pages_cached(start, start + 5 * PAGE, vector)
    finally:
        region.close()


@pytest.mark.parametrize("drop", [False, True], ids=["warm", "pages-dropped"])
def test_mapped_staging_faults_pages_in_only_where_they_left_the_page_cache(rtn_folder, monkeypatch, drop):
    """Warm, the first forward faults the streamed layers in and later ones find them cached
    (populating cached pages cost a warm 96-layer forward 13-16 ms); with their pages dropped after
    each layer, later forwards fault them in again."""
    import gc

    from kvstream.hf.awq import streaming

    gc.collect()  # earlier tests' streamed models: their live mappings would keep dropped pages cached
    calls = []
    populate = streaming.populate_pages
    monkeypatch.setattr(streaming, "populate_pages", lambda start, end: (calls.append(start), populate(start, end)))
    model, report = load_awq_model(rtn_folder, torch.float32, StreamingConfig("partial_resident", 2, 2, 2, drop, "mapped", stream_embeddings=False))
    ids = torch.randint(0, 40000, (1, 4), generator=torch.Generator().manual_seed(5))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
            report.streamer.drain()
            first = len(calls)
            for _ in range(2):
                model(ids, use_cache=False)
            report.streamer.drain()
        if drop:  # dropped after computing, so faulted in again (where the kernel's read-ahead
            # for other layers, stored beside them in the file, has not brought them back)
            assert len(calls) > first
        else:
            assert len(calls) == first  # nothing populated again: every page was still cached
    finally:
        report.streamer.close()


def test_warm_mapped_forwards_check_the_page_cache_every_few_and_find_an_evicted_layer(rtn_folder, monkeypatch):
    """Warm, one forward in ``CHECK_EVERY`` checks its upcoming layers' pages (the check was
    most of the hooks' cost); a layer evicted before a checking forward is found and faulted
    in ahead again, and the forward after that checks every layer too."""
    import gc
    import os

    from kvstream.hf.awq import streaming
    from kvstream.hf.awq.streaming import CHECK_EVERY, unmap_pages

    gc.collect()  # earlier tests' streamed models: their live mappings would keep evicted pages cached
    checks, populated = [], []
    cached, populate = streaming.pages_cached, streaming.populate_pages
    monkeypatch.setattr(streaming, "pages_cached", lambda start, end, vector=None: checks.append(start) or cached(start, end, vector))
    monkeypatch.setattr(streaming, "populate_pages", lambda start, end: (populated.append(start), populate(start, end)))
    model, report = load_awq_model(rtn_folder, torch.float32, StreamingConfig("partial_resident", 2, 2, 2, staging="mapped",
                                                                               stream_embeddings=False))
    streamer = report.streamer
    ranges = sum(len(r) for r in streamer.page_ranges.values())  # one check each, per checking forward
    ids = torch.randint(0, 40000, (1, 4), generator=torch.Generator().manual_seed(5))

    def forwards(count: int) -> None:  # (a layer's hook waits for its own faulting in: no drain needed)
        with torch.no_grad():
            for _ in range(count):
                model(ids, use_cache=False)

    try:
        forwards(CHECK_EVERY)  # forwards 1..N: the first checks (and faults in)
        checks.clear()
        populated.clear()
        forwards(2 * CHECK_EVERY)  # N+1 .. 3N: two of them check, and find every page there
        assert len(checks) == 2 * ranges and not populated
        layer = streamer.order[len(streamer.order) // 2]
        for _, packed in streamer.sources[layer]:
            for tensor in (packed.qweight, packed.qzeros, packed.scales):
                unmap_pages(tensor)
        fd = os.open(rtn_folder / "model.safetensors", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # pages no process maps leave the page cache
        finally:
            os.close(fd)
        checks.clear()
        forwards(1)  # 3N + 1: a checking forward
        # Evicted pages found gone and faulted in ahead (not necessarily the chosen layer's:
        # the kernel's read-ahead can bring those back before their check); the stager
        # checks a layer again before faulting it in.
        assert len(checks) >= ranges and populated
        checks.clear()
        forwards(1)  # found pages gone: this one checks too
        assert len(checks) == ranges
        checks.clear()
        forwards(1)  # found none: back to one forward in N
        assert len(checks) == 0
    finally:
        streamer.close()


@pytest.mark.parametrize("staging", ["mapped", "copy"])
def test_a_mapped_head_is_faulted_in_ahead_where_gone_and_dropped_with_the_layers(rtn_folder, monkeypatch, staging):
    """``stream_embeddings``: the head's table, read whole after the layers every forward, is
    checked as the first streamed layer starts and faulted in on a thread of its own where it
    has left the page cache; with ``drop_page_cache`` it is dropped just before (so every
    forward after the first reads it again), without it left cached."""
    import gc
    import os

    from kvstream.hf.awq import streaming
    from kvstream.hf.awq.streaming import unmap_pages

    gc.collect()  # earlier tests' streamed models: their live mappings would keep dropped pages cached
    populated: list[int] = []
    populate = streaming.populate_pages
    monkeypatch.setattr(streaming, "populate_pages", lambda start, end: (populated.append(start), populate(start, end)))
    ids = torch.randint(0, 40000, (1, 4), generator=torch.Generator().manual_seed(8))
    for drop in (True, False):
        config = StreamingConfig("partial_resident", 2, 2, 2, drop_page_cache=drop, staging=staging, stream_embeddings=True)
        model, report = load_awq_model(rtn_folder, torch.float32, config)
        streamer = report.streamer
        if not report.mapped_bytes_per_forward:
            streamer.close()
            pytest.skip(f"the head's table is held in memory here: {report.embeddings}")
        try:
            [(head_start, head_end)] = streamer.tail_ranges
            assert head_end - head_start >= report.mapped_bytes_per_forward and streamer.tail == [model.lm_head.weight]
            assert (streamer.tail_file_ranges is not None) == drop
            head_faults = []
            for _ in range(3):
                populated.clear()
                with torch.no_grad():
                    model(ids, use_cache=False)
                streamer.drain()
                head_faults.append(head_start in populated)
            if drop:
                # Dropped as each later forward began, faulted in ahead each time (the first
                # found it where writing the checkpoint left it: in the page cache).
                assert head_faults[1:] == [True, True]
            else:
                assert head_faults[1:] == [False, False]  # still cached: nothing to fault in
                unmap_pages(model.lm_head.weight)
                fd = os.open(rtn_folder / "model.safetensors", os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                populated.clear()
                with torch.no_grad():
                    model(ids, use_cache=False)
                streamer.drain()
                # Evicted: found gone and faulted in ahead (unless the kernel's read-ahead for
                # the layers stored beside it brought it back first: then the check finds it).
                assert head_start in populated or streaming.pages_cached(head_start, head_end)
        finally:
            streamer.close()


def held_bytes(name: str, ref) -> int:
    """What a float32 engine holds for a checkpoint tensor: the packed tensors and the
    embeddings as stored, every other float16 tensor (norms) upcast."""
    as_stored = name == "model.embed_tokens.weight" or name.rsplit(".", 1)[1] in ("qweight", "qzeros", "scales")
    return ref.nbytes * (1 if as_stored or ref.dtype != torch.float16 else 2)


def test_resident_bytes_are_exactly_the_resident_parts(rtn_folder, resident):
    _, _, full = resident
    index = SafetensorsIndex(rtn_folder)
    everything = sum(held_bytes(name, ref) for name, ref in index.refs.items())
    assert full.resident_bytes == everything  # every tensor once (the tied head is the embeddings)
    model, report = load_awq_model(rtn_folder, torch.float32,
                                   StreamingConfig("partial_resident", 2, 2, 2, staging="copy", stream_embeddings=False))
    try:
        layers = len(decoder_layers(model))
        streamed = sum(
            ref.nbytes for name, ref in index.refs.items()
            if name.startswith("model.layers.") and 2 <= int(name.split(".")[2]) < layers - 2
            and name.rsplit(".", 1)[1] in ("qweight", "qzeros", "scales")
        )
        assert report.streamed_bytes == streamed
        assert report.resident_bytes == everything - streamed  # embeddings, norms, first/last 2 layers
        assert report.mapped_bytes == report.mapped_bytes_per_forward == 0  # tied: the head reads all of it, resident
        snapshot = report.snapshot()
        assert snapshot["staging_bytes"] == 2 * streamed // (layers - 4)  # two slots of one layer
        assert snapshot["staging"] == "copy" and snapshot["staging_slots"] == 2
    finally:
        report.streamer.close()
    model, report = load_awq_model(rtn_folder, torch.float32,
                                   StreamingConfig("partial_resident", 2, 2, 2, staging="mapped", stream_embeddings=False))
    try:
        snapshot = report.snapshot()
        assert report.resident_bytes == everything - streamed and report.streamed_bytes == streamed
        assert snapshot["staging"] == "mapped" and snapshot["staging_bytes"] == 0  # no slots: computed from the mapping
    finally:
        report.streamer.close()


PEAK_SCRIPT = """
import sys, threading, time, torch
from kvstream.hf.awq.model import load_awq_model
from kvstream.hf.awq.streaming import StreamingConfig
def anon():
    for line in open('/proc/self/status'):
        if line.startswith('RssAnon:'):
            return int(line.split()[1]) * 1024
peak = [0]
def watch():
    while True:
        peak[0] = max(peak[0], anon()); time.sleep(0.005)
threading.Thread(target=watch, daemon=True).start()
how = sys.argv[2]
streaming = (StreamingConfig('partial_resident', 2, 2, 2, staging=how.removesuffix('+tables'), stream_embeddings=how.endswith('+tables'))
             if how != 'resident' else None)
model, report = load_awq_model(sys.argv[1], torch.float32, streaming)
with torch.no_grad():
    for _ in range(3):
        model(torch.randint(0, 40000, (1, 64)), use_cache=False)
time.sleep(0.05)
print(peak[0], report.resident_bytes)
"""


def test_peak_anonymous_memory_of_a_streamed_run_is_below_the_resident_run(rtn_folder):
    """Measured in fresh processes (RssAnon: what the process holds itself; the mapped
    checkpoint's pages are the kernel's page cache, dropped under pressure). glibc is told
    to return freed heap at once, so that what it keeps for reuse does not blur a ~46 MB
    difference (benchmarks/awq_streaming.py reports the default allocator's numbers)."""
    import os

    env = os.environ | {"MALLOC_TRIM_THRESHOLD_": "0"}
    peaks = {}
    for how in ("resident", "copy", "mapped", "mapped+tables"):
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(rtn_folder), how], capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        peaks[how] = [int(v) for v in out.stdout.split()]
    for staging in ("copy", "mapped"):
        saved = peaks["resident"][1] - peaks[staging][1]
        assert saved > 40 * 2**20
        assert peaks[staging][0] < peaks["resident"][0] - saved // 2, peaks
    # --stream-embeddings: the 54 MiB tied table leaves the process's own memory too
    tables = peaks["mapped"][1] - peaks["mapped+tables"][1]
    assert tables > 50 * 2**20 and peaks["mapped+tables"][0] < peaks["mapped"][0] - tables // 2, peaks


# ------------------------------------------------------------------ embeddings kept as stored
def upcast_copy(model):
    """The same model with its embeddings and tied head upcast to float32 nn modules."""
    import copy

    from torch import nn

    reference = copy.copy(model)  # only the two modules are swapped: share everything else
    reference.model = copy.copy(model.model)
    reference.model._modules = dict(model.model._modules)
    table = nn.Parameter(model.model.embed_tokens.weight.float(), requires_grad=False)
    reference.model._modules["embed_tokens"] = nn.Embedding(*table.shape, _weight=table)
    reference._modules = dict(model._modules) | {"model": reference.model, "lm_head": nn.Linear(table.shape[1], table.shape[0], bias=False)}
    reference.lm_head.weight = table
    return reference


def test_the_embeddings_and_tied_head_stay_float16_and_give_the_upcast_model_s_logits(rtn_folder, resident):
    from kvstream.hf.half_weights import HalfEmbedding, HalfLinear

    if resident[2].embeddings.startswith("float32"):
        pytest.skip(f"embeddings upcast here: {resident[2].embeddings}")
    model, report = load_awq_model(rtn_folder, torch.float32)
    embed, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embed, HalfEmbedding) and isinstance(head, HalfLinear)
    assert embed.weight.dtype == torch.float16 and head.weight is embed.weight  # tied: one table
    assert next(model.parameters()).dtype == torch.float32  # the engine's kv dtype and transformers' model.dtype
    assert report.snapshot()["embeddings"] == "float16 as stored, LM head tied to them"
    reference = upcast_copy(model)
    ids = torch.randint(0, 40000, (2, 37), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for batch in (ids, ids[:1, :4], ids[:, :1]):  # 74 rows (blocks upcast), 4 and 2 (the kernel)
            got, want = model(batch, use_cache=False).logits, reference(batch, use_cache=False).logits
            assert got.dtype == torch.float32
            assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def untied_float16_head(folder):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].flip(0).contiguous()
    save_file(state, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))


def float32_embeddings(folder):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].float()
    save_file(state, folder / "model.safetensors")


def test_an_untied_float16_head_stays_float16_and_float32_embeddings_are_upcast(rtn_folder, tmp_path, resident):
    from torch import nn

    from kvstream.hf.half_weights import HalfLinear

    if resident[2].embeddings.startswith("float32"):
        pytest.skip(f"embeddings upcast here: {resident[2].embeddings}")
    ids = torch.randint(0, 40000, (1, 6), generator=torch.Generator().manual_seed(6))
    model, report = load_awq_model(broken_copy(rtn_folder, tmp_path / "untied", untied_float16_head), torch.float32)
    assert report.embeddings == "float16 as stored, LM head too"
    assert isinstance(model.lm_head, HalfLinear) and model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight.flip(0))
    model, report = load_awq_model(broken_copy(rtn_folder, tmp_path / "fp32", float32_embeddings), torch.float32)
    assert report.embeddings == "float32 (upcast at load: stored as float32)"
    assert type(model.model.embed_tokens) is nn.Embedding and model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert model(ids, use_cache=False).logits.dtype == torch.float32


def test_a_streamed_untied_model_leaves_its_input_table_mapped_with_the_resident_run_s_logits(rtn_folder, tmp_path, resident):
    """An input table the head does not share is read a few rows a token: with layers
    streamed it stays a view of the checkpoint's pages, neither resident nor staged."""
    from kvstream.hf.half_weights import HalfEmbedding, HalfLinear

    if resident[2].embeddings.startswith("float32"):
        pytest.skip(f"embeddings upcast here: {resident[2].embeddings}")
    folder = broken_copy(rtn_folder, tmp_path, untied_float16_head)
    table = SafetensorsIndex(folder).refs["model.embed_tokens.weight"]
    ids = torch.randint(0, 40000, (2, 9), generator=torch.Generator().manual_seed(8))
    model, full = load_awq_model(folder, torch.float32)
    assert full.mapped_bytes == 0  # resident run: the table is in memory
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    for staging in ("copy", "mapped"):
        model, report = load_awq_model(folder, torch.float32,
                                       StreamingConfig("partial_resident", 2, 2, 2, staging=staging, stream_embeddings=False))
        try:
            embed = model.model.embed_tokens
            assert isinstance(embed, HalfEmbedding) and embed.weight.dtype == torch.float16
            assert embed.weight.untyped_storage().nbytes() == (folder / "model.safetensors").stat().st_size  # the file's mapping
            assert isinstance(model.lm_head, HalfLinear) and model.lm_head.weight.untyped_storage().nbytes() < table.nbytes + 1
            assert report.embeddings == "float16 mapped from the checkpoint (a lookup reads its tokens' rows), LM head float16 as stored"
            assert report.mapped_bytes == report.snapshot()["mapped_bytes"] == table.nbytes
            assert report.resident_bytes == full.resident_bytes - table.nbytes - report.streamed_bytes
            with torch.no_grad():
                assert torch.equal(model(ids, use_cache=False).logits, want)
        finally:
            report.streamer.close()


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_stream_embeddings_leaves_the_tables_mapped_with_the_resident_run_s_logits(rtn_folder, tmp_path, resident, untied):
    """``stream_embeddings``: the head's table too is left in the mapped checkpoint and read
    whole every forward (``mapped_bytes_per_forward``), the input table read by rows."""
    from kvstream.hf.half_weights import HalfEmbedding, HalfLinear

    if resident[2].embeddings.startswith("float32"):
        pytest.skip(f"embeddings upcast here: {resident[2].embeddings}")
    folder = broken_copy(rtn_folder, tmp_path, untied_float16_head) if untied else rtn_folder
    refs = SafetensorsIndex(folder).refs
    table = refs["model.embed_tokens.weight"].nbytes
    head = refs["lm_head.weight"].nbytes if untied else table
    ids = torch.randint(0, 40000, (2, 9), generator=torch.Generator().manual_seed(9))
    model, full = load_awq_model(folder, torch.float32)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    file_size = (folder / "model.safetensors").stat().st_size
    for staging in ("copy", "mapped"):
        config = StreamingConfig("partial_resident", 2, 2, 2, staging=staging, stream_embeddings=True)
        model, report = load_awq_model(folder, torch.float32, config)
        try:
            embed, lm_head = model.model.embed_tokens, model.lm_head
            assert isinstance(embed, HalfEmbedding) and isinstance(lm_head, HalfLinear)
            assert embed.weight.untyped_storage().nbytes() == lm_head.weight.untyped_storage().nbytes() == file_size
            assert (lm_head.weight is embed.weight) != untied
            tail = "LM head float16 mapped from the checkpoint (read whole every token)" if untied else \
                "LM head tied to them (read whole from the mapping every token)"
            assert report.embeddings == f"float16 mapped from the checkpoint (a lookup reads its tokens' rows), {tail}"
            assert report.mapped_bytes == table + (head if untied else 0) and report.mapped_bytes_per_forward == head
            assert report.resident_bytes == full.resident_bytes - report.mapped_bytes - report.streamed_bytes
            snapshot = report.snapshot()
            assert snapshot["mapped_bytes"] == report.mapped_bytes and snapshot["mapped_bytes_per_forward"] == head
            with torch.no_grad():
                assert torch.equal(model(ids, use_cache=False).logits, want)
        finally:
            report.streamer.close()


def test_streaming_leaves_the_tables_mapped_by_default_where_the_head_keeps_them_as_stored(rtn_folder, resident):
    """``stream_embeddings`` unset: on the CPU the default is ``True``'s load (what streaming
    is asked for is the memory; a resident head reads the same bytes every token); on a GPU,
    whose path holds its tables there, it resolves to off instead of the explicit flag's error."""
    if resident[2].embeddings.startswith("float32"):
        pytest.skip(f"embeddings upcast here: {resident[2].embeddings}")
    table = SafetensorsIndex(rtn_folder).refs["model.embed_tokens.weight"].nbytes
    reports = {}
    for flag in (None, True, False):
        model, report = load_awq_model(rtn_folder, torch.float32, StreamingConfig("partial_resident", 2, 2, 2, stream_embeddings=flag))
        reports[flag] = (report.embeddings, report.mapped_bytes, report.mapped_bytes_per_forward, report.resident_bytes)
        report.streamer.close()
    assert reports[None] == reports[True] and reports[None][1:3] == (table, table)
    assert reports[False][1:3] == (0, 0) and reports[False][3] == reports[None][3] + table  # 54 of SmolLM2's 61 MB at K=2
    assert StreamingConfig().maps_head(on_gpu=False) and not StreamingConfig().maps_head(on_gpu=True)
    assert StreamingConfig(stream_embeddings=True).maps_head(on_gpu=True)  # refused at load on CUDA (test_awq_triton.py)


@pytest.mark.parametrize("flag", [True, None], ids=["flag", "default"])
def test_stream_embeddings_keeps_a_tied_table_the_head_must_upcast_resident(rtn_folder, monkeypatch, flag):
    from kvstream.hf import native_linear

    monkeypatch.setattr(native_linear, "load", lambda: (None, "no C++ compiler (test)"))
    model, report = load_awq_model(rtn_folder, torch.float32, StreamingConfig("partial_resident", 2, 2, 2, stream_embeddings=flag))
    try:
        assert report.embeddings == "float32 (upcast at load: the native kernel is not built: no C++ compiler (test))"
        assert report.mapped_bytes == report.mapped_bytes_per_forward == 0
        assert model.model.embed_tokens.weight.dtype == torch.float32 and model.lm_head.weight is model.model.embed_tokens.weight
    finally:
        report.streamer.close()


def test_a_kernel_that_disagrees_leaves_the_embeddings_upcast(rtn_folder, monkeypatch):
    from kvstream.hf import native_linear
    from tests.hf.conftest import built_kernel

    built_kernel(native_linear.load, "the native linear kernel")
    monkeypatch.setattr(native_linear, "disagreement", lambda module, weight, rows=256: 3e-3)
    model, report = load_awq_model(rtn_folder, torch.float32)
    assert report.embeddings == "float32 (upcast at load: the native kernel disagrees with the upcast product by 3.00e-03 (relative))"
    assert model.model.embed_tokens.weight.dtype == torch.float32 and model.lm_head.weight is model.model.embed_tokens.weight


def test_without_the_kernel_the_embeddings_are_upcast_and_the_report_says_why(rtn_folder, monkeypatch):
    from kvstream.hf import native_linear

    monkeypatch.setattr(native_linear, "load", lambda: (None, "no C++ compiler (test)"))
    model, report = load_awq_model(rtn_folder, torch.float32)
    assert report.embeddings == "float32 (upcast at load: the native kernel is not built: no C++ compiler (test))"
    assert model.model.embed_tokens.weight.dtype == torch.float32 and model.lm_head.weight is model.model.embed_tokens.weight


# ------------------------------------------------------------------ bad checkpoints
def broken_copy(rtn_folder, tmp_path, edit):
    folder = tmp_path / "broken"
    shutil.copytree(rtn_folder, folder)
    edit(folder)
    return folder


def set_quant(**values):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"].update(values)
        (folder / "config.json").write_text(json.dumps(config))

    return edit


def missing_shard(folder):
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", "model.norm.weight": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def drop_a_tensor(folder):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    del state["model.layers.3.self_attn.k_proj.scales"]
    save_file(state, folder / "model.safetensors")


def bf16_scales(folder):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    state["model.layers.3.mlp.up_proj.scales"] = state["model.layers.3.mlp.up_proj.scales"].bfloat16()
    save_file(state, folder / "model.safetensors")


def truncated(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:6])


def garbage_header(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"[" + data[9:])  # the header's opening brace


@pytest.mark.parametrize(
    "edit, message",
    [
        (truncated, "model.safetensors: not a safetensors file (no header length that fits its 6 bytes)"),
        (garbage_header, "model.safetensors: not a safetensors file (its header is not JSON"),
        (set_quant(group_size=256), "group_size 256"),
        (set_quant(bits=8), "bits 8 (only 4)"),
        (set_quant(version="gemv"), "version gemv (only gemm)"),
        (missing_shard, "shard model-00002-of-00002.safetensors"),
        (drop_a_tensor, "model.layers.3.self_attn.k_proj.scales"),
        (bf16_scales, "model.layers.3.mlp.up_proj.scales is torch.bfloat16, expected torch.float16"),
    ],
    ids=["truncated", "not-json", "group-size", "bits", "version", "missing-shard", "missing-tensor", "scales-dtype"],
)
def test_a_bad_checkpoint_is_one_clear_error_naming_what(rtn_folder, tmp_path, edit, message):
    folder = broken_copy(rtn_folder, tmp_path, edit)
    with pytest.raises(CheckpointError) as err:
        load_awq_model(folder, torch.float32)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_streaming_settings_the_model_cannot_take_are_refused(rtn_folder):
    from kvstream.hf.loader import load_model

    with pytest.raises(CheckpointError, match="keep_first_k 20 \\+ keep_last_k 20 is more than the model's 30 layers"):
        load_awq_model(rtn_folder, torch.float32, StreamingConfig("partial_resident", 20, 20, 2))
    with pytest.raises(ValueError, match="layer streaming needs an AWQ checkpoint folder"):
        load_model(None, device="cpu", streaming=StreamingConfig())
    with pytest.raises(CheckpointError, match="staging 'pinned' is not one of copy, mapped"):
        load_awq_model(rtn_folder, torch.float32, StreamingConfig("partial_resident", 2, 2, 2, staging="pinned"))  # type: ignore[arg-type]


def test_serve_with_a_folder_that_is_not_awq_exits_with_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    out = subprocess.run(
        [sys.executable, "-m", "kvstream.cli.main", "serve", "--backend", "hf", "--model", str(tmp_path), "--awq-streaming",
         "--staging", "copy", "--stream-embeddings", "--port", "0", "--log-level", "warning"],  # (the flags parse)
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "layer streaming needs an AWQ checkpoint folder" in out.stderr and "Traceback" not in out.stderr


def test_stream_embeddings_without_streaming_exits_with_one_line(tmp_path):
    """Given as a flag, the command line refuses it; set in the environment (or a config
    file), the hf backend does, at start, before loading anything."""
    command = [sys.executable, "-m", "kvstream.cli.main", "serve", "--backend", "hf", "--port", "0", "--log-level", "warning"]
    out = subprocess.run([*command, "--stream-embeddings"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode != 0
    assert "--stream-embeddings needs --awq-streaming" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "KVSTREAM_AWQ__STREAM_EMBEDDINGS": "true"})
    assert out.returncode != 0
    assert "--stream-embeddings (awq.stream_embeddings) needs --awq-streaming (awq.streaming)" in out.stderr
    assert "Traceback" not in out.stderr


# ------------------------------------------------------------------ making one, serving one
def test_kvstream_awq_quantize_makes_a_checkpoint_the_engine_loads(tmp_path):
    """The command as users run it, on a short calibration (the search is the slow part)."""
    calibration = tmp_path / "calibration.txt"
    calibration.write_text(" ".join(f"Sentence {i} of the calibration text talks about caches and models." for i in range(300)))
    out = subprocess.run(
        [sys.executable, "-m", "kvstream.cli.main", "awq", "quantize", "--out", str(tmp_path / "awq"),
         "--calibration", str(calibration), "--samples", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "group size 64" in out.stdout
    assert "activation-aware scales cut the projections' output error" in out.stderr
    model, report = load_awq_model(tmp_path / "awq", torch.float32)
    assert report.group_size == 64 and report.format == "awq"
    again = subprocess.run([sys.executable, "-m", "kvstream.cli.main", "awq", "quantize", "--out", str(tmp_path / "awq")],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "not empty" in again.stderr


async def test_greedy_text_through_the_server_is_the_same_streamed_and_resident(rtn_folder, start_proxy):
    import io

    from openai import AsyncOpenAI
    from rich.console import Console

    from kvstream.cli import status as status_cli
    from kvstream.hf import HFBackend

    answers = {}
    for streaming, staging, tables in ((False, "copy", False), (True, "copy", False), (True, "mapped", False), (True, "mapped", True)):
        backend = HFBackend(None, str(rtn_folder), num_gpu_blocks=128, device="cpu", streaming=streaming, keep_first_k=2, keep_last_k=2,
                            staging=staging, stream_embeddings=tables)
        proxy = await start_proxy(backend)
        await proxy.engine.start()
        try:
            async with AsyncOpenAI(base_url=proxy.v1, api_key="unused", max_retries=0) as client:
                texts = []
                for prompt in ("The capital of France is", "List three colors:"):
                    reply = await client.chat.completions.create(
                        model=str(rtn_folder), messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0
                    )
                    texts.append(reply.choices[0].message.content)
                answers[streaming, staging, tables] = texts
                async with __import__("aiohttp").ClientSession() as http:
                    status = await (await http.get(proxy.url + "/status")).json()
                    weights = status["backend"]["weights"]
                    metrics = await (await http.get(proxy.url + "/metrics")).text()
        finally:
            await proxy.engine.close()
        assert weights["format"] == "awq"
        if streaming:
            assert weights["mode"] == "partial_resident" and weights["staged_bytes_total"] > 0 and weights["bytes_staged_per_token"] > 0
            assert weights["staging"] == staging
            assert "kvstream_weights_staged_bytes_total" in metrics
        gauges = dict(line.split() for line in metrics.splitlines() if line.startswith("kvstream_weights_"))
        assert float(gauges["kvstream_weights_resident_bytes"]) == weights["resident_bytes"]
        assert weights["mapped_bytes"] == float(gauges["kvstream_weights_mapped_bytes"])
        assert weights["mapped_bytes_per_forward"] == float(gauges["kvstream_weights_mapped_bytes_per_forward"])
        assert (weights["mapped_bytes"] > 0) == tables  # tied: resident unless the embeddings are streamed too
        console = Console(record=True, width=200, file=io.StringIO())  # `kvstream status` on this payload
        console.print(status_cli.render(status, None, proxy.url))
        shown = console.export_text()
        assert f"awq ({weights['kernel']} kernel)" in shown and "resident" in shown
        assert (f"partial_resident, {staging}, K 2+2" in shown) == streaming and ("embeddings mapped" in shown) == tables
    resident = answers[False, "copy", False]
    assert all(resident) and all(texts == resident for texts in answers.values()), answers


@pytest.mark.parametrize("streaming", [None, StreamingConfig("partial_resident", 1, 1, 2)], ids=["resident", "streamed"])
def test_awq_layers_take_the_direct_decoder_path_with_transformers_tokens(rtn_folder, streaming, monkeypatch):
    """The engine's direct decoder path (fast_decoder.py) on an AWQ model, resident and
    streamed (copy slots re-point the packed tensors every forward, which the direct calls
    read at each call), Q/K/V and gate/up each one kernel call: the same greedy tokens as
    transformers' layers; and
    ``AWQLinear.direct_call`` gives ``forward``'s bits, decode-sized and past the kernel's rows."""
    from kvstream.hf import fast_decoder
    from kvstream.hf.awq import native
    from kvstream.hf.library import HFEngine
    from kvstream.hf.sampling import SamplingParams

    built_native_kernel()
    module, how = native.load()
    calls = []  # projections per awq_gemv_many call

    def many(*args):
        calls.append(len(args[1]))
        return module.awq_gemv_many(*args)

    monkeypatch.setattr(native, "load", lambda: (SimpleNamespace(awq_gemv=module.awq_gemv, awq_gemv_many=many,
                                                                 awq_dequantize=module.awq_dequantize), how))
    engine = HFEngine.from_pretrained(str(rtn_folder), device="cpu", dtype="float32", max_cache_bytes=64 * 2**20,
                                      streaming=streaming)
    try:
        runner, model = engine.engine, engine.loaded.model
        layers = list(decoder_layers(model))
        assert runner.decoder.layers == len(layers) and runner.decoder.why_not is None
        prompts = [engine.encode(text) for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time " * 20)]
        params = SamplingParams(max_tokens=10, temperature=0.0)
        fast = runner.generate_sync(prompts, params)
        assert set(calls) == {2, 3} and calls.count(2) == calls.count(3)  # Q/K/V and gate/up: one call each
        fast_decoder.switch(layers, False)
        assert runner.generate_sync(prompts, params) == fast
        fast_decoder.switch(layers, True)
        projection = layers[0].mlp.down_proj
        assert projection.kernel == "native"
        x = torch.randn(native.MAX_ROWS + 2, projection.in_features, generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            for rows in (1, 3, native.MAX_ROWS + 2):
                assert torch.equal(projection.direct_call()(x[:rows]), projection(x[:rows]))
    finally:
        engine.close()
