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

from .. import decode_ops
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
        # (n, (size, start), copy run) of the latest search: ids[:n+1] never changes for a given n
        # within a request, so a router asking first costs the drafter no second search
        self.last: tuple[int, tuple[int, int], int] | None = None


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
        (0, 0) when none of min_ngram..max_ngram matches. One scan of the context in C
        (decode_ops.ngram_match; kept until n changes), else the same scan in Python."""
        if state.last is not None and state.last[0] == n:
            return state.last[1]
        cfg = self.cfg
        found = decode_ops.ngram_match(ids, n, cfg.min_ngram, cfg.max_ngram, cfg.longest_run)
        if found is None:
            found = _match_py(ids[:n + 1].tolist(), cfg)
        self.keep(state, n, found)
        return found[0], found[1]

    @staticmethod
    def keep(state: NgramState, n: int, found: tuple[int, int, int]) -> None:
        """Keep the search at n, (size, start, copy run), for the round's later asks (`match`,
        `copy_run`), whoever searched (the router's C round searches with the same C scan)."""
        state.last = (n, (found[0], found[1]), found[2])

    def copy_run(self, state: NgramState, n: int, start: int) -> int:
        """How many tokens up to the pending one equal those before `start` (the copy source): the
        suffix n-gram found is at most max_ngram long, but a copy of a passage agrees far further
        back, and the longer it has run the longer it tends to go on. At most cfg.longest_run.
        Found by the `match` at n (which must come first)."""
        assert state.last is not None and state.last[0] == n and state.last[1][1] == start
        return state.last[2]

    @staticmethod
    def copy(ids: torch.Tensor, n: int, start: int, length: int) -> list[int]:
        """The first `length` tokens of the copy `match` at n found: ids[start:start + length], at
        most up to the pending token at n."""
        return ids[start:min(start + length, n + 1)].tolist()

    def propose(self, state: NgramState, ctx: Context, num_tokens: int, sampling: DraftSampling) -> Draft:
        size, start = self.match(state, ctx.ids, ctx.n)
        if size == 0:
            return Draft(ctx.ids[:0].clone())
        # point-mass proposals: greedy verification, and exact rejection sampling for T > 0
        return Draft(ctx.ids[start:min(start + num_tokens, ctx.n + 1)].clone())


def _match_py(ids: list[int], cfg: NgramConfig) -> tuple[int, int, int]:
    """decode_ops.ngram_match's scan in Python, where the C ops are not built: (size, start, copy
    run) for the context ids[:-1] and the pending token ids[-1]."""
    n = len(ids) - 1
    longest = min(cfg.max_ngram, n)
    found, end = 0, -1
    for e in range(n - 1, max(cfg.min_ngram, 1) - 2, -1):
        if found >= longest:
            break
        size = 0
        while size < longest and e - size >= 0 and ids[e - size] == ids[n - size]:
            size += 1
        if size >= cfg.min_ngram and size > found:
            found, end = size, e
    if not found:
        return 0, 0, 0
    start, run = end + 1, 1
    while run < cfg.longest_run and start - 1 - run >= 0 and ids[start - 1 - run] == ids[n - run]:
        run += 1
    return found, start, run
