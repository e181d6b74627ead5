"""Per-request sampling over one step's logits: greedy, temperature, top-k, top-p, seed.

Each request keeps its own ``torch.Generator`` so a seeded request draws the same tokens
whatever else shares its batch (reproducible per request, as OpenAI's ``seed`` promises).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` is greedy (argmax)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    keep_first_logits: bool = False  # hand the first token's logits back (verification)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 <= self.top_p <= 1:
            raise ValueError("top_p must be in [0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")

    @property
    def greedy(self) -> bool:
        # top_p 0 keeps only the most likely token (OpenAI accepts it): greedy as well.
        return self.temperature == 0 or self.top_k == 1 or self.top_p == 0

    def make_generator(self, stream: int = 0) -> torch.Generator | None:
        """The random stream of one choice (``stream`` > 0 for a request's other choices:
        with a seed they stay reproducible and still differ from each other)."""
        if self.greedy:
            return None
        generator = torch.Generator()
        generator.manual_seed(self.seed + stream if self.seed is not None else random.getrandbits(63))
        return generator


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` ``[N, vocab]``."""
    logits = logits.float()
    tokens: list[int] = []
    greedy = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            tokens.append(greedy[row])
            continue
        scores = logits[row] / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = sorted_probs.cumsum(-1)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            drop = cumulative - sorted_probs >= p.top_p
            drop[0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        tokens.append(int(torch.multinomial(probs.cpu(), 1, generator=gen).item()))
    return tokens
