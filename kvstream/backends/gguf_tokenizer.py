"""Exact prompt token ids from a model's GGUF metadata, as Ollama's ``/api/show`` with
``"verbose": true`` returns it (``model_info``: ``tokenizer.ggml.tokens``, ``merges``,
``model``, ``pre``, the special token ids and ``tokenizer.chat_template``).

A GGUF carries no ``tokenizer.json``: the vocabulary, merges and pre-tokenizer name are
metadata under llama.cpp's key names. transformers rebuilds the tokenizer those describe
(``integrations/gguf/gguf_tokenizer_mapping.py``, what it does to load a GGUF itself); the
chat is rendered with the file's own Jinja template, as llama.cpp renders it with
``--jinja``. Ollama renders chats with the Go template in its Modelfile instead, a port of
the same template for the models it publishes, so the count is checked against the
``prompt_eval_count`` Ollama reports (``OllamaBackend``) and a model whose counts disagree
goes back to estimates.

Needs transformers and tokenizers (``pip install 'kvstream[hf]'``); without them, or for a
tokenizer transformers cannot rebuild, ``build`` returns None and prompts are estimated.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class GGUFTokenizer:
    """A model's tokenizer and chat template, rebuilt from its GGUF metadata."""

    def __init__(self, tokenizer: Any, chat_template: str | None, add_bos: bool) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.add_bos = add_bos

    @classmethod
    def build(cls, model_info: dict[str, Any]) -> GGUFTokenizer | None:
        """The tokenizer ``model_info`` describes; None when it cannot be rebuilt here."""
        try:
            from transformers import PreTrainedTokenizerFast
            from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
        except ImportError:
            return None
        fields = {
            name: model_info[f"tokenizer.{key}"]
            for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
            if f"tokenizer.{key}" in model_info
        }
        tokens = fields.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            return None  # Ollama sends the vocabulary only with "verbose": true
        try:
            backend, _ = convert_gguf_tokenizer(str(model_info.get("general.architecture", "")), fields)
        except Exception as exc:  # an unknown tokenizer type: estimate rather than fail
            logger.info("cannot rebuild the %s tokenizer from GGUF metadata (%s); prompt sizes are estimated",
                        fields.get("tokenizer_type"), exc)
            return None

        def special(key: str) -> str | None:
            index = model_info.get(f"tokenizer.ggml.{key}")
            return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend, bos_token=special("bos_token_id"), eos_token=special("eos_token_id"),
            unk_token=special("unknown_token_id"), pad_token=special("padding_token_id"),
        )
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        add_bos = model_info.get("tokenizer.ggml.add_bos_token", fields.get("tokenizer_type") == "llama") is True
        template = model_info.get("tokenizer.chat_template")
        return cls(tokenizer, template if isinstance(template, str) else None, add_bos)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int] | None:
        """The ids of ``messages`` rendered by the model's template with the generation
        prompt; None without a template (or for messages it cannot render)."""
        if self.chat_template is None:
            return None
        try:
            text = self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # a template that raises on these messages (tool calls, images...)
            logger.debug("the chat template could not render this request (%s); estimating", exc)
            return None
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` as llama.cpp tokenizes a prompt: special tokens parsed, BOS
        added when the model asks for it and the text does not start with it."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        if self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids
