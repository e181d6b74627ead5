"""Fill-in-the-middle: a completion written between a prompt and a ``suffix`` (OpenAI's
completions field, Ollama's generate field), what code-completion plugins send when the
cursor has code on both sides.

Code models are trained on it with three special tokens: the prompt is the prefix token,
the text before the cursor, the suffix token, the text after it, and the middle token,
after which the model writes what goes between and ends its turn (the prefix-suffix-middle
order, llama.cpp's ``/infill`` and Ollama's templates build the same), or a token that ends
it as well (``ENDS``). A model has FIM when its tokenizer holds one of the known spellings as
single tokens; any other gets a 400.

llama-server's ``/infill`` adds the repository-level form (``infill_prompt_ids``): other files'
text before the prefix, each after the file separator token and its name, the whole under
the repository token, as Qwen2.5-Coder was trained (arXiv 2409.12186); with neither token,
each file's text after a plain "snippet" line.
"""

from __future__ import annotations

from dataclasses import dataclass
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
# The repository and file separator tokens of the repository-level form, as each family spells them.
REPO_SPELLINGS = ("<|repo_name|>", "<repo_name>", "<reponame>")
FILE_SPELLINGS = ("<|file_sep|>", "<file_sep>")
# Between other files' texts where the model has no file separator (llama-server's).
SNIPPET_LINE = "\n\n--- snippet ---\n\n"
# The repository and the current file's names the form needs, as llama-server fills them in.
REPO_NAME, FILE_NAME = "myproject", "filename"


def _single_ids(tokenizer: Any, spellings: tuple[str, ...]) -> list[int]:
    """The ids of those of ``spellings`` the tokenizer holds as single tokens, in order."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    ids = [(tokenizer.convert_tokens_to_ids(token), token) for token in spellings]
    return [i for i, token in ids if isinstance(i, int) and i != unknown and tokenizer.convert_ids_to_tokens(i) == token]


def end_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids of ``ENDS`` the tokenizer has, as single tokens."""
    return tuple(_single_ids(tokenizer, ENDS))


def fim_tokens(tokenizer: Any) -> tuple[int, int, int] | None:
    """The ids of the tokenizer's prefix, suffix and middle tokens, or None if it has none."""
    for spelling in SPELLINGS:
        ids = _single_ids(tokenizer, spelling)
        if len(ids) == 3:
            return ids[0], ids[1], ids[2]
    return None


def fim_prompt_ids(tokenizer: Any, tokens: tuple[int, int, int], prefix: str, suffix: str) -> list[int]:
    """The prompt's ids: the tokenizer's BOS where it starts plain text with one, then
    prefix token, ``prefix``, suffix token, ``suffix``, middle token."""
    start, hole, middle = tokens
    return [*_opening(tokenizer), start, *_encode(tokenizer, prefix), hole, *_encode(tokenizer, suffix), middle]


def _opening(tokenizer: Any) -> list[int]:
    """The BOS, where the tokenizer starts plain text with one."""
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and tokenizer("x").input_ids[:1] == [bos] else []


def _encode(tokenizer: Any, text: str, parse_special: bool = True) -> list[int]:
    """``text``'s ids, nothing added; ``parse_special`` False: special tokens' spellings stay text."""
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=not parse_special).input_ids)


@dataclass(frozen=True)
class InfillWindow:
    """How much of each part an ``/infill`` prompt keeps, as llama-server sizes it from its
    batch, context and ``n_predict``: the prefix's last 3/4 of a batch, the suffix's first
    quarter less the prompt, and other files' last tokens in what the context leaves after a
    batch and twice the tokens to write."""

    batch: int
    context: int
    n_predict: int

    @property
    def prefix(self) -> int:
        return 3 * (self.batch // 4)

    def suffix(self, prompt_tokens: int) -> int:
        return max(0, self.batch // 4 - (2 + prompt_tokens))

    @property
    def other_files(self) -> int:
        return max(0, self.context - self.batch - 2 * self.n_predict)


def infill_prompt_ids(tokenizer: Any, tokens: tuple[int, int, int], prefix: str, suffix: str,
                      other_files: list[tuple[str, str]], prompt: str, window: InfillWindow) -> list[int]:
    """llama-server's ``/infill`` prompt: other files' texts (``(file name, text)``, the
    repository-level form where the model has its tokens), then [BOS,] prefix token,
    ``prefix`` and ``prompt`` (the start of the line being written), suffix token, ``suffix``,
    middle token; each part cut to ``window`` (the prefix and the other files keep their last
    tokens, the suffix its first). Special tokens' spellings stay text, but in ``prompt``."""
    start, hole, middle = tokens
    repo, file_sep = _single_ids(tokenizer, REPO_SPELLINGS)[:1], _single_ids(tokenizer, FILE_SPELLINGS)[:1]

    def plain(text: str) -> list[int]:
        return _encode(tokenizer, text, parse_special=False)

    context: list[int] = [*repo, *plain(REPO_NAME + "\n")] if repo else []
    for name, text in other_files:
        context += [*file_sep, *plain(name + "\n")] if file_sep else plain(SNIPPET_LINE)
        context += plain(text)
    if file_sep:
        context += [*file_sep, *plain(FILE_NAME + "\n")]
    before, after, written = plain(prefix), plain(suffix), _encode(tokenizer, prompt)
    before = before[max(0, len(before) - window.prefix):]
    after = after[:window.suffix(len(written))]
    kept_context = context[len(context) - min(window.other_files, len(context)):]
    return [*kept_context, *_opening(tokenizer), start, *before, *written, hole, *after, middle]


def missing_tokens(tokenizer: Any) -> str:
    """Why the model cannot fill in the middle, as llama-server words it (one clause per
    token it lacks), for its 501."""
    missing = []
    for i, part in enumerate(("prefix", "suffix", "middle")):
        if not any(_single_ids(tokenizer, (spelling[i],)) for spelling in SPELLINGS):
            missing.append(f"{part} token is missing. ")
    return "".join(missing) or "its prefix, suffix and middle tokens are not of one family. "
