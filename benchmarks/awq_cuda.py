"""AWQ on CUDA: the Triton kernel against its baselines, and layer streaming from pinned host
memory against its physical limit (the host-to-GPU copy bandwidth measured in the same run).

    python benchmarks/awq_cuda.py [--layers 24] [--hidden 2048] [--intermediate 5632] [--tokens 32]

CUDA only. Made here, no download: a synthetic AWQ checkpoint (a Llama of the given geometry,
GQA 32 / 8 heads, random packed weights: speed does not depend on the values) with a
word-level tokenizer. Two parts:

1. kernel: per projection shape, ``x @ W`` at 1 / 16 / 256 rows for the ``triton`` kernel, the
   ``dequant`` kernel (torch ops, any device) and a dense bfloat16 ``torch.mm`` on the
   dequantized weights (what an unquantized model's layer costs), CUDA events, best of 5;
2. engine (``HFEngine``, bfloat16): TTFT of a 256-token prompt and decode tokens/s at batch 1
   and 8 for AWQ resident and streamed at K = 0, 2, 4 (``partial_resident``, 2 slots), the GPU
   memory each holds (``torch.cuda.max_memory_allocated``, KV pool included, the same in every
   row), the bytes staged per forward and their limit: pinned host -> GPU bandwidth (a copy of
   256 MiB, best of 5) over those bytes, in tokens/s at batch 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def make_checkpoint(folder: Path, layers: int, hidden: int, intermediate: int, heads: int = 32, kv_heads: int = 8,
                    vocab: int = 32000, group_size: int = 128) -> Path:
    """A random AWQ GEMM checkpoint of a Llama geometry, with a word-level tokenizer."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from kvstream.hf.awq.checkpoint import align_data, awq_config

    generator = torch.Generator().manual_seed(0)
    head_dim = hidden // heads
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, kv_heads * head_dim),
              "self_attn.v_proj": (hidden, kv_heads * head_dim), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (hidden, intermediate), "mlp.up_proj": (hidden, intermediate), "mlp.down_proj": (intermediate, hidden)}
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(vocab, hidden, generator=generator) * 0.02).half(),
        "lm_head.weight": (torch.randn(vocab, hidden, generator=generator) * 0.02).half(),
        "model.norm.weight": torch.ones(hidden, dtype=torch.float16),
    }
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        state[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.float16)
        state[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.float16)
        for name, (inputs, outputs) in shapes.items():
            state[f"{prefix}.{name}.qweight"] = torch.randint(-2**31, 2**31 - 1, (inputs, outputs // 8), generator=generator, dtype=torch.int32)
            state[f"{prefix}.{name}.qzeros"] = torch.full((inputs // group_size, outputs // 8), 0x88888888 - 2**32, dtype=torch.int32)
            # scales so that weights are ~N(0, 0.02)-sized: (q - 8) spans +-8
            state[f"{prefix}.{name}.scales"] = torch.full((inputs // group_size, outputs), 0.02 / 4.6, dtype=torch.float16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    align_data(folder / "model.safetensors")
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                         tie_word_embeddings=False, eos_token_id=1, bos_token_id=0).to_dict()
    config["quantization_config"] = awq_config(group_size)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1").save_pretrained(folder)
    return folder


def best_ms(fn, calls: int = 20) -> float:
    """Best-of-5 mean milliseconds per call by CUDA events (flash_attention.py's timer)."""
    from flash_attention import time_per_call

    return time_per_call(fn, calls)


def kernels(hidden: int, intermediate: int) -> None:
    from kvstream.hf.awq.format import dequantize, quantize_rtn
    from kvstream.hf.awq.linear import AWQLinear

    print(f"{'shape (in x out)':<18} {'rows':>5} {'triton ms':>10} {'dequant ms':>11} {'bf16 mm ms':>11} {'dequant/triton':>15} "
          f"{'bf16/triton':>12} {'triton GB/s':>12}")
    for inputs, outputs in ((hidden, hidden), (hidden, intermediate), (intermediate, hidden)):
        packed = quantize_rtn(torch.randn(outputs, inputs) * 0.02, 128)
        layer = AWQLinear(packed, torch.bfloat16)
        layer.move(torch.device("cuda"))
        dense = dequantize(packed, torch.bfloat16).cuda()
        packed_bytes = layer.packed_bytes()
        for rows in (1, 16, 256):
            x = torch.randn(rows, inputs, device="cuda", dtype=torch.bfloat16)
            times = {}
            for kernel in ("triton", "dequant"):
                layer.kernel = kernel
                times[kernel] = best_ms(lambda: layer(x))
            times["mm"] = best_ms(lambda: x @ dense)
            print(f"{inputs:>6} x {outputs:<9} {rows:>5} {times['triton']:>10.4f} {times['dequant']:>11.4f} {times['mm']:>11.4f} "
                  f"{times['dequant'] / times['triton']:>14.2f}x {times['mm'] / times['triton']:>11.2f}x "
                  f"{packed_bytes / times['triton'] / 1e6:>12.1f}", flush=True)


def host_to_gpu_bandwidth() -> float:
    source = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(source, device="cuda")
    seconds = best_ms(lambda: target.copy_(source, non_blocking=True), calls=4) / 1000
    return source.numel() / seconds


def engine_rows(folder: Path, tokens: int, limit_bandwidth: float) -> None:
    from kvstream.hf import HFEngine
    from kvstream.hf.awq.streaming import StreamingConfig

    print(f"{'run':<16} {'ttft ms':>8} {'tok/s b1':>9} {'tok/s b8':>9} {'GPU peak MiB':>13} {'staged/fwd MB':>14} "
          f"{'limit tok/s':>12} {'of limit':>9} {'kernel':>8}")
    prompt = " ".join(f"w{7 + i % 900}" for i in range(256))
    for name, streaming in (("resident", None),
                            *((f"streamed K={k}", StreamingConfig("partial_resident", k, k, 2)) for k in (0, 2, 4))):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        engine = HFEngine.from_pretrained(str(folder), device="cuda", dtype="bfloat16", streaming=streaming,
                                          max_cache_bytes=512 * 2**20, max_batch_size=8)
        try:
            engine.generate("w5 w6", max_new_tokens=2)  # compile and warm
            decodes, ttft = [], None
            for _ in range(3):
                one = engine.generate(prompt, max_new_tokens=tokens)
                ttft = one.ttft_ms if ttft is None else ttft
                decodes.append((len(one.token_ids) - 1) / ((one.total_ms - one.ttft_ms) / 1000))
            batch = engine.generate_batch([f"w{10 + i} w{20 + i} w{30 + i}" for i in range(8)], max_new_tokens=tokens)
            decode8 = sum(len(r.token_ids) for r in batch) / (max(r.total_ms for r in batch) / 1000)
            weights = engine.loaded.weights_snapshot()
            staged = weights.get("staged_bytes_per_forward", 0)
            limit = limit_bandwidth / staged if staged else None
            best = max(decodes)
            print(f"{name:<16} {ttft:>8.1f} {best:>9.1f} {decode8:>9.1f} {torch.cuda.max_memory_allocated() / 2**20:>13.0f} "
                  f"{staged / 1e6:>14.1f} {limit or 0:>12.1f} {f'{best / limit:.1%}' if limit else '-':>9} {weights.get('kernel')!s:>8}",
                  flush=True)
        finally:
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    kernels(args.hidden, args.intermediate)
    if args.skip_engine:
        return
    bandwidth = host_to_gpu_bandwidth()
    print(f"pinned host -> GPU: {bandwidth / 1e9:.1f} GB/s (best of 5, 256 MiB)")
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        folder = make_checkpoint(Path(scratch) / "awq", args.layers, args.hidden, args.intermediate)
        print(f"synthetic checkpoint: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
              f"{(folder / 'model.safetensors').stat().st_size / 1e9:.2f} GB, made in {time.perf_counter() - started:.0f} s")
        engine_rows(folder, args.tokens, bandwidth)


if __name__ == "__main__":
    main()
