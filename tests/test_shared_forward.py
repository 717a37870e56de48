"""Verify forwards shared between requests (Engine.step_many): a request's tokens do not depend on
what it is batched with. Exact on the float64 tiny model; float32 on the real model is covered by
the gateway tests, whose server shares forwards between concurrent requests."""
from __future__ import annotations

import pytest
import torch

from tiny import VOCAB, tiny_dflash, tiny_eagle, tiny_target
from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig
from whiflash_core.sampling import SamplingParams

pytestmark = pytest.mark.numerics


def engine(dtype=torch.float64) -> Engine:
    target = tiny_target(dtype)
    return Engine(target, None, {"eagle3": tiny_eagle(target), "dflash": tiny_dflash(target)})


def requests() -> list[GenerationRequest]:
    """Different methods, prompt lengths, output lengths and a sampled one, so that rows per request,
    positions and finishing times all differ within a shared forward."""
    out = []
    for i, (method, n, max_new) in enumerate([("whiflash", 5, 40), ("eagle3", 23, 25), ("dflash", 60, 50),
                                               ("ngram", 14, 30), ("none", 31, 12), ("whiflash", 47, 33)]):
        prompt = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(40 + i)).tolist()
        sampling = SamplingParams(temperature=0.8, seed=5) if i == 5 else SamplingParams(temperature=0.0)
        out.append(GenerationRequest(prompt, max_new, sampling, SpeculationConfig(method=method, entropy_threshold=3.0)))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_shared_forwards_give_each_request_its_own_tokens(dtype):
    eng = engine(dtype)
    alone = [eng.generate(r) for r in requests()]
    gens = [eng.start(r) for r in requests()]
    for g in gens:
        g.prefill()
    shared_rounds = 0
    while not all(g.finished for g in gens):
        active = [g for g in gens if not g.finished]
        results = eng.step_many(active)
        assert not any(isinstance(r, Exception) for r in results), results
        shared_rounds += len(active) > 1
    assert shared_rounds > 10
    for a, g in zip(alone, gens):
        assert g.output == a.output, g.spec.method
        assert g.finish_reason == a.finish_reason
        assert [d["accepted_tokens"] for d in g.stats()["drafters"].values()] == \
            [d["accepted_tokens"] for d in a.stats()["drafters"].values()]


def test_a_failing_request_does_not_fail_the_others():
    eng = engine()
    gens = [eng.start(r) for r in requests()[:3]]
    for g in gens:
        g.prefill()

    def broken_plan():
        raise RuntimeError("boom")
    gens[1].plan = broken_plan
    results = eng.step_many(gens)
    assert isinstance(results[1], RuntimeError)
    assert results[0] is not None and results[2] is not None and not isinstance(results[0], Exception)
    alone = eng.generate(requests()[0])
    while not gens[0].finished:
        eng.step_many([gens[0], gens[2]])
    assert gens[0].output == alone.output
