"""Prompt lookup: which earlier n-gram it copies from, and that whiflash takes its drafts first."""
from __future__ import annotations

import pytest
import torch

from tiny import tiny_target
from whiflash_core import decode_ops
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


def test_copy_run_counts_the_agreement_back_from_the_pending_token():
    d = NgramDrafter(NgramConfig(longest_run=5))
    def run(ids: list[int]) -> int:
        t, state = torch.tensor(ids), d.new_state(0)
        size, start = d.match(state, t, len(ids) - 1)
        return d.copy_run(state, len(ids) - 1, start)
    assert run([5, 1, 2, 3, 9, 8, 0, 1, 2, 3]) == 3         # 1 2 3 again, 0 before it where 5 was
    assert run([7, 1, 2, 3, 9, 7, 1, 2, 3]) == 4            # 7 1 2 3 again, then the context's start
    assert run([4, 4, 4, 4, 1, 2, 3, 9, 4, 4, 4, 4, 1, 2, 3]) == 5   # capped at longest_run
    ids = torch.tensor([5, 1, 2, 3, 9, 8, 1, 2, 3])   # the copy: the tensor's slice, pending included
    state = d.new_state(0)
    size, start = d.match(state, ids, 8)
    for length in (1, 3, 5, 9):
        assert d.copy(ids, 8, start, length) == ids[start:min(start + length, 9)].tolist()


def full_search(seq: list[int], cfg: NgramConfig) -> tuple[int, int]:
    """The definition, slowly: the longest suffix n-gram of seq with an earlier occurrence, at its
    most recent one (start = the token after it)."""
    for size in range(min(cfg.max_ngram, len(seq) - 1), cfg.min_ngram - 1, -1):
        hits = [j for j in range(len(seq) - size) if seq[j:j + size] == seq[-size:]]
        if hits:
            return size, hits[-1] + size
    return 0, 0


def copy_run(seq: list[int], start: int, longest: int) -> int:
    run = 1
    while run < longest and start - 1 - run >= 0 and seq[start - 1 - run] == seq[-1 - run]:
        run += 1
    return run


@pytest.mark.parametrize("scan", ["c", "python"])
def test_the_scan_finds_what_the_definition_finds(scan, monkeypatch):
    """A request's rounds see a growing context, searched each round in one scan (C, or Python
    where the C ops are not built): the same match and copy run as the definition, for every
    n-gram range; the answer is kept per n (a second ask does not search again)."""
    if scan == "c" and not decode_ops.available():
        pytest.skip("no C compiler on this machine")
    if scan == "python":
        monkeypatch.setattr(decode_ops, "ngram_match", lambda *args: None)
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        cfg = NgramConfig(min_ngram=1 + trial % 2, max_ngram=2 + trial % 3, longest_run=2 + trial % 7)
        d, ids = NgramDrafter(cfg), torch.randint(0, 5, (70,), generator=g)
        state, n = d.new_state(0), trial % 4
        while n < 69:
            seq = ids[:n + 1].tolist()
            want = full_search(seq, cfg)
            assert d.match(state, ids, n) == want, (trial, n)
            if want[0]:
                assert d.copy_run(state, n, want[1]) == copy_run(seq, want[1], cfg.longest_run), (trial, n)
            n += 1 + (n * 7 + trial) % 3   # rounds accept 0-2 draft tokens
    state = d.new_state(0)
    d.match(state, ids, 60)
    assert d.match(state, ids, 20) == full_search(ids[:21].tolist(), cfg)   # a shorter context: searched afresh
    assert d.match(state, ids.to(torch.int32), 30) == full_search(ids[:31].tolist(), cfg)   # other dtypes too


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
