"""The native RMSNorm and rotary kernels (native_ops.cpp) against transformers' own ops, how the
engine installs them, and the native KV write (paged_decode.cpp) against index_copy_."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kvstream.hf import native_attention, native_ops
from tests.hf.conftest import built_kernel, started_backend

ORIGINAL_ROTARY = getattr(modeling_llama.apply_rotary_pos_emb, "_kvstream_original", modeling_llama.apply_rotary_pos_emb)


@pytest.fixture(scope="module")
def kernels():
    return built_kernel(native_ops.load, "the native ops")


def rotary_case(generator, batch, heads, kv_heads, tokens, dim, cos_batch):
    """q / k as a forward has them: transposed views of [B, T, H, D] projections."""
    q = torch.randn(batch, tokens, heads, dim, generator=generator).transpose(1, 2)
    k = torch.randn(batch, tokens, kv_heads, dim, generator=generator).transpose(1, 2)
    angles = torch.randn(cos_batch, tokens, dim // 2, generator=generator) * 30
    angles = torch.cat([angles, angles], -1)
    return q, k, angles.cos(), angles.sin()


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 128), (4, 1, 32)])
@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize(("batch", "cos_batch"), [(1, 1), (2, 1), (2, 2)])
def test_rotary_gives_transformers_bits(kernels, heads, kv_heads, dim, tokens, batch, cos_batch):
    generator = torch.Generator().manual_seed(heads * 100 + dim + tokens + batch)
    q, k, cos, sin = rotary_case(generator, batch, heads, kv_heads, tokens, dim, cos_batch)
    want = ORIGINAL_ROTARY(q, k, cos, sin)
    got = kernels.rotary(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].stride() == q.stride()  # the layout a forward handed in, kept


def test_rotary_reads_contiguous_and_strided_inputs(kernels):
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 6, 64, generator=generator)  # contiguous [B, H, T, D]
    wide = torch.randn(1, 2, 6, 96, generator=generator)
    k = wide[..., 16:80]  # a strided slice, head dim still contiguous
    cos, sin = torch.randn(1, 6, 64, generator=generator), torch.randn(1, 6, 64, generator=generator)
    want = ORIGINAL_ROTARY(q, k, cos, sin)
    got = kernels.rotary(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_rotary_refuses_what_it_cannot_read(kernels):
    q, k, cos, sin = rotary_case(torch.Generator().manual_seed(4), 1, 2, 2, 3, 8, 1)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.rotary(q.double(), k, cos, sin)
    with pytest.raises(RuntimeError, match="do not match"):
        kernels.rotary(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.rotary(q.transpose(2, 3), k, cos, sin)


def test_the_wrapped_rotary_sends_other_calls_to_the_original(kernels):
    wrapped = native_ops._wrap_rotary(ORIGINAL_ROTARY)
    generator = torch.Generator().manual_seed(5)
    q, k, cos, sin = rotary_case(generator, 1, 4, 2, 3, 16, 1)
    for args, kwargs in (((q, k, cos, sin), {}), ((q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16()), {})):
        assert all(torch.equal(a, b) for a, b in zip(wrapped(*args, **kwargs), ORIGINAL_ROTARY(*args, **kwargs)))
    # unsqueeze_dim=2: q / k laid out [B, T, H, D] (the kernel's form is unsqueeze_dim=1)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    got = wrapped(qt, kt, cos, sin, unsqueeze_dim=2)
    want = ORIGINAL_ROTARY(qt, kt, cos, sin, unsqueeze_dim=2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_call_the_kernel_does_not_take_goes_to_the_original(kernels):
    wrapped = native_ops._wrap_rotary(ORIGINAL_ROTARY)
    generator = torch.Generator().manual_seed(10)
    q, k, cos, sin = rotary_case(generator, 1, 4, 2, 3, 16, 2)  # cos / sin batch 2 broadcast over q's 1
    got, want = wrapped(q, k, cos, sin), ORIGINAL_ROTARY(q, k, cos, sin)
    assert got[0].shape[0] == 2 and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def rotate_every_two(q, k, cos, sin):
    """GPT-J's interleaved rotary: the same call, another formula."""
    def rotate(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def needs_position_ids(q, k, cos, sin, position_ids):
    return q, k


def test_only_the_standard_rotary_form_is_wrapped(kernels):
    assert native_ops._rotary_agrees(kernels, ORIGINAL_ROTARY, 9, 3, 64)
    assert not native_ops._rotary_agrees(kernels, rotate_every_two, 9, 3, 64)
    assert not native_ops._rotary_agrees(kernels, needs_position_ids, 9, 3, 64)


@pytest.mark.parametrize("width", [576, 64, 37, 1])
@pytest.mark.parametrize("shape", [(1,), (5,), (2, 3)])
def test_rms_norm_matches_transformers_norm(kernels, width, shape):
    generator = torch.Generator().manual_seed(width + len(shape))
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=generator))
    x = torch.randn(*shape, width, generator=generator) * 3
    with torch.inference_mode():
        want = norm(x)
        got = kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())


def test_rms_norm_reads_strided_rows_and_refuses_bad_input(kernels):
    generator = torch.Generator().manual_seed(6)
    wide = torch.randn(4, 80, generator=generator)
    weight = torch.randn(64, generator=generator)
    x = wide[:, 8:72]
    want = kernels.rms_norm(x.contiguous(), weight, 1e-6)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), want)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(RuntimeError, match=r"\[n\]"):
        kernels.rms_norm(x, weight[:10], 1e-6)


class GemmaStyleRMSNorm(nn.Module):
    """A norm named like Llama's with another formula (``1 + weight``): must not be switched."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)


class ScaledRMSNorm(LlamaRMSNorm):
    """A norm whose forward takes another argument: it cannot be checked, so it is left alone."""

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return super().forward(x) * scale


class TinyWithNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.llama = LlamaRMSNorm(16)
        self.gemma = GemmaStyleRMSNorm(16)
        self.proj = nn.Linear(16, 16)


def test_install_switches_only_norms_that_agree(kernels):
    model = TinyWithNorms()
    choice = native_ops.install(model, True)
    assert type(model.llama).__name__ == "NativeLlamaRMSNorm" and isinstance(model.llama, LlamaRMSNorm)
    assert type(model.gemma) is GemmaStyleRMSNorm
    assert choice.norms == 1 and "rms_norm:GemmaStyleRMSNorm" in choice.why_not
    x = torch.randn(3, 16)
    with torch.inference_mode():
        native = model.llama(x)
        model.llama.__class__ = LlamaRMSNorm
        reference = model.llama(x)
    assert float((native - reference).abs().max()) <= 1e-6 * float(reference.abs().max())


def test_a_norm_whose_forward_cannot_be_checked_is_left_alone(kernels):
    model = TinyWithNorms()
    model.gemma = ScaledRMSNorm(16)
    choice = native_ops.install(model, True)
    assert type(model.gemma) is ScaledRMSNorm and type(model.llama).__name__ == "NativeLlamaRMSNorm"
    assert choice.norms == 1 and choice.why_not == {"rms_norm:ScaledRMSNorm": "its forward cannot be checked: TypeError"}


def test_install_gives_the_norms_back_and_a_missing_compiler_keeps_them(kernels, monkeypatch):
    model = TinyWithNorms()
    model.gemma = LlamaRMSNorm(16)
    assert native_ops.install(model, True).norms == 2
    choice = native_ops.install(model, False)
    assert type(model.llama) is LlamaRMSNorm and type(model.gemma) is LlamaRMSNorm
    assert choice.why_not == {"native": "not requested (matmul backend torch)"}
    monkeypatch.setattr(native_ops, "load", lambda: (None, "RuntimeError: no compiler"))
    choice = native_ops.install(model, True)
    assert choice.norms == 0 and choice.why_not == {"native": "not built: RuntimeError: no compiler"}
    assert type(model.llama) is LlamaRMSNorm


def test_a_switched_norm_still_trains_through_its_own_forward(kernels):
    model = TinyWithNorms()
    native_ops.install(model, True)
    x = torch.randn(2, 16, requires_grad=True)
    model.llama(x).sum().backward()  # the kernel has no backward: the original forward ran
    assert x.grad is not None and model.llama.weight.grad is not None


async def test_the_engine_runs_smollm2_on_the_native_ops_and_status_says_so(smollm2, kernels):
    model = smollm2[0]
    async with started_backend(smollm2) as backend:
        ops = backend.describe()["native_ops"]
        norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
        assert ops["rms_norm_modules"] == len(norms) == 2 * model.config.num_hidden_layers + 1
        assert all(type(m).__name__ == "NativeLlamaRMSNorm" for m in norms)
        assert ops["rotary_wrapped"] == ["transformers.models.llama.modeling_llama"] and ops["why_not"] == {}
        assert modeling_llama.apply_rotary_pos_emb._kvstream_original is ORIGINAL_ROTARY
    async with started_backend(smollm2, matmul={"backend": "torch"}) as backend:
        ops = backend.describe()["native_ops"]
        assert ops["rms_norm_modules"] == 0 and "not requested" in ops["why_not"]["native"]
        assert all(type(m) is LlamaRMSNorm for m in model.modules() if isinstance(m, LlamaRMSNorm))
        assert modeling_llama.apply_rotary_pos_emb is ORIGINAL_ROTARY


def test_write_kv_matches_index_copy():
    generator = torch.Generator().manual_seed(8)
    k_pool, v_pool = torch.randn(40, 3, 64, generator=generator), torch.randn(40, 3, 64, generator=generator)
    key = torch.randn(1, 5, 3, 64, generator=generator).transpose(1, 2)[0]  # [H_kv, T, D], as a forward has it
    value = torch.randn(1, 5, 3, 64, generator=generator).transpose(1, 2)[0]
    slots = torch.tensor([7, 0, 39, 12, 13])
    want_k, want_v = k_pool.clone().index_copy_(0, slots, key.transpose(0, 1)), v_pool.clone().index_copy_(0, slots, value.transpose(0, 1))
    native_attention.write_kv(k_pool, v_pool, slots, key, value)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)


def test_write_kv_checks_every_slot_before_writing():
    k_pool, v_pool = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    key = value = torch.ones(2, 3, 16)
    for bad in ([1, 2, 8], [-1, 0, 1]):
        with pytest.raises(RuntimeError, match="slot outside the pool"):
            native_attention.write_kv(k_pool, v_pool, torch.tensor(bad), key, value)
    assert not k_pool.any() and not v_pool.any()
    with pytest.raises(RuntimeError, match="float32"):
        native_attention.write_kv(k_pool.double(), v_pool.double(), torch.tensor([0, 1, 2]), key, value)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        native_attention.write_kv(k_pool, v_pool, torch.tensor([0, 1]), key, value)
