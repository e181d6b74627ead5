"""Fill-in-the-middle: a completion written between a prompt and a ``suffix`` (OpenAI's
completions field, Ollama's generate field), what code-completion plugins send when the
cursor has code on both sides.

Code models are trained on it with three special tokens: the prompt is the prefix token,
the text before the cursor, the suffix token, the text after it, and the middle token,
after which the model writes what goes between and ends its turn (the prefix-suffix-middle
order, llama.cpp's ``/infill`` and Ollama's templates build the same), or a token that ends
it as well (``ENDS``). A model has FIM when its tokenizer holds one of the known spellings as
single tokens; any other gets a 400.
"""

from __future__ import annotations

from typing import Any

# (prefix, suffix, middle), as each family spells them.
SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, Qwen3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, StarCoder2, Granite code
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)


# Tokens a code model may write after the middle instead of its end of turn (llama.cpp ends
# the generation at them too): the middle is done.
ENDS = ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<fim_pad>", "<file_sep>", "<repo_name>")


def end_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids of ``ENDS`` the tokenizer has, as single tokens."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    ids = [(tokenizer.convert_tokens_to_ids(token), token) for token in ENDS]
    return tuple(i for i, token in ids if isinstance(i, int) and i != unknown and tokenizer.convert_ids_to_tokens(i) == token)


def fim_tokens(tokenizer: Any) -> tuple[int, int, int] | None:
    """The ids of the tokenizer's prefix, suffix and middle tokens, or None if it has none."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    for spelling in SPELLINGS:
        ids = [tokenizer.convert_tokens_to_ids(token) for token in spelling]
        if all(isinstance(i, int) and i != unknown and tokenizer.convert_ids_to_tokens(i) == token
               for i, token in zip(ids, spelling, strict=True)):
            return ids[0], ids[1], ids[2]
    return None


def fim_prompt_ids(tokenizer: Any, tokens: tuple[int, int, int], prefix: str, suffix: str) -> list[int]:
    """The prompt's ids: the tokenizer's BOS where it starts plain text with one, then
    prefix token, ``prefix``, suffix token, ``suffix``, middle token."""
    start, hole, middle = tokens
    bos = tokenizer.bos_token_id
    opening = [bos] if bos is not None and tokenizer("x").input_ids[:1] == [bos] else []

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return [*opening, start, *encode(prefix), hole, *encode(suffix), middle]
