"""Embeddings from the in-process model, for ``/v1/embeddings`` and Ollama's ``/api/embed``.

A causal LM has no pooling head of its own, so an input's vector is its last hidden state
(after the model's final norm) averaged over the input's tokens and scaled to unit length,
the way sentence-transformers pools a plain encoder and Ollama returns its vectors
(normalized). Mean pooling, not the last token: every token of a causal model sees only
those before it, and the average weighs the whole input.

An input runs through the decoder alone (no LM head, no paged KV: a DynamicCache of its own,
dropped after) in chunks of CHUNK_TOKENS, each chunk one job of
ModelRunner.run_between_steps on the engine thread: embeddings interleave with the running
generations, and a long input holds the engine for one chunk at a time, never for the whole
input (8,000 tokens are ~15 s on two cores). Short inputs of a request run together
(``EmbeddingBatch``): sorted by length and packed into padded forwards of at most
CHUNK_TOKENS padded tokens, one job each, since one 16-token input alone is mostly overhead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kvstream.hf import compat

CHUNK_TOKENS = 256  # tokens a job computes: ~0.3-0.5 s of the engine thread on two cores


class Embedding:
    """One input's embedding, computed a chunk per ``step()`` (on the engine thread)."""

    def __init__(self, model: torch.nn.Module, token_ids: list[int], chunk_tokens: int = CHUNK_TOKENS,
                 counted: Callable[[int], None] | None = None) -> None:
        self.model = model
        self.counted = counted  # told each chunk's tokens once computed (the runner's counters)
        self.token_ids = token_ids
        self.chunk_tokens = chunk_tokens
        self.done_tokens = 0
        self._cache: Any = None
        self._sum: torch.Tensor | None = None  # of the hidden states so far, float32

    def step(self) -> list[list[float]] | None:
        """Compute the next chunk; [the unit-length mean] once the last one is done, else None."""
        device = next(self.model.parameters()).device
        start = self.done_tokens
        chunk = torch.tensor([self.token_ids[start:start + self.chunk_tokens]], device=device)
        with torch.inference_mode():
            if self._cache is None:
                self._cache = compat.new_cache(self.model)
            part = compat.decoder_hidden_states(self.model, chunk, start, self._cache).float().sum(0)
            self._sum = part if self._sum is None else self._sum + part
            self.done_tokens += chunk.shape[1]
            if self.counted is not None:
                self.counted(chunk.shape[1])
            if self.done_tokens < len(self.token_ids):
                return None
            self._cache = None
            return [F.normalize(self._sum / len(self.token_ids), dim=0).tolist()]


class EmbeddingBatch:
    """Several short inputs' embeddings, computed by one ``step()``: one padded forward."""

    def __init__(self, model: torch.nn.Module, token_lists: list[list[int]],
                 counted: Callable[[int], None] | None = None) -> None:
        self.model = model
        self.token_lists = token_lists
        self.counted = counted

    def step(self) -> list[list[float]]:
        """Every input's unit-length mean, in order."""
        with torch.inference_mode():
            states = compat.padded_hidden_states(self.model, self.token_lists)
            vectors = [F.normalize(hidden.float().mean(0), dim=0).tolist() for hidden in states]
        if self.counted is not None:
            self.counted(sum(map(len, self.token_lists)))
        return vectors


def jobs(token_lists: list[list[int]], budget: int = CHUNK_TOKENS) -> list[list[int]]:
    """The inputs (their indices) grouped into what runs together: inputs sorted by length,
    each group as many as fit ``budget`` padded tokens (its count times its longest); an
    input longer than the budget alone (it runs a chunk at a time)."""
    groups: list[list[int]] = []
    for index in sorted(range(len(token_lists)), key=lambda i: len(token_lists[i])):
        length = len(token_lists[index])  # the longest so far: sorted
        if groups and (len(groups[-1]) + 1) * length <= budget:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def work(model: torch.nn.Module, token_lists: list[list[int]], group: list[int],
         counted: Callable[[int], None] | None = None) -> Embedding | EmbeddingBatch:
    """What computes ``group`` (jobs' indices into ``token_lists``): one input a chunk at a
    time, or several in one padded forward."""
    if len(group) == 1:
        return Embedding(model, token_lists[group[0]], counted=counted)
    return EmbeddingBatch(model, [token_lists[i] for i in group], counted=counted)
