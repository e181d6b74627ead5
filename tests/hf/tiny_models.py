"""Small random models made in memory, for tests that cannot use the embedded SmolLM2 (the GPU
machine does not get its file) or want another shape."""

from __future__ import annotations

import torch


def tiny_llama(device: torch.device, dtype: torch.dtype, layers: int = 2, hidden: int = 576, intermediate: int = 1536,
               heads: int = 9, kv_heads: int = 3):
    """A random Llama (by default SmolLM2's geometry, ``layers`` layers) with a word-level
    tokenizer made in memory: what the GPU machine can run without the embedded model's file."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(512)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048, eos_token_id=1,
                         bos_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the init's, so that greedy choices are not near-ties
        for parameter in model.parameters():
            parameter.mul_(8 if parameter.dim() > 1 else 1)
    return model.to(device, dtype).eval(), tokenizer
