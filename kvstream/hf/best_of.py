"""``best_of``: candidates generated, the most likely returned (OpenAI's completions field).

OpenAI's contract: "Generates best_of completions server-side and returns the 'best' (the
one with the highest log probability per token). Results cannot be streamed." With ``n``,
the ``n`` best of the ``best_of`` candidates are returned, best first. The candidates are
the request's choices (the prompt computed once and forked, as for ``n``); each is scored
by the mean log-probability of the tokens it sampled under the model's distribution, its
end-of-turn token included (a candidate that stops where the model expects it to is not
penalised for the stop). Usage counts every candidate's tokens: they were all generated,
as OpenAI bills them.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from kvstream.types import Token


class Candidates:
    """Holds a request's candidates until the last one ends, then gives out the ``keep``
    best, indexed 0..keep-1 in order of score (ties: the earlier candidate first)."""

    def __init__(self, keep: int, with_logprobs: bool) -> None:
        self.keep = keep
        # The engine computes each sampled token's log-probability to score the candidates;
        # they go out only where the client asked for them.
        self.with_logprobs = with_logprobs
        self._tokens: dict[int, list[Token]] = defaultdict(list)
        self._logprob_sums: dict[int, float] = defaultdict(float)
        self._sampled: dict[int, int] = defaultdict(int)

    def score(self, index: int, logprob: float) -> None:
        """Candidate ``index`` sampled a token of log-probability ``logprob``."""
        self._logprob_sums[index] += logprob
        self._sampled[index] += 1

    def add(self, token: Token) -> None:
        """A token of candidate ``token.index`` (its end included), held."""
        self._tokens[token.index].append(token if self.with_logprobs else dataclasses.replace(token, token_logprobs=None))

    def mean_logprob(self, index: int) -> float:
        sampled = self._sampled[index]
        return self._logprob_sums[index] / sampled if sampled else float("-inf")

    def ranking(self) -> list[int]:
        """Every candidate's index, the most likely per token first."""
        return sorted(self._tokens, key=lambda index: (-self.mean_logprob(index), index))

    def best(self, last: Token) -> list[Token]:
        """The kept candidates' tokens in order, reindexed; ``last`` (the token that ended the
        stream: the last candidate to finish, with the usage of all) ends the last kept one,
        and each other kept one ends with its ``choice_finish_reason``. The answer comes back
        whole, so its tokens are ``replayed`` (the engine does not time them as generated)."""
        self.add(last)
        out: list[Token] = []
        kept = self.ranking()[: self.keep]
        for rank, index in enumerate(kept):
            *body, end = self._tokens[index]
            out.extend(dataclasses.replace(token, index=rank, replayed=True) for token in body)
            reason = end.choice_finish_reason or end.finish_reason
            stop_sequence = end.stop_sequence
            if rank < len(kept) - 1:
                out.append(Token(index=rank, choice_finish_reason=reason, stop_sequence=stop_sequence))
            else:
                out.append(dataclasses.replace(last, index=rank, finish_reason=reason, stop_sequence=stop_sequence,
                                               choice_finish_reason=None))
        return out
