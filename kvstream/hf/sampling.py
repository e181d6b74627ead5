"""Per-request sampling over one step's logits: greedy, temperature, top-k, top-p, min-p,
seed, the logit adjustments (``logit_bias``, OpenAI's presence and frequency penalties,
llama.cpp's / Ollama's ``repeat_penalty``), and the log-probabilities a request asks for.

Each request keeps its own ``torch.Generator`` so a seeded request draws the same tokens
whatever else shares its batch (reproducible per request, as OpenAI's ``seed`` promises).
Adjustments apply before the choice, greedy included, in the order llama.cpp applies them
(bias, repeat penalty, then presence/frequency); log-probabilities are the model's own
distribution (log-softmax of the raw logits, as vLLM reports by default), whatever the
adjustments and temperature did to the choice, unless a request asks for the distribution
its tokens were drawn from (llama-server's ``post_sampling_probs``).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvstream.hf.lazy_grammar import Triggers

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
# Below this temperature a request is greedy (vLLM's rule): logits over a temperature near 0
# overflow float32 (1e-320 is 0 there: every logit infinite, the distribution NaN).
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_HELD_TOP_K = 1000  # most tokens judged for a held answer's post-sampling distribution


@dataclass
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` is greedy (argmax)."""

    max_tokens: int = 16  # 0: the prompt is computed (and scored) and nothing is generated
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    keep_first_logits: bool = False  # hand the first token's logits back (verification)
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    typical_p: float = 1.0  # locally typical sampling: keep this much mass of the tokens nearest the entropy
    presence_penalty: float = 0.0  # OpenAI: minus this from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this per time a token was generated
    repeat_penalty: float = 1.0  # llama.cpp: logits of the last repeat_last_n tokens / (or x) this
    repeat_last_n: int = 64  # prompt and output, as llama.cpp counts them; -1: the whole context
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the answer as the end of turn does
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely (k <= 20)
    # llama-server's post_sampling_probs: ``logprobs`` of the distribution the token was drawn
    # from (after the penalties, temperature, top-k, typical-p, top-p and min-p; greedy: the
    # chosen token, certain), the k most likely of it with any probability, not the model's.
    post_sampling_probs: bool = False
    # The same for each prompt token after the first (echo): the whole prompt is computed,
    # none of it taken from the prefix cache, since a cached position has no logits.
    prompt_logprobs: int | None = None
    json_object: bool = False  # JSON mode: only tokens that keep the output one JSON object (json_schema.JSON_OBJECT)
    json_schema: dict | None = None  # structured output: only JSON this schema admits (json_schema.py)
    # A client's expression the whole answer must match (a GBNF grammar's, vLLM's guided_regex
    # or guided_choice: guided.py), held to within a matching budget (pattern_constraint.py).
    pattern: str | None = None
    # The tokens a grammar references (token id, the character standing for it in ``pattern``).
    pattern_tokens: tuple[tuple[int, str], ...] = ()
    # llama-server's lazy grammar: the constraint above held only from one of these triggers
    # on (lazy_grammar.py); None: from the first token.
    triggers: Triggers | None = None
    # Special tokens written into the text (llama-server's ``preserved_tokens``); the text
    # leaves the others out.
    preserved_tokens: frozenset[int] = frozenset()
    # Most tokens inside a <think> block before its end is forced (thinking_budget.py); None:
    # no cap. ``thinking_opened``: the prompt left the block open.
    thinking_budget: int | None = None
    thinking_opened: bool = False

    @property
    def holds_answer(self) -> bool:
        """Whether a constraint holds the answer (JSON mode, a schema or an expression)."""
        return self.json_object or self.json_schema is not None or self.pattern is not None

    def __post_init__(self) -> None:
        # NaN passes every range check below (Python's json reads a client's NaN): named here.
        for name in ("temperature", "top_p", "min_p", "typical_p", "presence_penalty", "frequency_penalty", "repeat_penalty"):
            if math.isnan(getattr(self, name)):
                raise ValueError(f"{name} must be a number, not NaN")
        if self.logit_bias and any(map(math.isnan, self.logit_bias.values())):  # (one pass in C; inf and -inf allowed)
            raise ValueError("logit_bias values must be numbers, not NaN")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 <= self.top_p <= 1:
            raise ValueError("top_p must be in [0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.typical_p <= 1:
            raise ValueError("typical_p must be in [0, 1]")
        if self.repeat_penalty <= 0:
            raise ValueError("repeat_penalty must be > 0")
        if self.repeat_last_n < -1:
            raise ValueError("repeat_last_n must be >= -1")
        if self.json_object + (self.json_schema is not None) + (self.pattern is not None) > 1:
            raise ValueError("one constraint per answer: JSON mode, a schema or an expression")
        if self.post_sampling_probs and self.holds_answer and not 0 < self.top_k <= MAX_HELD_TOP_K:
            # A constraint draws from that distribution restricted to what it accepts: each
            # token that could be drawn is judged to compute it, so their number is bounded.
            raise ValueError(f"post_sampling_probs with a constraint on the answer (JSON, a grammar) needs top_k "
                             f"between 1 and {MAX_HELD_TOP_K} (the tokens judged for the distribution)")
        if self.thinking_budget is not None and self.thinking_budget < 0:
            raise ValueError("thinking_token_budget must be >= 0")
        for k in (self.logprobs, self.prompt_logprobs):
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` to look a token up in at every step (a client may list thousands)."""
        return frozenset(self.stop_token_ids)

    def bias_tensors(self, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``logit_bias`` as (token ids, biases) on ``device``, ids at or past ``vocab`` (the
        logits' width) left out; made once per request, not at every step: built from the
        dict each time, a whole vocabulary's bias cost 7 ms of Python per row per step, every
        stream's step slowed with it (benchmarks/logit_bias.py)."""
        key = (vocab, str(device))
        cached = self.__dict__.get("_bias_tensors")
        if cached is None or cached[0] != key:
            known = [i for i in self.logit_bias if i < vocab]  # ids past the logits (padding rows): nothing to bias
            ids = torch.tensor(known, dtype=torch.long, device=device)
            values = torch.tensor([self.logit_bias[i] for i in known], dtype=torch.float32, device=device)
            cached = self.__dict__["_bias_tensors"] = (key, ids, values)
        return cached[1], cached[2]

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before the choice (bias or a penalty)."""
        return bool(self.logit_bias) or bool(self.presence_penalty) or bool(self.frequency_penalty) or self.repeat_penalty != 1.0

    @property
    def greedy(self) -> bool:
        # top_p 0 keeps only the most likely token (OpenAI accepts it): greedy as well.
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1 or self.top_p == 0

    def make_generator(self, stream: int = 0) -> torch.Generator | None:
        """The random stream of one choice (``stream`` > 0 for a request's other choices:
        with a seed they stay reproducible and still differ from each other)."""
        if self.greedy:
            return None
        generator = torch.Generator()
        generator.manual_seed(self.seed + stream if self.seed is not None else random.getrandbits(63))
        return generator


@dataclass
class TokenLogprobs:
    """The chosen token's log-probability and the ``k`` most likely tokens' (id, logprob)."""

    logprob: float
    top: list[tuple[int, float]]


class Constraint(Protocol):
    """Which tokens may come next (``PatternConstraint``: JSON mode, structured outputs,
    grammars)."""

    def accepts(self, token_id: int) -> bool: ...

    def candidates(self, vocab: int) -> torch.Tensor:
        """A ``[vocab]`` mask holding every token ``accepts`` may say yes to (a superset)."""
        ...


# Draws a constrained sampling row tries before it takes the best acceptable token.
CONSTRAINED_TRIES = 64
# Tokens a constrained greedy row tries in the model's order before it masks the vocabulary.
CONSTRAINED_SCAN = 512


def first_accepted(scores: torch.Tensor, constraint: Constraint, best: int | None = None) -> int:
    """The highest-scoring token ``constraint`` accepts (the argmax when it accepts none,
    which a vocabulary holding every single byte never leaves it). ``best``: the argmax of
    ``scores`` where the caller has it."""
    best = int(scores.argmax()) if best is None else best
    if constraint.accepts(best):  # mostly so: no top few hundred sorted
        return best
    top = torch.topk(scores, min(CONSTRAINED_SCAN, scores.numel())).indices.tolist()
    for token in top:
        if constraint.accepts(token):
            return token
    # Past the model's best few hundred: only the candidates, best first (a forced key or
    # brace leaves a few hundred of the vocabulary; judging all 256 first bytes costs more
    # than the few hundred lookups above, most of them refused by a first byte already judged).
    ids = constraint.candidates(scores.numel()).to(scores.device).nonzero().squeeze(1)
    for token in ids[scores[ids].argsort(descending=True)].tolist():
        if constraint.accepts(token):
            return token
    return top[0]


def draw_accepted(probs: torch.Tensor, generator: torch.Generator | None, constraint: Constraint) -> int | None:
    """A draw from ``probs`` restricted to the tokens ``constraint`` accepts: rejected draws
    are removed and drawn again (the accepted token's odds are those of the restricted
    distribution). None when the accepted tokens hold none of the mass tried."""
    probs = probs.clone()
    for attempt in range(CONSTRAINED_TRIES):
        if float(probs.sum()) <= 0:
            return None
        token = _multinomial(probs, generator)
        if constraint.accepts(token):
            return token
        probs[token] = 0.0
        if attempt == 0:  # the model's choice is refused: draw among the candidates only
            probs = probs.masked_fill(~constraint.candidates(probs.numel()).to(probs.device), 0.0)
    return None


@dataclass
class History:
    """What a row's penalties read: its prompt's token ids and those generated so far."""

    prompt: list[int]
    output: list[int]


def adjust(scores: torch.Tensor, p: SamplingParams, history: History | None) -> torch.Tensor:
    """One row's logits after ``logit_bias`` and the penalties (a new tensor)."""
    scores = scores.clone()
    vocab, device = scores.numel(), scores.device
    if p.logit_bias:
        ids, values = p.bias_tensors(vocab, device)
        scores[ids] += values.to(scores.dtype)
    if history is None:
        return scores
    if p.repeat_penalty != 1.0:
        context = history.prompt + history.output
        recent = context if p.repeat_last_n == -1 else context[-p.repeat_last_n:] if p.repeat_last_n else []
        if recent:
            ids = torch.tensor(sorted(set(recent)), dtype=torch.long, device=device)
            values = scores[ids]
            scores[ids] = torch.where(values > 0, values / p.repeat_penalty, values * p.repeat_penalty)
    if (p.presence_penalty or p.frequency_penalty) and history.output:
        counts = torch.bincount(torch.tensor(history.output, dtype=torch.long, device=device), minlength=vocab)[:vocab].to(scores.dtype)
        scores -= counts * p.frequency_penalty + (counts > 0).to(scores.dtype) * p.presence_penalty
    return scores


class NoTokenToDraw(ValueError):
    """A row's own parameters left it no distribution to draw from (every token's mass NaN,
    say): that request ends with this error (a 400), the others in the step go on."""


UNDRAWN = -1  # a failed row's place in ``sample``'s tokens


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
    histories: list[History | None] | None = None, constraints: list[Constraint | None] | None = None,
    forced: list[int | None] | None = None, drawn_from: dict[int, torch.Tensor] | None = None,
    failed: dict[int, Exception] | None = None,
) -> list[int]:
    """One token per row of ``logits`` ``[N, vocab]``; ``histories`` (per row) feed the
    penalties of the rows that have them, ``constraints`` (per row) limit what they choose,
    and a row's ``forced`` token (a thinking budget's closing text) is taken as it is.
    ``drawn_from``, where given, gets each row whose params ask for logprobs with
    ``post_sampling_probs``: the (unnormalized) probabilities its token was drawn from, on
    the CPU. A row whose choice raises (NoTokenToDraw, or what its constraint raised) raises,
    or, where ``failed`` is given, goes there with ``UNDRAWN`` for its token: one request's
    fault is not every request's in its step."""
    logits = logits.float()
    tokens: list[int] = []
    greedy = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        try:
            token, probs = _row_token(
                logits[row], p, gen, histories[row] if histories is not None else None,
                constraints[row] if constraints is not None else None,
                forced[row] if forced is not None else None, greedy[row],
                drawn_from is not None and p.post_sampling_probs and p.logprobs is not None)
        except Exception as exc:
            if failed is None:
                raise
            failed[row] = exc
            tokens.append(UNDRAWN)
            continue
        tokens.append(token)
        if probs is not None:
            assert drawn_from is not None
            drawn_from[row] = probs
    return tokens


def _row_token(scores: torch.Tensor, p: SamplingParams, gen: torch.Generator | None, history: History | None,
               constraint: Constraint | None, forced: int | None, greedy: int, wants_drawn: bool,
               ) -> tuple[int, torch.Tensor | None]:
    """One row's token and, if ``wants_drawn``, the probabilities it was drawn from."""
    probs = None  # what a sampled row draws from (a held one: before the constraint's restriction)
    if forced is not None:
        token = forced
    elif not p.greedy:
        if p.adjusts_logits:
            scores = adjust(scores, p, history)
        probs = filtered(scores, p).cpu()
        if constraint is None:
            token = _multinomial(probs, gen)
        else:
            drawn = draw_accepted(probs, gen, constraint)
            # Nothing acceptable where top-k / top-p / min-p left mass: the model's best acceptable.
            token = drawn if drawn is not None else first_accepted(scores, constraint)
    else:
        if p.adjusts_logits:
            scores = adjust(scores, p, history)
        if constraint is not None:
            token = first_accepted(scores, constraint, None if p.adjusts_logits else greedy)
        else:
            token = int(scores.argmax()) if p.adjusts_logits else greedy
    if not wants_drawn:
        return token, None
    if constraint is not None and probs is not None:
        # What the draw above samples (by rejection): the filtered distribution restricted
        # to the tokens the constraint accepts.
        probs = accepted_only(probs, constraint)
        if float(probs[token]) <= 0:  # (none held mass: the model's best acceptable, certain)
            probs = None
    # Greedy or forced: certain.
    return token, probs if probs is not None else torch.zeros(scores.numel()).index_fill_(0, torch.tensor([token]), 1.0)


def _multinomial(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from ``probs``; NoTokenToDraw where they are no distribution (NaN, no mass)."""
    try:
        return int(torch.multinomial(probs, 1, generator=generator).item())
    except RuntimeError as exc:  # torch's "probability tensor contains either inf, nan or element < 0"
        raise NoTokenToDraw(f"The request's sampling parameters leave no token to draw ({exc}).") from None


def accepted_only(probs: torch.Tensor, constraint: Constraint) -> torch.Tensor:
    """``probs`` with every token ``constraint`` refuses at zero."""
    kept = torch.zeros_like(probs)
    ids = probs.nonzero().squeeze(1).tolist()
    accepted = [token for token in ids if constraint.accepts(token)]
    if accepted:
        index = torch.tensor(accepted)
        kept[index] = probs[index]
    return kept


def filtered(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The probabilities a sampled row draws from (unnormalized): ``scores`` (its logits,
    adjusted) over the temperature, then top-k, typical-p, top-p and min-p, in llama.cpp's
    order."""
    # A repeat penalty near 0 (llama.cpp takes any above 0) makes logits infinite: the largest
    # finite ones instead, so that softmax still gives a distribution (theirs, shared).
    scores = (scores / p.temperature).clamp_(max=torch.finfo(scores.dtype).max)
    if p.top_k:
        kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.typical_p < 1.0:  # after top-k and before top-p, as llama.cpp orders them
        probs = typical(probs, p.typical_p)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(-1)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = cumulative - sorted_probs >= p.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if p.min_p > 0:  # after top-p, as llama.cpp orders them (the most likely token always stays)
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def typical(probs: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al., 2022; transformers' ``typical_p``, llama.cpp's
    ``typ_p``): keep the tokens whose information ``-log p`` is nearest the distribution's
    entropy, nearest first, until they hold ``mass`` of the probability (at least one)."""
    log_probs = torch.log(probs)
    entropy = -(probs * log_probs.nan_to_num(neginf=0.0)).sum()  # (a token with p = 0 adds nothing)
    order = torch.argsort((-log_probs - entropy).abs())  # p = 0: infinitely far, last
    sorted_probs = probs[order]
    drop = sorted_probs.cumsum(-1) - sorted_probs >= mass
    drop[0] = False
    return probs.masked_fill(torch.zeros_like(drop).scatter_(0, order, drop), 0.0)


def drawn_logprobs(probs: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """``token``'s log-probability under ``probs`` (what it was drawn from, unnormalized) and
    the ``k`` most likely tokens' there, only those it could have drawn."""
    probs = probs / probs.sum()
    values, ids = probs.topk(min(k, int((probs > 0).sum())))
    return TokenLogprobs(math.log(float(probs[token])), list(zip(ids.tolist(), values.log().tolist(), strict=True)))


def logprobs_of(logits: torch.Tensor, rows: list[int], tokens: list[int], k: list[int]) -> list[TokenLogprobs]:
    """For each of ``rows`` of ``logits``: the log-probability of ``tokens[i]`` (the one chosen
    there) and the ``k[i]`` most likely tokens', under the model's own distribution."""
    if not rows:
        return []
    picked = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)].float(), dim=-1).cpu()
    widest = max(k)
    top_values, top_ids = (picked.topk(widest, dim=-1) if widest else (None, None))
    out = []
    for i, (token, kk) in enumerate(zip(tokens, k, strict=True)):
        top = list(zip(top_ids[i, :kk].tolist(), top_values[i, :kk].tolist(), strict=True)) if kk else []
        out.append(TokenLogprobs(float(picked[i, token]), top))
    return out
