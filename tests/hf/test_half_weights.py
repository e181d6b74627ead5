"""Half-precision checkpoints held as stored under a float32 CPU engine (half_weights.py):
what is kept and what is not, the model's results against the upcast model's, and the
switch through the server's settings."""

from __future__ import annotations

import pytest

from tests.conftest import require_import
from tests.hf.conftest import built_kernel

torch = require_import("torch")

from torch import nn  # noqa: E402

from kvstream.hf import native_linear  # noqa: E402
from kvstream.hf.half_weights import HalfEmbedding, compact  # noqa: E402
from kvstream.hf.native_linear import HalfLinear  # noqa: E402


@pytest.fixture(scope="module")
def kernel():
    return built_kernel(native_linear.load, "the native linear kernel")


@pytest.fixture(scope="session")
def bf16_folder(tmp_path_factory):
    """SmolLM2 saved as a bfloat16 checkpoint, as most HF checkpoints are stored."""
    from kvstream.hf.loader import load_model

    loaded = load_model(None, device="cpu", half_weights=False)
    out = tmp_path_factory.mktemp("bf16") / "smollm2-bf16"
    loaded.model.to(torch.bfloat16).save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    return out


def loaded_pair(folder):
    from kvstream.hf.loader import load_model

    return load_model(str(folder), device="cpu"), load_model(str(folder), device="cpu", half_weights=False)


@pytest.fixture(scope="module")
def pair(bf16_folder, kernel):
    return loaded_pair(bf16_folder)


def test_a_bfloat16_checkpoint_is_held_as_stored(pair):
    half, upcast = pair
    model = half.model
    assert not [m for m in model.modules() if type(m) is nn.Linear]
    linears = [m for m in model.modules() if isinstance(m, HalfLinear)]
    # 30 layers x 7 projections, and the head (tied: counted as a layer, its table once)
    assert len(linears) == 30 * 7 + 1 and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert isinstance(model.model.embed_tokens, HalfEmbedding)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one table
    assert next(model.parameters()).dtype == torch.float32  # the engine's KV dtype, transformers' model.dtype
    snapshot = half.weights_snapshot()
    assert snapshot["stored"].startswith("bfloat16 as stored: 211 linear layers and the embeddings (")
    assert upcast.weights_snapshot()["stored"] == "float32 (upcast: half weights off)"
    assert snapshot["resident_bytes"] < 0.51 * upcast.weights_snapshot()["resident_bytes"]  # norms stay float32
    assert half.identity != upcast.identity  # their prefill sums may round apart: caches kept apart


def test_decode_logits_are_the_upcast_model_s_bit_for_bit(pair):
    """Decode-sized forwards run the same kernel on exactly the same values: identical bits;
    prefill-sized ones widen blocks for BLAS: float tolerance."""
    half, upcast = pair
    native_linear.install(upcast.model)  # as the engine does: the float32 layers on the kernel too
    try:
        ids = torch.randint(0, 40000, (2, 37), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            for batch in (ids[:1, :1], ids[:, :3], ids[:1, :40]):
                assert torch.equal(half.model(batch, use_cache=False).logits, upcast.model(batch, use_cache=False).logits)
            got, want = half.model(ids, use_cache=False).logits, upcast.model(ids, use_cache=False).logits  # 74 rows
            assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    finally:
        native_linear.install(upcast.model, "torch")


def test_greedy_text_through_the_engine_is_the_same_held_as_stored(pair):
    from kvstream.hf.model_runner import ModelRunner, RunnerConfig
    from kvstream.hf.sampling import SamplingParams
    from tests.hf.conftest import chat_prompts

    half, upcast = pair
    prompts = chat_prompts(half.tokenizer)[:6]
    outputs = []
    for loaded in (half, upcast):
        runner = ModelRunner(loaded.model, loaded.tokenizer, RunnerConfig(block_size=16, num_blocks=256, num_cpu_blocks=0, max_num_seqs=6))
        try:
            outputs.append(runner.generate_sync(prompts, SamplingParams(max_tokens=24, temperature=0)))
        finally:
            runner.close()
            native_linear.install(loaded.model, "torch")
    assert outputs[0] == outputs[1]


def test_the_torch_matmul_backend_widens_blocks_for_blas(pair):
    half, _ = pair
    head = half.model.lm_head
    x = torch.randn(3, head.in_features, generator=torch.Generator().manual_seed(8))
    try:
        choice = native_linear.install(half.model, "torch")
        assert choice.name == "torch" and not any(m.use_kernel for m in half.model.modules() if isinstance(m, HalfLinear))
        blas = head(x)
        choice = native_linear.install(half.model)
        assert choice.name == "native" and choice.modules == 211 and head.use_kernel
        kernel = head(x)
        assert float((blas - kernel).abs().max()) <= 1e-5 * float(kernel.abs().max())
        assert torch.equal(kernel, native_linear.load()[0].native_linear(x, head.weight.float()))
    finally:
        native_linear.install(half.model, "torch")


class Tiny(nn.Module):
    """Linear layers of every kind of value, and an embedding tied to a head."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(9)
        self.embed = nn.Embedding(50, 16)
        self.embed.weight.data = torch.randn(50, 16, generator=generator).bfloat16().float()
        self.as_bf16 = nn.Linear(16, 24)
        self.as_bf16.weight.data = torch.randn(24, 16, generator=generator).bfloat16().float()
        self.as_fp16 = nn.Linear(24, 16, bias=False)  # float16 values with bits bfloat16 drops
        self.as_fp16.weight.data = (1 + torch.randint(1, 1023, (16, 24), generator=generator) / 1024).half().float()
        self.full = nn.Linear(16, 16, bias=False)
        self.full.weight.data = torch.randn(16, 16, generator=generator).bfloat16().float()
        self.full.weight.data[3, 5] += 1e-6  # one value no half dtype holds
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def forward(self, ids):
        return self.head(self.full(self.as_fp16(torch.relu(self.as_bf16(self.embed(ids))))))


def test_each_layer_stays_half_only_where_every_value_is_exact(kernel):
    model = Tiny()
    ids = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        want = model(ids)
    done = compact(model)
    assert done.dtype == "bfloat16+float16" and done.linear_layers == 3 and done.embeddings
    assert model.as_bf16.weight.dtype == torch.bfloat16 and model.as_bf16.bias.dtype == torch.float32
    assert model.as_fp16.weight.dtype == torch.float16
    assert type(model.full) is nn.Linear and model.full.weight.dtype == torch.float32
    assert isinstance(model.head, HalfLinear) and model.head.weight is model.embed.weight
    assert done.describe().startswith("bfloat16+float16 as stored: 3 linear layers and the embeddings")
    with torch.no_grad():
        got = model(ids)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_a_float32_model_is_left_as_it_is_and_the_report_says_why(smollm2, kernel):
    """The embedded SmolLM2 is dequantized from a GGUF: its values are not half values."""
    from kvstream.hf.loader import load_model

    loaded = load_model(None, device="cpu")
    assert loaded.weights_snapshot()["stored"] == "float32 (upcast: no weight is exactly representable in bfloat16 or float16)"
    assert [m for m in loaded.model.modules() if type(m) is nn.Linear]


def test_without_the_kernel_nothing_is_narrowed(monkeypatch):
    monkeypatch.setattr(native_linear, "load", lambda: (None, "no C++ compiler (test)"))
    model = Tiny()
    done = compact(model)
    assert done.dtype is None and done.describe() == "float32 (upcast: the native kernel is not built: no C++ compiler (test))"
    assert type(model.as_bf16) is nn.Linear


async def test_status_says_how_the_weights_are_held_and_the_setting_turns_it_off(bf16_folder, kernel):
    from kvstream.hf.backend import HFBackend
    from tests.conftest import make_settings

    for on in (True, False):
        settings = make_settings(backend={"type": "hf", "model": str(bf16_folder), "device": "cpu"},
                                 memory={"num_gpu_blocks": 32, "half_weights": on})
        backend = HFBackend(None, str(bf16_folder), settings)
        await backend.start()
        try:
            stored = backend.describe()["weights"]["stored"]
            assert stored.startswith("bfloat16 as stored") if on else stored == "float32 (upcast: half weights off)"
        finally:
            await backend.close()


def test_kvstream_awq_quantize_takes_a_bfloat16_checkpoint(bf16_folder, tmp_path):
    """The quantizer rescales and packs float32 nn.Linear layers: it loads a half-precision
    source upcast, every projection packed (a layer held as stored would be skipped)."""
    import json
    import subprocess
    import sys

    from kvstream.hf.awq.checkpoint import SafetensorsIndex

    out = subprocess.run(
        [sys.executable, "-m", "kvstream.cli.main", "awq", "quantize", "--out", str(tmp_path / "awq"), "--model", str(bf16_folder),
         "--method", "rtn"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    index = SafetensorsIndex(tmp_path / "awq")
    assert sum(name.endswith(".qweight") for name in index.refs) == 30 * 7
    assert not [name for name in index.refs if name.startswith("model.layers.") and name.endswith("proj.weight")]
    assert json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"


def test_quantizing_a_model_held_as_stored_is_refused_with_the_way_out(pair):
    from kvstream.hf.awq.quantize import quantize_model

    half, _ = pair
    with pytest.raises(ValueError, match="half_weights=False"):
        quantize_model(half.model, half.tokenizer, 64, "", activation_aware=False)


def test_a_kernel_that_disagrees_with_the_upcast_product_narrows_nothing(kernel, monkeypatch):
    monkeypatch.setattr(native_linear, "disagreement", lambda module, weight, rows=256: 3e-3)
    model = Tiny()
    done = compact(model)
    assert done.dtype is None and done.linear_layers == 0
    assert done.describe() == "float32 (upcast: the native kernel disagrees with the upcast product by 3.00e-03 (relative))"
    assert type(model.as_bf16) is nn.Linear and type(model.embed) is nn.Embedding


class ScaledEmbedding(nn.Embedding):
    """An embedding that scales its rows (as Gemma's does): not replaced by HalfEmbedding."""

    def forward(self, ids):
        return super().forward(ids) * 2.0


def test_a_table_tied_to_a_module_that_is_not_replaced_stays_float32_for_both(kernel):
    model = Tiny()
    table = model.embed.weight
    model.embed = ScaledEmbedding(50, 16, _weight=table)
    model.head.weight = model.embed.weight
    done = compact(model)
    assert done.linear_layers == 2 and not done.embeddings  # as_bf16 and as_fp16 only
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight  # one table, still tied
    assert model.embed.weight.dtype == torch.float32
