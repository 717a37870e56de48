"""The target's distribution as a request defines it, and what we report about it.

Penalties and `logit_bias` change *which distribution* the target decodes from, so they are
applied to the target's logits at every row of a verification, before greedy or rejection-sampling
verification. Row i of a verification follows draft[:i], so its token counts are the output's plus
those of draft[:i]; plain decode (one row, no draft) sees exactly the same counts. Hence every method
still emits what plain decoding with the same penalties would (lossless with respect to the
penalised distribution).

    presence_penalty    logit[t] -= p          for every t already in the output  (OpenAI, -2..2)
    frequency_penalty   logit[t] -= f * c[t]   c[t]: how often t is in the output  (OpenAI, -2..2)
    logit_bias          logit[t] += b[t]                                            (OpenAI, -100..100)

As in vLLM, the counts cover the generated tokens, not the prompt.

`token_logprobs` reports per emitted token its log-probability and the top-n alternatives under
that same penalised distribution (before temperature, top-k/top-p and grammar masks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LogitAdjustments:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


class Penalizer:
    """One request's token counts and the adjustment they imply."""

    def __init__(self, adjust: LogitAdjustments, vocab_size: int):
        self.adjust = adjust
        self.counts = torch.zeros(vocab_size, dtype=torch.float64)
        self.bias = torch.zeros(vocab_size, dtype=torch.float64)
        for tok, b in adjust.logit_bias.items():
            self.bias[tok] = b

    def apply(self, logits: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
        """Adjusted copy of target logits [k+1, V] for a verification of `draft` [k]."""
        rows = logits.shape[0]
        # counts[i] = output counts + counts of draft[:i] (row i comes after those draft tokens)
        counts = self.counts.expand(rows, -1).clone()
        if draft.numel():
            seen = torch.zeros(rows, counts.shape[1], dtype=counts.dtype)
            seen[torch.arange(1, rows), draft[: rows - 1]] = 1.0
            counts += seen.cumsum(0)
        delta = self.bias - self.adjust.frequency_penalty * counts \
            - self.adjust.presence_penalty * (counts > 0).to(counts.dtype)
        return logits + delta.to(logits.dtype)

    def add(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.counts[tok] += 1


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the n most likely tokens with their log-probabilities, best first


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """Per token i, its log-probability under row i of `logits` [>= len(tokens), V], and the top n."""
    lp = torch.log_softmax(logits[: len(tokens)].double(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if top_n:
        values, ids = lp.topk(top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, c, top) for t, c, top in zip(tokens, chosen, tops)]
