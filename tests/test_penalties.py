"""Penalties, logit_bias and logprobs in the engine (float64 tiny model, so no rounding hides a bug).

The reference is written independently of the engine: a full forward over the whole sequence every
step, penalties applied by hand from the output so far. Every method must reproduce it exactly.
"""
from __future__ import annotations

import math

import pytest
import torch

from test_engine_tiny import PROMPTS, OracleDrafter, engine, median_entropy
from whiflash_core.engine import METHODS, GenerationRequest, SpeculationConfig
from whiflash_core.logits import LogitAdjustments
from whiflash_core.sampling import SamplingParams
from whiflash_core.target import TargetModel

pytestmark = pytest.mark.numerics

ADJUSTED = [LogitAdjustments(presence_penalty=1.5), LogitAdjustments(frequency_penalty=0.7),
            LogitAdjustments(presence_penalty=-0.5, frequency_penalty=1.0, logit_bias={3: 5.0, 7: -100.0})]


def reference_decode(target: TargetModel, prompt: list[int], n: int, adjust: LogitAdjustments) -> tuple[list[int], list[float]]:
    """Greedy decode from scratch each step with OpenAI's penalty formula; (tokens, their logprobs)."""
    out, logprobs = [], []
    for _ in range(n):
        ids = torch.tensor(prompt + out)
        logits = target(ids, target.new_cache(len(ids) + 1)).logits[-1].clone()
        for tok in set(out):
            logits[tok] -= adjust.presence_penalty + adjust.frequency_penalty * out.count(tok)
        for tok, bias in adjust.logit_bias.items():
            logits[tok] += bias
        tok = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
        out.append(tok)
    return out, logprobs


@pytest.mark.parametrize("adjust", ADJUSTED, ids=["presence", "frequency", "both+bias"])
def test_every_method_equals_penalised_plain_decode(adjust):
    eng = engine()
    prompt = PROMPTS[1]
    ref, ref_lp = reference_decode(eng.target, prompt, 40, adjust)
    plain = eng.generate(GenerationRequest(prompt, 40, speculation=SpeculationConfig(method="none"))).output
    assert ref != plain  # the penalties really change the output
    if adjust.logit_bias:
        assert 7 not in ref and 3 in ref
    threshold = median_entropy(eng, prompt, 40)
    for method in METHODS:
        gen = eng.generate(GenerationRequest(prompt, 40, adjustments=adjust, logprobs=2,
                                             speculation=SpeculationConfig(method=method, entropy_threshold=threshold)))
        assert gen.output == ref, method
        assert [lp.token for lp in gen.logprobs] == ref
        assert [lp.logprob for lp in gen.logprobs] == pytest.approx(ref_lp, abs=1e-5), method  # logits are float32
    # random tiny drafters are rarely right; an oracle that knows the penalised answer (and errs
    # sometimes) makes multi-token verifications decide most tokens, each row with its own counts
    oracle = OracleDrafter(ref + [0] * 8, len(prompt), error_rate=0.2, seed=5)
    eng.drafters["eagle3"] = oracle
    gen = eng.generate(GenerationRequest(prompt, 40, adjustments=adjust,
                                         speculation=SpeculationConfig(method="eagle3", num_draft_tokens=5)))
    assert gen.output == ref
    assert gen.stats()["acceptance_length"] > 2.0


def test_logprobs_top_n_are_sorted_and_contain_the_greedy_token():
    eng = engine()
    gen = eng.generate(GenerationRequest(PROMPTS[0], 20, logprobs=3, speculation=SpeculationConfig(method="whiflash")))
    assert len(gen.logprobs) == len(gen.output) == 20
    for lp in gen.logprobs:
        assert len(lp.top) == 3
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.top[0] == (lp.token, lp.logprob)  # greedy: the chosen token is the most likely
        assert sum(math.exp(v) for v in values) <= 1 + 1e-9
    off = eng.generate(GenerationRequest(PROMPTS[0], 5, speculation=SpeculationConfig(method="whiflash")))
    assert off.logprobs == []  # not asked for: nothing computed


def test_sampled_tokens_respect_a_large_negative_bias():
    """T > 0: a -100 bias removes the token from the target distribution, whatever the drafter proposes."""
    eng = engine()
    plain = eng.generate(GenerationRequest(PROMPTS[1], 30, SamplingParams(temperature=1.0, seed=1),
                                           speculation=SpeculationConfig(method="eagle3")))
    common = max(set(plain.output), key=plain.output.count)
    banned = LogitAdjustments(logit_bias={common: -100.0})
    for seed in range(3):
        gen = eng.generate(GenerationRequest(PROMPTS[1], 30, SamplingParams(temperature=1.0, seed=seed),
                                             adjustments=banned, speculation=SpeculationConfig(method="whiflash")))
        assert common not in gen.output
