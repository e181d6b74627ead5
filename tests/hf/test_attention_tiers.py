"""The attention tier is chosen by probing each built kernel against eager, and /status says
which runs and why each faster one does not."""

from __future__ import annotations

import pytest
import torch

from kvstream.hf import attention, flex, native_attention
from kvstream.hf.attention_tiers import AttentionTierError, choose_tier
from kvstream.hf.kv_cache import KVShape
from kvstream.hf.loader import LoadedModel
from tests.hf.conftest import started_backend

CPU = torch.device("cpu")


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (8, 8, 128, 4), (4, 1, 64, 8)])
def test_auto_takes_native_where_it_builds_and_flex_agrees_too(heads, kv_heads, head_dim, block_size):
    """The probe is a packed step (a chunk after cached tokens, a whole prompt, decodes ending
    mid-block, at a block's end and in the first block) over tables in reverse block order,
    so agreement here means the in-place reads follow the block tables."""
    choice = choose_tier("auto", heads, KVShape(2, kv_heads, head_dim), torch.float32, CPU, block_size)
    assert choice.name == "native", choice.why_not
    assert choice.why_not == {"flash": "CUDA only (a Triton kernel)"}
    assert choose_tier("flex", heads, KVShape(2, kv_heads, head_dim), torch.float32, CPU, block_size).name == "flex"


def test_without_a_compiler_auto_falls_back_to_sdpa_with_the_reasons(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("CppCompileError: C++ compile error\nno g++ here")

    monkeypatch.setattr(flex, "_compiled", lambda geometry: no_compiler)
    monkeypatch.setattr(native_attention, "load", lambda: (None, "RuntimeError: Ninja is required to load C++ extensions"))
    choice = choose_tier("auto", 9, KVShape(1, 3, 64), torch.float32, CPU)
    assert choice.name == "sdpa"
    assert choice.why_not["native"] == ("failed on the probe: NativeKernelUnavailable: the native attention kernel is not "
                                        "available: RuntimeError: Ninja is required to load C++ extensions")
    assert choice.why_not["flex"] == "failed on the probe: FlexKernelError: RuntimeError: CppCompileError: C++ compile error"
    with pytest.raises(AttentionTierError, match="attention backend flex: failed on the probe"):
        choose_tier("flex", 9, KVShape(1, 3, 64), torch.float32, CPU)
    with pytest.raises(AttentionTierError, match="attention backend native: failed on the probe"):
        choose_tier("native", 9, KVShape(1, 3, 64), torch.float32, CPU)


def test_native_is_skipped_for_dtypes_and_devices_it_does_not_take():
    choice = choose_tier("auto", 9, KVShape(1, 3, 64), torch.bfloat16, CPU)
    assert choice.name == "flex" and choice.why_not["native"] == "float32 only, the model runs bfloat16"
    with pytest.raises(AttentionTierError, match="native: CPU only"):
        choose_tier("native", 9, KVShape(1, 3, 64), torch.float32, torch.device("meta"))


def test_a_kernel_that_disagrees_with_eager_is_not_taken(monkeypatch):
    real = attention._attend

    def broken(plan, q, k, v, mask, causal, scale, gqa):
        out = real(plan, q, k, v, mask, causal, scale, gqa)
        return out if plan.kernel == "eager" else out + 1e-2  # a small, systematic error

    monkeypatch.setattr(attention, "_attend", broken)
    choice = choose_tier("auto", 9, KVShape(1, 3, 64), torch.float32, CPU)
    assert choice.name == "eager" and "differs from eager by 0.01" in choice.why_not["sdpa"]
    with pytest.raises(AttentionTierError, match="attention backend sdpa: differs from eager"):
        choose_tier("sdpa", 9, KVShape(1, 3, 64), torch.float32, CPU)


def test_named_tiers_that_cannot_run_here_are_refused():
    with pytest.raises(AttentionTierError, match="flash: CUDA only"):
        choose_tier("flash", 9, KVShape(1, 3, 64), torch.float32, CPU)
    with pytest.raises(AttentionTierError, match="not one of"):
        choose_tier("fast", 9, KVShape(1, 3, 64), torch.float32, CPU)
    assert choose_tier("eager", 9, KVShape(1, 3, 64), torch.float32, CPU).name == "eager"


async def test_status_names_the_running_tier(smollm2):
    for requested, expected in (("auto", "native"), ("flex", "flex"), ("sdpa", "sdpa"), ("eager", "eager")):
        async with started_backend(smollm2, attention={"backend": requested}) as backend:
            info = backend.describe()
            assert info["attention_backend"] == expected == backend.runner.config.attention
            why = info["attention_backend_why"]
            faster = {"native": {"flash"}, "flex": {"flash", "native"}, "sdpa": {"flash", "native", "flex"},
                      "eager": {"flash", "native", "flex", "sdpa"}}
            assert set(why) == faster[expected]
            assert expected == "native" or why["native"] == f"attention.backend asks for {expected}"


async def test_a_named_tier_that_fails_its_probe_stops_the_engine_at_start(smollm2, monkeypatch):
    """attention.backend sdpa, asked for by name, is not silently replaced: the engine does
    not start, and the error says why."""
    from kvstream.hf.backend import HFBackend
    from tests.conftest import make_settings

    real = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda plan, *a: real(plan, *a) * (1 if plan.kernel == "eager" else 2))
    settings = make_settings(memory={"num_gpu_blocks": 64}, attention={"backend": "sdpa"})
    backend = HFBackend(None, None, settings, preloaded=LoadedModel(smollm2[0], smollm2[2], "smollm2", "hf:test"))
    with pytest.raises(RuntimeError, match="hf backend: attention backend sdpa: differs from eager") as caught:
        await backend.start()
    assert isinstance(caught.value.__cause__, AttentionTierError)
    assert backend.runner is None
    await backend.close()


async def test_a_flex_failure_at_run_time_moves_the_engine_to_sdpa_without_losing_the_request(smollm2, monkeypatch):
    """A decode shape the start-up compile did not cover failing to compile is not an outage:
    the step reruns as sdpa, the tokens are the same, and /status says what happened."""
    from kvstream.hf.model_runner import ModelRunner, RunnerConfig
    from kvstream.hf.sampling import SamplingParams

    model, reference, tokenizer = smollm2
    prompt = tokenizer("The capital of France is")["input_ids"]
    params = SamplingParams(max_tokens=8, temperature=0)
    engine = ModelRunner(model, tokenizer, RunnerConfig(block_size=16, num_blocks=64, num_cpu_blocks=0, attention="flex"))
    assert engine.attention.name == "flex"
    expected = ModelRunner(model, tokenizer, RunnerConfig(block_size=16, num_blocks=64, num_cpu_blocks=0, attention="eager"))
    expected = expected.generate_sync([prompt], params)

    def fails(*args):
        raise flex.FlexKernelError("InductorError: CppCompileError: C++ compile error")

    monkeypatch.setattr(flex, "IN_PLACE_MIN_CONTEXT", 0)  # read in place at this short context
    monkeypatch.setattr(flex, "flex_paged", fails)
    assert engine.generate_sync([prompt], params) == expected
    assert engine.attention.name == engine.config.attention == "sdpa"
    assert engine.attention.why_not["flex"] == "failed at run time: InductorError: CppCompileError: C++ compile error"


def test_a_flex_plan_without_the_query_heads_is_refused():
    from kvstream.hf.attention import AttentionPlan
    from kvstream.hf.kv_cache import PagedKVCache

    cache = PagedKVCache(KVShape(1, 3, 64), 8, 16, 0, torch.float32, CPU)
    with pytest.raises(ValueError, match="query_heads"):
        AttentionPlan.build(cache, [([0, 1], 20, 1)], "flex")
    assert AttentionPlan.build(cache, [([0, 1], 20, 1)], "flex", 9).decode_block_mask is not None
