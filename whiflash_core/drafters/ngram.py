"""Prompt-lookup drafter (n-gram matching; transformers' `prompt_lookup_num_tokens`, vLLM's ngram
proposer): the draft is whatever followed the most recent earlier occurrence of the context's last
n tokens. No weights, no target features, microseconds per proposal.

It shines where the answer copies its context (extraction, RAG, summaries, code edits, tool
calls that repeat arguments) and finds little in free text; with no match it drafts nothing and
the round is a plain decode step, so text that never repeats costs (almost) nothing extra.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Context, Draft, Drafter, DrafterState, DraftSampling


@dataclass
class NgramConfig:
    min_ngram: int = 2
    max_ngram: int = 3
    num_draft_tokens: int = 3   # default draft length (one 4-row block of the CPU int4 verify)


class NgramState(DrafterState):
    def __init__(self):
        self.last: tuple[int, tuple[int, int]] | None = None  # (n, match) of the latest search


class NgramDrafter(Drafter):
    name = "ngram"
    tap_layers = ()
    max_draft_tokens = 64

    def __init__(self, cfg: NgramConfig | None = None):
        self.cfg = cfg or NgramConfig()

    @property
    def default_draft_len(self) -> int:
        return self.cfg.num_draft_tokens

    def new_state(self, capacity: int) -> NgramState:
        return NgramState()

    def match(self, state: NgramState, ids: torch.Tensor, n: int) -> tuple[int, int]:
        """(size, start) of the longest suffix n-gram of ids[:n+1] (verified + pending token) that
        occurred earlier, taking its most recent occurrence; start indexes the token after it.
        (0, 0) when none of min_ngram..max_ngram matches. ids[:n+1] never changes for a given n
        within a request, so the last answer is kept: a router asking first costs no second search."""
        if state.last is not None and state.last[0] == n:
            return state.last[1]
        # searched on the host: on a GPU each n-gram size would otherwise wait for the device
        state.last = (n, self._search(ids[:n + 1].cpu()))
        return state.last[1]

    def _search(self, seq: torch.Tensor) -> tuple[int, int]:
        for size in range(min(self.cfg.max_ngram, len(seq) - 1), self.cfg.min_ngram - 1, -1):
            # windows starting at 0..len-1-size: every occurrence except the suffix itself
            windows = seq[:-1].unfold(0, size, 1)
            hits = (windows == seq[-size:]).all(dim=1).nonzero()
            if hits.numel():
                return size, int(hits[-1]) + size
        return 0, 0

    def propose(self, state: NgramState, ctx: Context, num_tokens: int, sampling: DraftSampling) -> Draft:
        size, start = self.match(state, ctx.ids, ctx.n)
        if size == 0:
            return Draft(ctx.ids[:0].clone())
        # point-mass proposals: greedy verification, and exact rejection sampling for T > 0
        return Draft(ctx.ids[start:min(start + num_tokens, ctx.n + 1)].clone())
