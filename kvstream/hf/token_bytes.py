"""The bytes each token id stands for, and a generated token's log-probabilities as a
runtime-neutral ``TokenLogprob`` (each API renders its own shape).

A byte-level BPE vocabulary (GPT-2's, Llama 3's, SmolLM2's) spells bytes with printable
characters; its tokens may hold part of a character, so a token's text is its bytes decoded
(a partial character shows as U+FFFD) and a client joins ``bytes`` for the exact text.
SentencePiece vocabularies spell bytes as ``<0xHH>`` and spaces as U+2581.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from kvstream.hf.sampling import TokenLogprobs
from kvstream.types import TokenLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Byte-level BPE's alphabet: printable bytes stand for themselves, the other 68 bytes
    for the characters from U+0100 up, in byte order (the GPT-2 scheme)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


@functools.cache
def _byte_alphabet() -> tuple[frozenset[str], dict[int, int]]:
    """Byte-level BPE's characters, and the table turning each into the code point of its
    byte (then encoded as Latin-1: the bytes themselves), for ``str.translate``."""
    table = _unicode_to_byte()
    return frozenset(table), {ord(ch): byte for ch, byte in table.items()}


def _piece_bytes(piece: str | None) -> bytes:
    """The bytes a vocabulary's piece spells (none for an id the tokenizer does not know)."""
    piece = piece or ""
    alphabet, to_latin1 = _byte_alphabet()
    if (match := _BYTE_TOKEN.fullmatch(piece)) is not None:
        return bytes([int(match.group(1), 16)])
    if piece and alphabet.issuperset(piece):
        return piece.translate(to_latin1).encode("latin-1")
    return piece.replace("\u2581", " ").encode()  # SentencePiece pieces: U+2581 is a space


class TokenBytes:
    """A tokenizer's token ids -> bytes, remembered as they are asked for."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is not None:
            return cached
        raw = self._bytes[token_id] = _piece_bytes(self._piece(token_id))
        return raw

    def _piece(self, token_id: int) -> str | None:
        try:
            return self.tokenizer.convert_ids_to_tokens(token_id)
        except (IndexError, KeyError, ValueError):  # a slow tokenizer, past its own length (a padded vocabulary)
            return None

    def spell_all(self, vocab: int) -> None:
        """Remember the bytes of every id below ``vocab``, asked of the tokenizer in one call
        (one id a call, SmolLM2's 49,152 took 0.12 s, 0.4 s beside other work, on the
        engine's thread the first time a constraint needed every token's first byte); one
        id a call where the tokenizer refuses some of them."""
        try:
            pieces = self.tokenizer.convert_ids_to_tokens(list(range(vocab)))
        except (IndexError, KeyError, ValueError):
            pieces = [self._piece(token_id) for token_id in range(vocab)]
        for token_id, piece in enumerate(pieces):
            if token_id not in self._bytes:
                self._bytes[token_id] = _piece_bytes(piece)

    def entry(self, token_id: int, logprob: float | None) -> TokenLogprob:
        raw = self(token_id)
        return TokenLogprob(raw.decode("utf-8", errors="replace"), logprob, list(raw), token_id=token_id)

    def logprob(self, token_id: int, logprobs: TokenLogprobs) -> TokenLogprob:
        """Token ``token_id``'s log-probability and its alternatives, as the APIs take them."""
        chosen = self.entry(token_id, logprobs.logprob)
        chosen.top = [self.entry(tid, lp) for tid, lp in logprobs.top]
        return chosen


# id(spelling) -> (spelling, each token id's first byte, 256 for none): the spelling is held
# so that its id is not reused while the table is cached.
_FIRST_BYTES: dict[int, tuple[Callable[[int], bytes], torch.Tensor]] = {}
_FIRST_BYTES_KEPT = 4


def first_bytes(token_bytes: Callable[[int], bytes], vocab: int) -> torch.Tensor:
    """Each token id's first byte below ``vocab`` (256 for a token with no bytes), read once
    per spelling and vocabulary size (the server reads it at start: read at a request's first
    constrained step, it paused every stream for the tenths of a second it takes)."""
    entry = _FIRST_BYTES.get(id(token_bytes))
    if entry is None or entry[0] is not token_bytes or entry[1].numel() != vocab:
        if isinstance(token_bytes, TokenBytes):
            token_bytes.spell_all(vocab)
        table = torch.tensor([raw[0] if (raw := token_bytes(i)) else 256 for i in range(vocab)], dtype=torch.long)
        if len(_FIRST_BYTES) >= _FIRST_BYTES_KEPT:
            _FIRST_BYTES.pop(next(iter(_FIRST_BYTES)))
        entry = _FIRST_BYTES[id(token_bytes)] = (token_bytes, table)
    return entry[1]


def first_byte_mask(token_bytes: Callable[[int], bytes], allowed: Iterable[int], vocab: int) -> torch.Tensor:
    """A ``[vocab]`` boolean mask of the token ids whose first byte is in ``allowed`` (a token
    with no bytes never is): all a constraint that admits only those bytes next can take."""
    admitted = torch.zeros(257, dtype=torch.bool)
    admitted[torch.tensor(sorted(set(allowed)), dtype=torch.long)] = True
    return admitted[first_bytes(token_bytes, vocab)]
