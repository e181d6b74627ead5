"""Building a transformers model from an AWQ checkpoint, resident or streamed.

The model is built on the meta device (no memory), every ``nn.Linear`` the checkpoint has
packed tensors for is replaced by an ``AWQLinear`` over them, and every other tensor
(embeddings, norms, head, biases) is assigned from the checkpoint. Projections of streamed
layers keep memory-mapped tensors (``LayerStreamer`` stages them per forward); all others
are copied into memory. On CUDA the model is built the same way on the CPU and then moved:
every resident tensor to the GPU, streamed layers' packed tensors to pinned host memory
(staged into GPU slots per forward).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstream.hf.awq.checkpoint import CheckpointError, SafetensorsIndex, awq_settings
from kvstream.hf.awq.format import PackedLinear
from kvstream.hf.awq.linear import AWQLinear, KernelChoice, probe_kernel
from kvstream.hf.awq.streaming import LayerStreamer, StreamingConfig
from kvstream.hf.half_weights import HALF_DTYPES, HalfEmbedding, disagreement, why_not_half
from kvstream.hf.native_linear import HalfLinear

logger = logging.getLogger(__name__)


@dataclass
class WeightsReport:
    """What /status says about the model's weights."""

    format: str  # "awq" or "dense"
    kernel: KernelChoice | None = None
    group_size: int | None = None
    resident_bytes: int = 0
    streamed_bytes: int = 0  # packed bytes staged from the checkpoint on every forward
    mapped_bytes: int = 0  # embedding / head tables left in the mapped checkpoint instead of memory
    mapped_bytes_per_forward: int = 0  # of those, what every forward reads whole (a mapped head)
    mode: str = "full_resident"
    keep_first_k: int = 0
    keep_last_k: int = 0
    embeddings: str = ""  # how the token embeddings (and a tied head) are held, and why
    streamer: LayerStreamer | None = None
    tokens: int = 0  # tokens through forwards, for bytes staged per token
    extra: dict[str, Any] = field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.format, "resident_bytes": self.resident_bytes}
        if self.format == "awq":
            out |= {"group_size": self.group_size, "kernel": self.kernel.name if self.kernel else None,
                    "kernel_why": self.kernel.why if self.kernel else None, "mode": self.mode,
                    "streamed_bytes": self.streamed_bytes, "mapped_bytes": self.mapped_bytes,
                    "mapped_bytes_per_forward": self.mapped_bytes_per_forward, "embeddings": self.embeddings}
        if self.streamer is not None:
            s = self.streamer
            out |= {
                "keep_first_k": self.keep_first_k, "keep_last_k": self.keep_last_k,
                "staging": "mapped" if s.mapped else "pinned" if s.cuda is not None else "copy", "staging_slots": s.depth, "staging_bytes": s.slot_bytes,
                "staged_bytes_total": s.staged_bytes, "staged_bytes_per_forward": s.bytes_per_forward,
                "bytes_staged_per_token": round(s.staged_bytes / self.tokens) if self.tokens else None,
                "stall_seconds_total": round(s.stall_s, 3),
            }
        return out


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder layers (the ModuleList as long as the layer count)."""
    count = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    raise CheckpointError("cannot find the model's decoder layers")


def tensor_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def load_awq_model(folder: Path | str, dtype: torch.dtype, streaming: StreamingConfig | None = None,
                   device: torch.device | str = "cpu") -> tuple[torch.nn.Module, WeightsReport]:
    """The AWQ checkpoint in ``folder`` as a transformers model on ``device``, and its report.
    Raises CheckpointError naming the file or key that is wrong. On CUDA streamed layers are
    always staged by copies from pinned host memory (``streaming.staging`` is for the CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    quant = awq_settings(folder)
    if quant is None:
        raise CheckpointError(f"{folder}: config.json has no AWQ quantization_config (quant_method 'awq')")
    group_size = int(quant["group_size"])
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config  # built here, not by transformers' quantizers
    index = SafetensorsIndex(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = decoder_layers(model)
    streaming = streaming or StreamingConfig(mode="full_resident")
    try:
        streaming.check(len(layers))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and (streaming.drop_page_cache or streaming.stream_embeddings is True):
        raise CheckpointError("--drop-page-cache and --stream-embeddings are for streaming on the CPU: on CUDA the "
                              "streamed layers are held in pinned host memory and the embeddings on the GPU")

    kernel: KernelChoice | None = None
    plan: dict[int, list[tuple[str, AWQLinear]]] = {}
    names = {id(m): n for n, m in model.named_modules()}
    for layer_index, layer in enumerate(layers):
        streamed_parts = streaming.streamed_parts(layer_index, len(layers))
        for relative, module in list(layer.named_modules()):
            if not isinstance(module, torch.nn.Linear):
                continue
            name = f"{names[id(layer)]}.{relative}"
            if f"{name}.qweight" not in index:
                raise CheckpointError(f"{folder}: tensor {name}.qweight is not in the checkpoint")
            streamed = any(relative == p or relative.startswith(p + ".") or p == "" for p in streamed_parts)
            take = index.mapped if streamed else index.load
            packed = PackedLinear(
                qweight=take(f"{name}.qweight"), qzeros=take(f"{name}.qzeros"), scales=take(f"{name}.scales"),
                group_size=group_size, bias=index.load(f"{name}.bias") if f"{name}.bias" in index else None,
            )
            for part, dtype_wanted in (("qweight", torch.int32), ("qzeros", torch.int32), ("scales", torch.float16)):
                if getattr(packed, part).dtype != dtype_wanted:  # the kernels read these types only
                    raise CheckpointError(f"{folder}: {name}.{part} is {getattr(packed, part).dtype}, expected {dtype_wanted}")
            expected = (module.in_features, module.out_features // 8)
            if tuple(packed.qweight.shape) != expected:
                raise CheckpointError(f"{folder}: {name}.qweight has shape {tuple(packed.qweight.shape)}, expected {expected}")
            quantized = AWQLinear(packed, dtype)
            if kernel is None:
                kernel = probe_kernel(module.in_features, module.out_features, group_size, dtype, device=device)
                logger.info("awq kernel: %s (%s)", kernel.name, kernel.why)
            quantized.kernel = kernel.name
            parent_name, _, child = relative.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, child, quantized)
            if streamed:
                plan.setdefault(layer_index, []).append((relative, quantized))

    embeddings, head_replaced = _hold_embeddings(model, index, dtype, map_input=bool(plan) and not cuda,
                                                 map_head=bool(plan) and streaming.maps_head(cuda), on_gpu=cuda)

    # Everything that is not a packed projection: assigned from the checkpoint.
    state = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not tensor.is_meta:
            continue
        if name in index:
            state[name] = index.load(name).to(dtype) if index.refs[name].dtype.is_floating_point else index.load(name)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False) and not head_replaced:
        model.tie_weights()
    _rebuild_computed_buffers(model)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise CheckpointError(f"{folder}: tensor {missing[0]} is not in the checkpoint")
    model.eval()

    # Weights: parameters and persistent buffers (not what the model computes, like
    # rotary frequencies), each shared tensor once (tied embeddings); tables left in the
    # mapped checkpoint (_hold_embeddings) are not resident.
    weights = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    mapped_tables = [t for t in weights.values() if index.is_mapped(t)]
    resident = {i: t for i, t in weights.items() if not index.is_mapped(t)}
    head = model.get_output_embeddings()
    for layer_index, layer in enumerate(layers):
        for module in layer.modules():
            streamed = layer_index in plan and any(module is m for _, m in plan[layer_index])
            if isinstance(module, AWQLinear) and not streamed:
                resident.update({id(t): t for t in (module.qweight, module.qzeros, module.scales)})
    report = WeightsReport(
        format="awq", kernel=kernel, group_size=group_size, mode=streaming.mode,
        resident_bytes=tensor_bytes(list(resident.values())), embeddings=embeddings, mapped_bytes=tensor_bytes(mapped_tables),
        mapped_bytes_per_forward=tensor_bytes([head.weight]) if head is not None and index.is_mapped(head.weight) else 0,
        keep_first_k=streaming.keep_first_k, keep_last_k=streaming.keep_last_k,
    )
    if plan:
        ranges = None
        if streaming.drop_page_cache:
            ranges = {
                layer: [(str(ref.file), ref.start, ref.end)
                        for relative, _ in plan[layer]
                        for ref in (index.refs[f"{names[id(layers[layer])]}.{relative}.{part}"] for part in ("qweight", "qzeros", "scales"))]
                for layer in plan
            }
        # A mapped head reads its whole table after the layers, every forward: the streamer
        # faults it in ahead, and drops it with the layers' pages.
        mapped_head = [head.weight] if report.mapped_bytes_per_forward else []
        head_ranges = [index.file_range(t) for t in mapped_head] if streaming.drop_page_cache else None
        streamer = LayerStreamer(layers, plan, streaming.staging_slots, ranges, mapped=streaming.staging == "mapped" and not cuda,
                                 tail=mapped_head, tail_file_ranges=head_ranges, device=device)
        report.streamer, report.streamed_bytes = streamer, streamer.bytes_per_forward

        def count_tokens(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if isinstance(ids, torch.Tensor):
                report.tokens += ids.numel()

        model.register_forward_pre_hook(count_tokens, with_kwargs=True)
    if cuda:
        _to_device(model, layers, plan, device)
    return model, report


def _to_device(model: torch.nn.Module, layers: torch.nn.ModuleList, plan: dict[int, list[tuple[str, AWQLinear]]],
               device: torch.device) -> None:
    """Move the loaded model to a GPU: parameters and buffers, and every resident layer's
    packed tensors (streamed ones stay in pinned host memory, their slots already there)."""
    streamed = {id(m) for modules in plan.values() for _, m in modules}
    model.to(device)
    for module in layers.modules():
        if isinstance(module, AWQLinear):
            module.move(device, packed=id(module) not in streamed)


def _hold_embeddings(model: torch.nn.Module, index: SafetensorsIndex, dtype: torch.dtype, map_input: bool, map_head: bool,
                     on_gpu: bool = False) -> tuple[str, bool]:
    """Hold the token embeddings and the LM head. Returns what was done (for /status) and
    whether the head was replaced.

    Half precision: a float16 / bfloat16 table under a float32 model is kept as stored
    (``half_weights``) where the native kernel is built and agrees with the upcast product;
    otherwise everything is upcast at load. Mapped (``map_input``, when layers are streamed):
    an input table the head does not share stays a view of the checkpoint's pages, since a
    lookup reads only the rows of the tokens it embeds (a few KB a token) and holding the
    whole vocabulary buys nothing; a large untied model saves vocab x hidden x 2 bytes. A
    tied table is read whole by the head every token: it stays resident, as the head does,
    unless ``map_head`` (``StreamingConfig.stream_embeddings``) maps the head's table too.
    ``on_gpu``: both are upcast to the model's precision (the half tables' kernel is the CPU's)."""
    names = {id(m): n for n, m in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    key = f"{names[id(embed)]}.weight"
    if key not in index:
        return "not in the checkpoint", False  # reported as a missing tensor after loading
    stored = index.refs[key].dtype
    tied = head is not None and bool(getattr(model.config, "tie_word_embeddings", False))
    why = "the model runs on a GPU" if on_gpu else why_not_half(stored, dtype)
    if why is None:
        error = disagreement(index.mapped(key))  # reads its first rows only
        if error > 1e-5:
            why = f"the native kernel disagrees with the upcast product by {error:.2e} (relative)"
    upcast = f"{dtype} (upcast at load: {why})".replace("torch.", "")
    # A tied table is mapped only with the head, which can be only where it stays as stored.
    map_table = map_input and stored.is_floating_point and (not tied or (map_head and why is None))
    if not map_table and why is not None:
        return upcast, False  # both upcast by the state loop
    table = index.mapped(key) if map_table else index.load(key)
    _replace(model, names[id(embed)], HalfEmbedding(table, embed.padding_idx, dtype))
    kept = str(stored).replace("torch.", "")
    held = f"{kept} mapped from the checkpoint (a lookup reads its tokens' rows)" if map_table else f"{kept} as stored"
    if head is None:
        return held, False
    head_key = f"{names[id(head)]}.weight"
    bias_key = f"{names[id(head)]}.bias"
    bias = index.load(bias_key) if bias_key in index else None
    if tied:
        _replace(model, names[id(head)], HalfLinear(table, bias, dtype))
        read_whole = " (read whole from the mapping every token)" if map_table else ""
        return f"{held}, LM head tied to them{read_whole}", True
    head_stored = index.refs[head_key].dtype if head_key in index else None
    if why is None and head_stored in HALF_DTYPES:
        head_kept = str(head_stored).replace("torch.", "")
        if map_head:
            _replace(model, names[id(head)], HalfLinear(index.mapped(head_key), bias, dtype))
            return f"{held}, LM head {head_kept} mapped from the checkpoint (read whole every token)", True
        _replace(model, names[id(head)], HalfLinear(index.load(head_key), bias, dtype))
        return f"{held}, LM head {f'{head_kept} as stored' if map_table else 'too'}", True
    if why is not None:
        return f"{held}, LM head {upcast}", False
    return f"{held}, LM head upcast (stored as {head_stored or 'nothing'})", False


def _replace(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _rebuild_computed_buffers(model: torch.nn.Module) -> None:
    """Buffers a model computes at construction (rotary inverse frequencies) are not in
    checkpoints: rebuild the modules that own them, now on CPU."""
    for name, module in list(model.named_modules()):
        own = [b for b in module.buffers(recurse=False) if b.is_meta]
        if not own or not name:
            continue
        try:
            with torch.device("cpu"):
                rebuilt = type(module)(config=model.config)
        except TypeError as exc:
            raise CheckpointError(f"cannot rebuild {name} ({type(module).__name__}) outside the checkpoint: {exc}") from None
        _replace(model, name, rebuilt)
