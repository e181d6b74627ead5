"""The direct decoder path (fast_decoder.py): the same bits as transformers' layers, installed
only where its probe agrees, transformers' forward for every call that is not an engine step,
and each projection's ``direct_call`` giving its ``forward``'s bits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvstream.hf import compat, fast_decoder, native_linear, native_ops
from kvstream.hf.model_runner import ModelRunner, RunnerConfig
from kvstream.hf.sampling import SamplingParams
from tests.hf.conftest import built_kernel, chat_prompts, started_backend


@pytest.fixture(scope="module")
def kernels():
    built_kernel(native_linear.load, "the native linear kernel")
    return built_kernel(native_ops.load, "the native ops")


def runner(smollm2, **config) -> ModelRunner:
    return ModelRunner(smollm2[0], smollm2[2], RunnerConfig(block_size=16, num_blocks=96, num_cpu_blocks=0, **config))


def layers_of(model) -> list[nn.Module]:
    return list(model.model.layers)


def greedy(engine: ModelRunner, prompts: list[list[int]], tokens: int = 12) -> list[list[int]]:
    return engine.generate_sync(prompts, SamplingParams(max_tokens=tokens, temperature=0.0))


@pytest.mark.parametrize("attention", ["native", "sdpa"])
def test_the_direct_path_gives_the_tokens_of_transformers_layers(smollm2, kernels, attention):
    """Batched decodes, prefill chunks beside decodes, and prompts of a few to hundreds of
    tokens: the same greedy tokens with the layers switched and not, and the logits of one
    step bit for bit."""
    engine = runner(smollm2, attention=attention, max_num_seqs=6)
    assert engine.decoder.layers == smollm2[0].config.num_hidden_layers and engine.decoder.why_not is None
    assert all(getattr(type(layer), "_kvstream_fast", False) for layer in layers_of(smollm2[0]))
    prompts = chat_prompts(smollm2[2])[:8]
    fast = greedy(engine, prompts)
    fast_decoder.switch(layers_of(smollm2[0]), False)
    try:
        assert greedy(engine, prompts) == fast
    finally:
        fast_decoder.switch(layers_of(smollm2[0]), True)


def test_calls_that_are_not_engine_steps_run_transformers_forward(smollm2, kernels):
    """A plain forward (no plan) on a switched model, as baselines and model.generate run it:
    transformers' own layers run, bit for bit."""
    model = smollm2[0]
    runner(smollm2)
    layers = layers_of(model)
    assert all(getattr(type(layer), "_kvstream_fast", False) for layer in layers)
    ids = torch.tensor([[1, 450, 7483, 310, 3444, 338]])
    model.set_attn_implementation("sdpa")  # the runner set its paged attention, which needs a plan
    try:
        with torch.inference_mode():
            switched = model(ids, use_cache=False).logits
            fast_decoder.switch(layers, False)
            original = model(ids, use_cache=False).logits
    finally:
        fast_decoder.switch(layers, True)
        compat.use_paged_attention(model)
    assert torch.equal(switched, original)


def test_a_probe_that_disagrees_switches_nothing(smollm2, kernels, monkeypatch):
    """A direct path that computes something else (GELU for SiLU) is caught by the probe."""
    monkeypatch.setattr(fast_decoder, "_activation_call", lambda act: nn.functional.gelu)
    engine = runner(smollm2)
    assert engine.decoder.layers == 0 and "differs from transformers' forward on probe step 1" in engine.decoder.why_not
    assert not any(getattr(type(layer), "_kvstream_fast", False) for layer in layers_of(smollm2[0]))
    monkeypatch.undo()
    assert runner(smollm2).decoder.layers == smollm2[0].config.num_hidden_layers


def test_a_direct_path_that_raises_on_the_probe_switches_nothing(smollm2, kernels, monkeypatch):
    """A rotary of another signature (any exception in the direct forward) leaves every layer
    on transformers' forward, the engine up, and says why."""

    def broken(*args):
        raise RuntimeError("rotary of another form")

    monkeypatch.setattr(fast_decoder, "_rotary_call", lambda attention, kernels: broken)
    engine = runner(smollm2)
    assert engine.decoder.layers == 0
    assert engine.decoder.why_not == "failed on the probe: RuntimeError: rotary of another form"
    assert not any(getattr(type(layer), "_kvstream_fast", False) for layer in layers_of(smollm2[0]))
    prompts = chat_prompts(smollm2[2])[:2]
    assert all(len(tokens) == 4 for tokens in greedy(engine, prompts, 4))  # serving on transformers' layers


def test_torch_backend_hooks_and_other_structures_keep_transformers_forward(smollm2, kernels):
    engine = runner(smollm2, matmul="torch")
    assert engine.decoder.layers == 0 and engine.decoder.why_not == "not requested (matmul backend torch)"
    assert not any(getattr(type(layer), "_kvstream_fast", False) for layer in layers_of(smollm2[0]))
    model = smollm2[0]
    handle = model.model.layers[3].mlp.down_proj.register_forward_hook(lambda *args: None)
    try:
        assert "hooks" in runner(smollm2).decoder.why_not
    finally:
        handle.remove()
    attention = model.model.layers[0].self_attn
    attention.add_module("q_norm", nn.Identity())  # Qwen3-style attention: not this path's structure
    try:
        assert "not Llama-style attention" in runner(smollm2).decoder.why_not
    finally:
        del attention._modules["q_norm"]
    assert runner(smollm2).decoder.layers == model.config.num_hidden_layers


@pytest.mark.parametrize("rows", [1, 5, native_linear.MAX_ROWS + 3])
def test_direct_calls_give_the_bits_of_forward(kernels, rows):
    """NativeLinear (with a bias) and HalfLinear, decode-sized and past the kernel's rows."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    dense = nn.Linear(96, 40)
    native_linear.install(dense, "native")
    assert type(dense) is native_linear.NativeLinear
    half = native_linear.HalfLinear(torch.randn(40, 96, generator=generator).to(torch.bfloat16), torch.randn(40, generator=generator))
    with torch.inference_mode():
        for layer in (dense, half):
            assert torch.equal(layer.direct_call()(x), layer(x))
    half.use_kernel = False
    assert half.direct_call() == half.forward  # the kernel off: forward itself


async def test_status_reports_the_decoder_path(smollm2, kernels):
    async with started_backend(smollm2) as backend:
        status = backend.describe()
    assert status["decoder"] == {"fast_layers": smollm2[0].config.num_hidden_layers, "why_not": None}
