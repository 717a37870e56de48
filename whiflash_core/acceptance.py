"""Expected gain of a draft before drafting it: how many tokens a round will emit.

A round that drafts k tokens emits a + 1 (a accepted drafts, then the target's own token). With
p_i the probability that draft token i is accepted given that tokens 1..i-1 were, the expected
emitted tokens are

    g(k) = 1 + sum_{i=1..k} prod_{j=1..i} p_j

Each request keeps, per drafter, exponentially weighted per-position rates p_i learned from its
own rounds (a round with k drafts and a accepted says "accepted" for positions 1..a and
"rejected" for position a+1, and nothing about later ones). The rates are kept per *situation*,
what is known before drafting:

- neural drafters (EAGLE-3, DFlash): the target's top-1 probability at the last accepted position,
  in TOP1_BINS (a confident target means predictable text, where drafts run longer);
- prompt lookup: the length of the suffix n-gram that matched (a 3-token match is far less often
  chance than a 2-token one).

A situation seen rarely borrows from the drafter's rates over all situations, and those from a
prior, in proportion to how much each has been observed (shrinkage with PRIOR_WEIGHT pseudo
rounds), so the first rounds of a request are not decided by one lucky or unlucky draft.
"""
from __future__ import annotations

import json
import os
from bisect import bisect_right
from dataclasses import dataclass, field

import torch

from . import decode_ops

TOP1_BINS = (0.5, 0.8, 0.95)   # situation edges on the target's top-1 probability
RATE_DECAY = 0.9                # weight of the past per observation of a position
PRIOR_WEIGHT = 2.0              # pseudo observations behind the prior and the drafter-wide rates
# prior per-position acceptance before a request has any rounds (only a starting point: a few
# rounds of the request's own text outweigh it)
PRIOR_RATE = {"ngram": 0.5}
DEFAULT_PRIOR_RATE = 0.6


@dataclass
class PositionRates:
    """Per-position acceptance rates p_1, p_2, ... with the decayed observation weight of each."""
    rates: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)

    def update(self, k: int, accepted: int, decay: float = RATE_DECAY) -> None:
        for i in range(min(accepted + 1, k)):   # positions 1..a accepted, a+1 rejected (if drafted)
            if i == len(self.rates):
                self.rates.append(0.0)
                self.weights.append(0.0)
            hit = 1.0 if i < accepted else 0.0
            w = decay * self.weights[i] + 1.0
            self.rates[i] += (hit - self.rates[i]) / w   # weighted mean of decayed observations
            self.weights[i] = w

    def shrunk(self, fallback: list[float], weight: float = PRIOR_WEIGHT) -> list[float]:
        """These rates pulled towards `fallback` by `weight` pseudo observations per position."""
        out = []
        for i, base in enumerate(fallback):
            if i < len(self.rates):
                w = self.weights[i]
                out.append((w * self.rates[i] + weight * base) / (w + weight))
            else:
                out.append(base)
        return out


def expected_tokens(rates: list[float], k: int) -> float:
    """g(k) = 1 + sum_{i<=k} prod_{j<=i} p_j (tokens a round with k drafts emits)."""
    g, survive = 1.0, 1.0
    for p in rates[:k]:
        survive *= p
        g += survive
    return g


def expected_tokens_by_k(rates: list[float], k_max: int) -> list[float]:
    """[g(0), g(1), ..., g(k_max)] in one pass."""
    out, survive = [1.0], 1.0
    for p in rates[:k_max]:
        survive *= p
        out.append(out[-1] + survive)
    return out


def top1_probability(logits: torch.Tensor) -> float:
    """The target's top-1 probability from its logits [V]: 1 / sum(exp(l - max l))."""
    stats = decode_ops.softmax_stats(logits)
    if stats is not None:
        return stats[1]
    return float(1.0 / torch.exp(logits.float() - logits.max().float()).sum())


def entropy_and_top1(logits: torch.Tensor) -> tuple[float, float]:
    """The target's entropy (nats) and top-1 probability from its logits [V]: one C pass over a
    float32 CPU row (decode_ops.softmax_stats), else one softmax and one host read."""
    stats = decode_ops.softmax_stats(logits)
    if stats is not None:
        return stats
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    entropy, top1 = torch.stack([-(p * logp).sum(), p.max()]).tolist()
    return entropy, top1


def situation(drafter: str, top1: float, match: int) -> int:
    """The bucket a round falls in before drafting (see the module docstring)."""
    return match if drafter == "ngram" else bisect_right(TOP1_BINS, top1)


COPY_RUN_BINS = (3, 4, 8, 16)   # situation edges on prompt lookup's copy run (NgramDrafter.copy_run)


def load_copy_prior(path: str) -> dict[int, list[float]] | None:
    """The per-situation rates of a copy_prior.json (`whiflash train copy-prior`), or None where
    there is none or it was counted in other situations than COPY_RUN_BINS."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    if raw.get("copy_run_bins") != list(COPY_RUN_BINS):
        return None
    return {int(w): [float(x) for x in r] for w, r in raw["rates"].items()}


def copy_situation(run: int) -> int:
    """The routers' bucket for a prompt-lookup draft: how long the copy has run (2, 3, 4-7, 8-15,
    16+ tokens). Its acceptance is observed every round whatever drafted (Router.observe), so
    these rates see every length of draft, not only the lengths the router chose."""
    return bisect_right(COPY_RUN_BINS, run)


class AcceptanceModel:
    """One request's acceptance history per drafter and situation. `priors`: measured starting
    rates per situation (a situation with one starts there, not at the drafter-wide rates)."""

    def __init__(self, priors: dict[int, list[float]] | None = None):
        self.overall: dict[str, PositionRates] = {}
        self.by_situation: dict[tuple[str, int], PositionRates] = {}
        self.priors = priors or {}
        # rates(), gains() and summary() per drafter, keyed (which, situation, k), until the
        # drafter's next update: the routers ask for every drafter's every round, and most rounds
        # update one drafter or none
        self._memo: dict[str, dict[tuple[str, int, int], object]] = {}

    def rates(self, drafter: str, where: int, k_max: int) -> list[float]:
        """p_1..p_k_max for `drafter` in situation `where` (the list may be shared between calls:
        read it, do not change it)."""
        memo = self._memo.setdefault(drafter, {})
        out = memo.get(("rates", where, k_max))
        if out is None:
            out = memo[("rates", where, k_max)] = self._rates(drafter, where, k_max)
        return out

    def gains(self, drafter: str, where: int, k_max: int) -> list[float]:
        """[g(0), ..., g(k_max)] of `rates` (expected_tokens_by_k), kept like them (shared: read it)."""
        memo = self._memo.setdefault(drafter, {})
        out = memo.get(("gains", where, k_max))
        if out is None:
            out = memo[("gains", where, k_max)] = expected_tokens_by_k(self.rates(drafter, where, k_max), k_max)
        return out

    def summary(self, drafter: str, where: int, k: int) -> tuple[float, float, float]:
        """(p_1, (g(k) - 1) / k, w / (w + PRIOR_WEIGHT)) for `drafter` in situation `where`, w its
        `observed` weight there: the learned router's scalars per drafter (router_mlp.scalar_features),
        kept like `rates` until the drafter's next update."""
        memo = self._memo.setdefault(drafter, {})
        out = memo.get(("summary", where, k))
        if out is None:
            rates, seen = self.rates(drafter, where, k), self.observed(drafter, where)
            out = memo[("summary", where, k)] = (rates[0], (expected_tokens(rates, k) - 1.0) / k, seen / (seen + PRIOR_WEIGHT))
        return out

    def _rates(self, drafter: str, where: int, k_max: int) -> list[float]:
        measured = self.priors.get(where)
        if measured:   # past its last position the prior keeps its last rate
            prior = (measured + measured[-1:] * k_max)[:k_max]
            return self.by_situation.get((drafter, where), PositionRates()).shrunk(prior)
        prior = [PRIOR_RATE.get(drafter, DEFAULT_PRIOR_RATE)] * k_max
        overall = self.overall.get(drafter, PositionRates()).shrunk(prior)
        return self.by_situation.get((drafter, where), PositionRates()).shrunk(overall)

    def observed(self, drafter: str, where: int) -> float:
        """Decayed rounds behind `drafter`'s first-position rate in situation `where` (0: only the
        prior and the drafter-wide rates speak)."""
        rates = self.by_situation.get((drafter, where))
        return rates.weights[0] if rates is not None and rates.weights else 0.0

    def update(self, drafter: str, where: int, k: int, accepted: int) -> None:
        if k <= 0:
            return
        self._memo.pop(drafter, None)
        overall, here = self.overall.get(drafter), self.by_situation.get((drafter, where))
        if overall is None:   # (not setdefault: it would build a PositionRates every round)
            overall = self.overall[drafter] = PositionRates()
        if here is None:
            here = self.by_situation[(drafter, where)] = PositionRates()
        overall.update(k, accepted)
        here.update(k, accepted)
