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
    # the longest draft the cost and learned routers may choose for it: they price every length
    # against this request's copy runs (a copy that has run for 16 tokens often runs on for 10
    # more), where the method `ngram` alone always drafts num_draft_tokens
    routed_draft_tokens: int = 15
    longest_run: int = 32        # copy_run looks this far back at most


class NgramState(DrafterState):
    def __init__(self):
        self.last: tuple[int, tuple[int, int]] | None = None  # (n, match) of the latest search
        # The index the search reads: per n-gram size, each n-gram of ids[:indexed] -> the start of
        # its most recent occurrence; `tokens` = ids[:indexed] on the host. The verified context
        # only grows within a request, so each round indexes just its new tokens (a search of the
        # whole context with tensor ops took ~100 us of every round, most of the router's time).
        self.grams: dict[int, dict[tuple[int, ...], int]] = {}
        self.tokens: list[int] = []


class NgramDrafter(Drafter):
    name = "ngram"
    tap_layers = ()
    max_draft_tokens = 64

    def __init__(self, cfg: NgramConfig | None = None):
        self.cfg = cfg or NgramConfig()

    @property
    def default_draft_len(self) -> int:
        return self.cfg.num_draft_tokens

    def routed_draft_len(self, spec) -> int:
        return self.capped_len(spec, self.cfg.routed_draft_tokens)

    def new_state(self, capacity: int) -> NgramState:
        return NgramState()

    def match(self, state: NgramState, ids: torch.Tensor, n: int) -> tuple[int, int]:
        """(size, start) of the longest suffix n-gram of ids[:n+1] (verified + pending token) that
        occurred earlier, taking its most recent occurrence; start indexes the token after it.
        (0, 0) when none of min_ngram..max_ngram matches. ids[:n+1] never changes for a given n
        within a request, so the last answer is kept: a router asking first costs no second search."""
        if state.last is not None and state.last[0] == n:
            return state.last[1]
        pending = self._index(state, ids, n)
        seq = state.tokens   # ids[:n]; the suffix searched for is its end plus the pending token
        match = (0, 0)
        for size in range(min(self.cfg.max_ngram, n), self.cfg.min_ngram - 1, -1):
            # occurrences inside ids[:n]: every one except the suffix itself
            start = state.grams.get(size, {}).get((*seq[n - size + 1:], pending))
            if start is not None:
                match = (size, start + size)
                break
        state.last = (n, match)
        return match

    # `match` at n found (size, start): the n-gram ending at the pending token ids[n] also ends at
    # start - 1, so ids[n] == ids[start - 1] and both helpers below read only the host copy
    # state.tokens = ids[:n] that `match` indexed (no read of the device tensor).

    def copy_run(self, state: NgramState, n: int, start: int) -> int:
        """How many tokens up to the pending one equal those before `start` (the copy source): the
        suffix n-gram found is at most max_ngram long, but a copy of a passage agrees far further
        back, and the longer it has run the longer it tends to go on. At most cfg.longest_run."""
        seq, run = state.tokens, 1   # the pending token itself
        while run < self.cfg.longest_run and start - 1 - run >= 0 and seq[start - 1 - run] == seq[n - run]:
            run += 1
        return run

    def copy(self, state: NgramState, n: int, start: int, length: int) -> list[int]:
        """The first `length` tokens of the copy (ids[start:start + length], at most up to the
        pending token at n), from the host copy."""
        end = min(start + length, n + 1)
        return state.tokens[start:min(end, n)] + ([state.tokens[start - 1]] if end > n else [])

    def _index(self, state: NgramState, ids: torch.Tensor, n: int) -> int:
        """Bring state.grams up to ids[:n] (read on the host once per token: on a GPU each search
        would otherwise wait for the device) and return the pending token ids[n], read in the same
        host copy (one tensor read a round: each costs microseconds of the router's time). A
        context that shrank (not within one request) is indexed afresh."""
        if n < len(state.tokens):
            state.grams, state.tokens = {}, []
        old = len(state.tokens)
        *new, pending = ids[old:n + 1].tolist()
        if not new:
            return pending
        state.tokens.extend(new)
        seq = state.tokens
        for size in range(self.cfg.min_ngram, self.cfg.max_ngram + 1):
            grams = state.grams.setdefault(size, {})
            for start in range(max(old - size + 1, 0), n - size + 1):   # the n-grams ending at old..n-1
                grams[tuple(seq[start:start + size])] = start
        return pending

    def propose(self, state: NgramState, ctx: Context, num_tokens: int, sampling: DraftSampling) -> Draft:
        size, start = self.match(state, ctx.ids, ctx.n)
        if size == 0:
            return Draft(ctx.ids[:0].clone())
        # point-mass proposals: greedy verification, and exact rejection sampling for T > 0
        return Draft(ctx.ids[start:min(start + num_tokens, ctx.n + 1)].clone())
