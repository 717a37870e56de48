"""Prompt lookup: which earlier n-gram it copies from, and that whiflash takes its drafts first."""
from __future__ import annotations

import torch

from tiny import tiny_target
from whiflash_core.drafters.base import Context, DraftSampling
from whiflash_core.drafters.ngram import NgramConfig, NgramDrafter
from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig


def draft(ids: list[int], k: int = 3, **cfg) -> list[int]:
    d = NgramDrafter(NgramConfig(**cfg))
    t = torch.tensor(ids + [0, 0, 0])  # slots past the pending token are never read
    ctx = Context(t, len(ids) - 1, torch.zeros(0), ())
    return d.propose(d.new_state(0), ctx, k, DraftSampling()).tokens.tolist()


def test_copies_what_followed_the_longest_most_recent_match():
    assert draft([1, 2, 3, 9, 8, 1, 2, 3]) == [9, 8, 1]                   # trigram 1 2 3 seen at 0
    assert draft([1, 2, 5, 1, 2, 7, 4, 1, 2]) == [7, 4, 1]                # bigram 1 2: the later hit wins
    assert draft([5, 1, 2, 6, 9, 1, 2, 7, 0, 5, 1, 2]) == [6, 9, 1]       # the trigram beats later bigrams
    assert draft([1, 2, 3, 1, 2, 3], k=8) == [1, 2, 3]                    # stops at the pending token
    assert draft([1, 2, 3, 4, 5]) == []                                   # nothing repeats: no draft
    assert draft([7, 7]) == [] and draft([7, 7, 7]) == [7]                # never matches the suffix itself
    assert draft([4, 1, 2, 9, 1, 2], min_ngram=3) == []


def test_whiflash_drafts_from_the_context_first_and_stays_exact():
    target = tiny_target()
    eng = Engine(target, None, {})
    assert eng.methods == ["none", "ngram"]
    prompt = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7] * 4  # a repeating context: the target tends to continue it
    plain = eng.generate(GenerationRequest(prompt, 40, speculation=SpeculationConfig(method="none"))).output
    gen = eng.generate(GenerationRequest(prompt, 40, speculation=SpeculationConfig(method="ngram")))
    assert gen.output == plain
    st = gen.stats()["drafters"]["ngram"]
    assert st["draft_tokens"] > 0 and st["accepted_tokens"] <= st["draft_tokens"]
