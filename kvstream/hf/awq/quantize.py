"""Making an AWQ checkpoint: activation-aware scale search, then 4-bit packing.

AWQ (Lin et al., 2023) keeps the weights that meet large activations precise by scaling
them up before rounding: for the projections that read the same input (q/k/v, gate/up,
down, and o when it reads v's output whole), it searches a per-input-channel scale
``s = mean|x| ** alpha`` over a grid of alpha, picks the one whose quantized projections
best reproduce the original outputs on calibration activations, multiplies the weights by
``s`` and divides the op that feeds them (the RMSNorm weight, or the previous projection's
output rows) by ``s``, which leaves the fp model's function unchanged. Then every
projection is quantized round-to-nearest with a zero point per group (``format``).

Between the two, as AutoAWQ does, a clipping range is searched per group of every
projection but q and k (whose errors pass through the softmax): the group's largest weight
magnitude shrunk by a ratio from 1.0 down to 0.55, the ratio whose quantized group best
reproduces the group's share of the outputs on the scaled calibration inputs.
An outlier weight no longer stretches its whole group's 16 levels.

Layers are processed one at a time on calibration inputs captured at the first layer; each
layer's inputs are the previous original layer's outputs (AutoAWQ's order). AutoAWQ scores
scales on the whole attention/MLP block; this scores them on the projections' own outputs.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvstream.hf.awq.checkpoint import align_data, awq_config
from kvstream.hf.awq.format import SUPPORTED_GROUP_SIZES, fake_quantize, quantize_rtn
from kvstream.hf.awq.model import decoder_layers

logger = logging.getLogger(__name__)

GRID = 20  # alphas tried: 0, 1/20, ..., 19/20
SEARCH_TOKENS = 2048  # calibration rows each candidate scale is scored on (all of them set mean|x|)
CLIP_TOKENS = 512  # calibration rows each clipping ratio is scored on (AutoAWQ's n_sample_token)
CLIP_RATIOS = tuple(1 - step / 20 for step in range(10))  # 1.0, 0.95, ..., 0.55 (AutoAWQ: grid 20, max shrink 0.5)
NOT_CLIPPED = ("q_proj", "k_proj")  # their errors reach the output through the softmax


class _Captured(Exception):
    pass


def default_calibration_text() -> str:
    """English prose that every Python install has: standard library documentation."""
    import pydoc

    modules = ["argparse", "asyncio", "collections", "contextlib", "dataclasses", "functools", "itertools",
               "logging", "pathlib", "subprocess", "threading", "unittest", "email", "http.client", "decimal"]
    return "\n\n".join(pydoc.getdoc(__import__(name, fromlist=["_"])) for name in modules)


def heldout_text() -> str:
    """Other standard library documentation, for perplexity (disjoint from calibration)."""
    import pydoc

    modules = ["json", "csv", "sqlite3", "heapq", "shutil", "tempfile", "typing", "enum", "zipfile", "textwrap",
               "datetime", "fractions", "statistics", "ipaddress", "urllib.parse"]
    parts = []
    for name in modules:
        module = __import__(name, fromlist=["_"])
        parts.append(pydoc.getdoc(module))
        parts += [pydoc.getdoc(getattr(module, attr)) for attr in sorted(dir(module))[:40] if not attr.startswith("_")]
    return "\n\n".join(p for p in parts if p)


def token_chunks(tokenizer, text: str, length: int, limit: int | None = None) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    count = len(ids) // length
    if count == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {length}")
    chunks = ids[: count * length].view(count, length)
    return chunks[:limit] if limit else chunks


def choose_group_size(model: torch.nn.Module, requested: int | None) -> int:
    """``requested`` if every projection's input divides by it; without a request, the
    largest supported size that does (SmolLM2's 576-wide hidden size takes 64, not 128)."""
    widths = {m.in_features for layer in decoder_layers(model) for m in layer.modules() if isinstance(m, torch.nn.Linear)}
    if requested is not None:
        if requested not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"--group-size {requested} is not supported (one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))})")
        bad = sorted(w for w in widths if w % requested)
        if bad:
            raise ValueError(f"--group-size {requested} does not divide the model's projection input width {bad[0]}")
        return requested
    for size in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
        if all(w % size == 0 for w in widths):
            return size
    raise ValueError(f"no supported group size divides the projection widths {sorted(widths)}")


def _groups(layer: torch.nn.Module) -> list[tuple[torch.nn.Module, list[str], str]]:
    """(op feeding the input, projections reading it, name of the input's capture) for a
    Llama-family decoder layer; o_proj only when it reads v_proj's output whole."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [
        (layer.input_layernorm, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "self_attn.q_proj"),
        (layer.post_attention_layernorm, ["mlp.gate_proj", "mlp.up_proj"], "mlp.gate_proj"),
        (mlp.up_proj, ["mlp.down_proj"], "mlp.down_proj"),
    ]
    if attn.v_proj.out_features == attn.o_proj.in_features:
        groups.append((attn.v_proj, ["self_attn.o_proj"], "self_attn.o_proj"))
    return groups


@torch.no_grad()
def _search_scale(x: torch.Tensor, linears: list[torch.nn.Linear], group_size: int) -> tuple[torch.Tensor, float, float]:
    """The per-input-channel scale minimising the projections' output error on ``x``
    [tokens, in]; returns it with its error and the error of no scaling (alpha 0)."""
    x = x.float()
    x_mean = x.abs().mean(dim=0)
    if len(x) > SEARCH_TOKENS:  # evenly spaced rows: scoring is the search's whole cost
        x = x[torch.linspace(0, len(x) - 1, SEARCH_TOKENS).long()]
    originals = [x @ lin.weight.float().T for lin in linears]
    best, best_error, base_error = torch.ones_like(x_mean), math.inf, math.inf
    for step in range(GRID):
        alpha = step / GRID
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        error = 0.0
        for lin, original in zip(linears, originals):
            w = fake_quantize(lin.weight.float() * s, group_size) / s  # [out, in]
            error += (x @ w.T - original).pow(2).mean().item()
        if step == 0:
            base_error = error
        if error < best_error:
            best, best_error = s, error
    return best, best_error, base_error


@torch.no_grad()
def search_clip(x: torch.Tensor, weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight`` [out, in] with each group's values clipped to the ratio of its largest
    magnitude that minimises the error of the group's quantized share of the outputs on
    ``x`` [tokens, in] (ratio 1.0, no clipping, is a candidate: no group's share does worse
    on ``x``; a whole output row can, by the cross terms between its groups)."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    groups = in_features // group_size
    if len(x) > CLIP_TOKENS:
        x = x[torch.linspace(0, len(x) - 1, CLIP_TOKENS).long()]
    xg = x.float().reshape(-1, groups, group_size)  # [tokens, groups, group]
    wg = w.reshape(out_features, groups, group_size)
    original = torch.einsum("tng,ong->ton", xg, wg)  # each group's share of each output
    peak = wg.abs().amax(dim=-1, keepdim=True)  # [out, groups, 1]
    best_error = torch.full((out_features, groups), math.inf)
    best_limit = peak.clone()
    for ratio in CLIP_RATIOS:
        limit = peak * ratio
        clipped = wg.clamp(-limit, limit)
        quantized = fake_quantize(clipped.reshape(out_features, in_features), group_size)
        error = (torch.einsum("tng,ong->ton", xg, quantized.reshape(out_features, groups, group_size)) - original).pow(2).mean(0)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_limit = torch.where(better.unsqueeze(-1), limit, best_limit)
    return wg.clamp(-best_limit, best_limit).reshape(out_features, in_features).to(weight.dtype)


def _layer_inputs(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each projection's input [tokens, in] in one forward of ``layer``, and its output."""
    seen: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(module, args, output) -> None:  # returns None: the output is kept
            seen[name] = args[0].reshape(-1, args[0].shape[-1])

        return hook

    hooks = [m.register_forward_hook(record(rel)) for rel, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        output = layer(hidden, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return seen, output[0] if isinstance(output, tuple) else output


@torch.no_grad()
def quantize_model(
    model: torch.nn.Module, tokenizer, group_size: int, calibration: str, activation_aware: bool = True,
    samples: int = 32, length: int = 256, progress: Callable[[str], None] | None = None,
) -> dict[str, torch.Tensor]:
    """The model's tensors as an AWQ GEMM checkpoint: decoder projections packed, every
    other tensor (norm weights rescaled by the search) in float16. ``model`` is
    modified (scales folded in)."""
    layers = decoder_layers(model)
    if any(not isinstance(m, torch.nn.Linear) and hasattr(m, "out_features") for layer in layers for m in layer.modules()):
        # HalfLinear (weights held as stored) or already quantized layers: nothing to rescale.
        raise ValueError("quantize_model needs the decoder's projections as float nn.Linear layers: load the model with half_weights=False")
    names = {id(m): n for n, m in model.named_modules()}
    inputs: dict[str, object] = {}
    if activation_aware:
        chunks = token_chunks(tokenizer, calibration, length, samples)

        def catch(module, args, kwargs):
            inputs["hidden"] = args[0] if args else kwargs.pop("hidden_states")
            # No KV cache: each layer is run once per calibration pass, never incrementally.
            inputs["kwargs"] = {k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values", "past_key_value")}
            raise _Captured

        handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
        try:
            model(chunks, use_cache=False)
        except _Captured:
            pass
        finally:
            handle.remove()
    gains = []
    for index, layer in enumerate(layers):
        if activation_aware:
            hidden, kwargs = inputs["hidden"], dict(inputs["kwargs"])  # type: ignore[arg-type]
            seen, inputs["hidden"] = _layer_inputs(layer, hidden, kwargs)
            divided: dict[str, torch.Tensor] = {}  # projection -> the scale its input is now divided by
            for feeder, members, captured in _groups(layer):
                linears = [layer.get_submodule(m) for m in members]
                s, error, base = _search_scale(seen[captured], linears, group_size)
                divided.update(dict.fromkeys(members, s))
                gains.append(base / error if error else 1.0)
                for lin in linears:
                    lin.weight.mul_(s.to(lin.weight.dtype))
                if isinstance(feeder, torch.nn.Linear):  # the previous projection's output rows
                    feeder.weight.div_(s.to(feeder.weight.dtype).unsqueeze(1))
                    if feeder.bias is not None:
                        feeder.bias.div_(s.to(feeder.bias.dtype))
                else:  # an RMSNorm: its weight
                    feeder.weight.div_(s.to(feeder.weight.dtype))
            # Clipping scores the scaled projections on their scaled inputs: the feeder of each
            # group now divides its output by s, so a member's input is what it was over s.
            for name, module in layer.named_modules():
                if isinstance(module, torch.nn.Linear) and not name.endswith(NOT_CLIPPED):
                    x = seen[name].float() / divided[name] if name in divided else seen[name]
                    module.weight.copy_(search_clip(x, module.weight, group_size))
        if progress is not None:
            progress(f"layer {index + 1}/{len(layers)}")
    if gains:
        logger.info("activation-aware scales cut the projections' output error %.2fx on average (geometric)",
                    math.exp(sum(math.log(g) for g in gains) / len(gains)))
    state: dict[str, torch.Tensor] = {}
    packed_modules = {id(m) for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear)}
    for module in model.modules():
        if id(module) in packed_modules:
            name = names[id(module)]
            packed = quantize_rtn(module.weight.float(), group_size)
            state[f"{name}.qweight"], state[f"{name}.qzeros"], state[f"{name}.scales"] = packed.qweight, packed.qzeros, packed.scales
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias.detach().to(torch.float16)
    skip = {f"{names[m]}.weight" for m in packed_modules} | {f"{names[m]}.bias" for m in packed_modules}
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, tensor in model.state_dict().items():
        if name in skip or (tied and name == "lm_head.weight"):
            continue
        # float16, as AutoAWQ writes them: the engine keeps the embeddings (and a tied head)
        # as stored and widens what it reads (half_weights), the rest it upcasts at load.
        state[name] = tensor.detach().to(torch.float16 if tensor.is_floating_point() else tensor.dtype).contiguous().clone()
    return state


def save_checkpoint(out: Path, model: torch.nn.Module, tokenizer, state: dict[str, torch.Tensor], group_size: int, source: Path | None) -> None:
    """Write ``state`` as an AWQ folder: model.safetensors, config.json with its
    quantization_config, the tokenizer and generation config."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    align_data(out / "model.safetensors")
    config = model.config.to_dict()
    config["quantization_config"] = awq_config(group_size)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copy(source / "generation_config.json", out / "generation_config.json")


@torch.no_grad()
def perplexity(model: torch.nn.Module, tokenizer, text: str, length: int = 512, limit: int = 16) -> float:
    """exp(mean next-token loss) over ``text`` in chunks of ``length`` tokens."""
    chunks = token_chunks(tokenizer, text, length, limit)
    total, count = 0.0, 0
    for chunk in chunks:
        logits = model(chunk.unsqueeze(0)).logits[0, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum")
        total, count = total + loss.item(), count + len(chunk) - 1
    return math.exp(total / count)

