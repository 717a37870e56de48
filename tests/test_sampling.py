"""Speculative sampling keeps the target's distribution (chi-square tests with fixed seeds)."""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from tiny import tiny_dflash, tiny_eagle, tiny_target
from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig
from whiflash_core.sampling import SamplingParams, target_probs, verify_sampling


def _chi2_pvalue(counts: dict, expected: dict, n: int) -> float:
    """Chi-square p-value, merging outcomes whose expected count is under 5 into one bin."""
    obs, exp, rest_o, rest_e = [], [], 0.0, 0.0
    for key, p in expected.items():
        if p * n >= 5:
            obs.append(counts.get(key, 0))
            exp.append(p * n)
        else:
            rest_o += counts.get(key, 0)
            rest_e += p * n
    extra = n - sum(counts.get(k, 0) for k in expected)  # outcomes with zero expected probability
    assert extra == 0, f"{extra} samples fell on impossible outcomes"
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    scale = sum(obs) / sum(exp)  # expected probabilities are float32 sums: renormalise exactly
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


@pytest.mark.parametrize("draft_kind", ["point_mass", "distribution"])
def test_rejection_sampler_reproduces_target_sequence_distribution(draft_kind):
    """Two-token chain drafts against fixed target rows: emitted pairs follow p exactly."""
    g = torch.Generator().manual_seed(0)
    V, k = 5, 2
    # target rows: p(x1), p(x2 | x1 = d1) and p(x3 | d1, d2) — only rows on the draft path matter
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, -1)
    n = 20000
    second: dict = {}
    first_draft: dict = {}
    for _ in range(n):
        if draft_kind == "point_mass":
            draft = p[:k].argmax(-1)  # a greedy drafter's likely guesses
            a, nxt = verify_sampling(draft, None, p, g)
        else:
            draft = torch.multinomial(q, 1, generator=g).squeeze(-1)
            a, nxt = verify_sampling(draft, q, p, g)
        first = int(draft[0]) if a >= 1 else nxt
        first_draft[first] = first_draft.get(first, 0) + 1
        if a >= 1:  # the second token was decided by row 1 (accepted draft, residual or bonus)
            tok = int(draft[1]) if a >= 2 else nxt
            second[tok] = second.get(tok, 0) + 1
    # The first emitted token must be distributed as p[0] whatever was drafted ...
    assert _chi2_pvalue(first_draft, {i: float(p[0, i]) for i in range(V)}, n) > 1e-3
    # ... and, once the first draft is accepted, the second as p[1].
    m = sum(second.values())
    assert m > 1000
    assert _chi2_pvalue(second, {i: float(p[1, i]) for i in range(V)}, m) > 1e-3


def test_wrong_residual_is_detected():
    """The test above has the power to catch the classic bug (resampling from p, not the residual)."""
    g = torch.Generator().manual_seed(1)
    V = 5
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    n = 20000
    counts: dict = {}
    for _ in range(n):
        x = 1
        if torch.rand(1, generator=g).item() < float(p[0, x]):
            tok = x
        else:  # buggy: sample from p instead of p with x removed
            tok = int(torch.multinomial(p[0], 1, generator=g))
        counts[tok] = counts.get(tok, 0) + 1
    assert _chi2_pvalue(counts, {i: float(p[0, i]) for i in range(V)}, n) < 1e-6


def test_top_k_top_p_shape_the_target_side():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs[0, 2:] == 0).all() and probs.sum() == pytest.approx(1.0)
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    full = torch.softmax(logits, -1)[0]
    assert full[0] < 0.7 <= full[0] + full[1]
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum() == pytest.approx(1.0)


@pytest.mark.parametrize("method", ["eagle3", "dflash", "whiflash"])
def test_engine_sampling_matches_target_distribution(method):
    """Whole engine, tiny target with 6 tokens: the joint law of generated tokens 2 and 3 (made by
    one speculative round) equals the target's, computed exactly by enumeration."""
    V = 6
    target = tiny_target(torch.float64, seed=4, vocab=V, layers=4)
    eng = Engine(target, None, {"eagle3": tiny_eagle(target, seed=5), "dflash": tiny_dflash(target, seed=6)})
    prompt = [1, 4, 2, 0, 3]
    params = dict(temperature=1.3, top_k=5)

    def dist(prefix: list[int]) -> torch.Tensor:
        cache = target.new_cache(16)
        out = target(torch.tensor(prefix), cache, logits_from=len(prefix) - 1)
        return target_probs(out.logits, SamplingParams(**params))[0]

    p1 = dist(prompt)
    expected: dict = {}
    for x1 in range(V):
        if p1[x1] == 0:
            continue
        p2 = dist(prompt + [x1])
        for x2, x3 in itertools.product(range(V), repeat=2):
            if p2[x2] == 0:
                continue
            p3 = dist(prompt + [x1, x2])
            key = (x2, x3)
            expected[key] = expected.get(key, 0.0) + float(p1[x1] * p2[x2] * p3[x3])
    n = 2000
    counts: dict = {}
    threshold = 1.0  # entropy in nats: both drafters get rounds in the whiflash case
    for seed in range(n):
        req = GenerationRequest(prompt, 3, SamplingParams(seed=seed, **params),
                                SpeculationConfig(method=method, entropy_threshold=threshold, num_draft_tokens=2,
                                                  block_size=3))
        out = eng.generate(req).output
        counts[(out[1], out[2])] = counts.get((out[1], out[2]), 0) + 1
    assert _chi2_pvalue(counts, expected, n) > 1e-3
