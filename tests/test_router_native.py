"""A request's routing round in one C call (router_native.py) is router.py's round: the same
acceptance arithmetic, the same pick with the same fields, and the same decode end to end."""
from __future__ import annotations

import random

import pytest
import torch

from tiny import VOCAB, tiny_engine
from whiflash_core import decode_ops
from whiflash_core.costs import CostModel, LinearCost
from whiflash_core.drafters.base import Context
from whiflash_core.engine import GenerationRequest, SpeculationConfig
from whiflash_core.rounds import Round
from whiflash_core.router import Router
from whiflash_core.router_mlp import RouterMLP, RouterMLPConfig
from whiflash_core.router_native import NativeRound

pytestmark = [pytest.mark.skipif(not decode_ops.available(), reason="the C ops are not built on this machine"),
              pytest.mark.numerics]   # the C softmax differs by ISA: .ci/run runs these with the AVX2 kernels too


def _mlp(eng, seed: int) -> RouterMLP:
    torch.manual_seed(seed)
    lens = {"eagle3": 4, "dflash": 3, "ngram": 5}
    mlp = RouterMLP(RouterMLPConfig(eng.target.cfg.hidden_size, tuple(lens), tuple(lens.values()))).eval()
    with torch.no_grad():   # outputs spread over (0, 1), so every drafter wins some rounds
        mlp.fc2.bias.copy_(torch.randn(mlp.cfg.n_outputs) * 2)
    return mlp.freeze()


def _costs(rng: random.Random) -> CostModel:
    costs = CostModel.with_table({1: 0.010, 4: 0.011, 8: 0.016, 16: 0.030})
    for name in ("eagle3", "dflash"):
        costs.draft[name] = LinearCost()
        costs.draft[name].add(1, rng.uniform(0.0005, 0.003), decay=1.0)
        costs.draft[name].add(4, rng.uniform(0.001, 0.006), decay=1.0)
        costs.catch_up[name] = LinearCost()
        costs.catch_up[name].add(2, rng.uniform(0.0005, 0.002), decay=1.0)
        costs.catch_up[name].add(9, rng.uniform(0.001, 0.004), decay=1.0)
    return costs


def test_its_acceptance_state_follows_the_python_models_exactly():
    eng = tiny_engine(torch.float32)
    prior = {w: [0.9 - 0.05 * i for i in range(w + 2)] for w in range(5)}
    router = Router(eng.drafters, SpeculationConfig(method="whiflash", policy="cost"), 0.0, CostModel(),
                    copy_prior=prior)
    native = router.native
    assert native is not None
    rng = random.Random(0)
    for step in range(400):
        name = rng.choice(["eagle3", "dflash", "ngram"])
        where, k = rng.randint(0, 3), rng.randint(1, 15)
        accepted = rng.randint(0, k)
        router.acceptance.update(name, where, k, accepted)
        native.update(name, where, k, accepted)
        w = rng.randint(0, 4)
        router.copying.update("ngram", w, k, accepted)
        native.update_copy(w, k, accepted)
        for which, model in (("acceptance", router.acceptance), ("copying", router.copying)):
            d, s, kk = rng.choice(["eagle3", "dflash", "ngram"]), rng.randint(0, 4), rng.randint(1, 20)
            if which == "copying":
                d = "ngram"
            assert native.rates(which, d, s, kk) == model.rates(d, s, kk), (step, which, d, s, kk)


@pytest.mark.parametrize("policy", ["cost", "learned"])
def test_the_c_round_picks_what_the_python_round_picks(policy):
    """Random request states (acceptance and copy histories, calibration, backlogs, drafting and
    verify costs, logits of every confidence, prompt-lookup matches): the C pick equals
    Options.best of the Python candidates, every field, at every alpha."""
    eng = tiny_engine(torch.float32)
    mlp = _mlp(eng, 2) if policy == "learned" else None
    rng = random.Random(2)
    picked = set()
    for trial in range(12):
        alpha = rng.choice([0.0, 0.25, 0.5, 1.0])
        spec = SpeculationConfig(method="whiflash", policy=policy, alpha=alpha, prompt_lookup=rng.random() < 0.8)
        router = Router(eng.drafters, spec, 0.0, _costs(rng), mlp,
                        {w: [rng.uniform(0.2, 0.95)] * rng.randint(1, 15) for w in range(5)})
        assert router.native is not None
        states = {n: d.new_state(256) for n, d in router.drafters.items()}
        router.prompt_len = 8
        # repeats of a short pattern, so prompt lookup finds 2- and 3-token matches and copy runs
        ids = torch.tensor([rng.randint(0, 6) for _ in range(200)])
        taps = torch.zeros(256, len(eng.tap_layers), eng.target.cfg.hidden_size)
        for rnd in range(40):
            n = rng.randint(10, 190)
            ctx = Context(ids, n, taps, eng.tap_layers)
            for state in states.values():
                state.n_seen = rng.randint(0, n)
            logits = torch.randn(VOCAB) * rng.choice([0.1, 1.0, 4.0, 12.0])
            hidden = torch.randn(eng.target.cfg.hidden_size)
            if rng.random() < 0.5:
                hidden = hidden.to(torch.bfloat16)
            limit = rng.choice([0, 1, 3, 8, 40])
            python = router.options(states, ctx, logits, limit, hidden).best(alpha)
            search, copy = states["ngram"].last if "ngram" in states else None, router._copy
            if "ngram" in states:
                states["ngram"].last = None
            router._copy = None
            native = router.options(states, ctx, logits, limit, hidden, lone=True)
            assert native.priced == []   # the C round's pick alone
            assert native.best(alpha) == python, (trial, rnd)
            # and the lookup's search, for its propose and the router's observe
            assert (states["ngram"].last if "ngram" in states else None) == search and router._copy == copy
            picked.add(python.drafter)
            # the round's outcome, to move the request's histories
            route = router.take(python, states, ctx)
            accepted = rng.randint(0, route.draft_len)
            emitted = ids[n + 1:n + 2 + accepted].tolist()
            router.observe(route, Round(rnd + 1, route.drafter, route.draft_len, accepted, tokens=emitted))
    assert {None, "eagle3", "dflash", "ngram"} <= picked


@pytest.mark.parametrize("policy", ["cost", "learned"])
def test_a_decode_routed_in_c_is_the_decode_routed_in_python(policy, monkeypatch):
    """Whole requests (float32): the same rounds (drafter and draft length) and tokens with the
    C round as with the Python round, and plain decode's tokens."""
    eng = tiny_engine(torch.float32)
    if policy == "learned":
        eng.router_mlp = _mlp(eng, 3)
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt += prompt[:12]

    def run(native: bool):
        if not native:
            monkeypatch.setattr(NativeRound, "make", classmethod(lambda cls, router: None))
        gen = eng.start(GenerationRequest(prompt, 40, speculation=SpeculationConfig(method="whiflash", policy=policy)))
        assert (gen.router.native is not None) == native
        gen.prefill()
        rounds = []
        while not gen.finished:
            r = gen.step()
            rounds.append((r.drafter, r.draft_len, r.accepted))
        monkeypatch.undo()
        return gen.output, rounds

    plain = eng.generate(GenerationRequest(prompt, 40, speculation=SpeculationConfig(method="none"))).output
    c_out, c_rounds = run(True)
    py_out, py_rounds = run(False)
    assert c_out == py_out == plain
    # round times differ between the two runs and feed the cost model, so the picks may part
    # where the measured times cross; the first rounds, priced from the same start, agree
    assert c_rounds[:3] == py_rounds[:3]
    assert len({d for d, _, _ in c_rounds}) > 1


def test_only_the_cost_and_learned_routing_policies_route_in_c():
    eng = tiny_engine(torch.float32)
    assert Router(eng.drafters, SpeculationConfig(method="whiflash", policy="entropy"), 0.0).native is None
    assert Router(eng.drafters, SpeculationConfig(method="eagle3"), 0.0).native is None
    assert Router(eng.drafters, SpeculationConfig(method="whiflash", policy="cost"), 0.0).native is not None
