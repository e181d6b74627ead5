"""The attention tier is chosen by probing each built kernel against eager, and /status says
which runs and why each faster one does not."""

from __future__ import annotations

import pytest
import torch

from kvstream.hf import attention
from kvstream.hf.attention_tiers import AttentionTierError, choose_tier
from kvstream.hf.kv_cache import KVShape
from kvstream.hf.loader import LoadedModel

CPU = torch.device("cpu")


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 8, 128), (4, 1, 64)])
def test_auto_takes_sdpa_where_it_agrees_with_eager(heads, kv_heads, head_dim):
    choice = choose_tier("auto", heads, KVShape(2, kv_heads, head_dim), torch.float32, CPU)
    assert choice.name == "sdpa"
    assert set(choice.why_not) == {"flash", "flex"} and all("not built" in why for why in choice.why_not.values())


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


def test_named_tiers_that_are_not_built_are_refused():
    with pytest.raises(AttentionTierError, match="flex: not built yet"):
        choose_tier("flex", 9, KVShape(1, 3, 64), torch.float32, CPU)
    with pytest.raises(AttentionTierError, match="not one of"):
        choose_tier("fast", 9, KVShape(1, 3, 64), torch.float32, CPU)
    assert choose_tier("eager", 9, KVShape(1, 3, 64), torch.float32, CPU).name == "eager"


async def test_status_names_the_running_tier(smollm2):
    from kvstream.hf.backend import HFBackend
    from tests.conftest import make_settings

    for requested, expected in (("auto", "sdpa"), ("eager", "eager")):
        settings = make_settings(memory={"num_gpu_blocks": 64}, attention={"backend": requested})
        backend = HFBackend(None, None, settings, preloaded=LoadedModel(smollm2[0], smollm2[2], "smollm2", "hf:test"))
        await backend.start()
        try:
            info = backend.describe()
            assert info["attention_backend"] == expected == backend.runner.config.attention
            why = info["attention_backend_why"]
            assert set(why) == ({"flash", "flex"} if expected == "sdpa" else {"flash", "flex", "sdpa"})
            assert expected == "sdpa" or why["sdpa"] == "attention.backend asks for eager"
        finally:
            await backend.close()


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
