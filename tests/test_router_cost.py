"""The cost policy's parts: the round-cost model, the expected-gain model and the choice rule."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tiny import VOCAB, tiny_engine
from whiflash_core.acceptance import (AcceptanceModel, PositionRates, copy_situation, expected_tokens,
                                      expected_tokens_by_k, situation)
from whiflash_core.costs import CATCH_UP_SHARE, CostModel, LinearCost, VerifyCost
from whiflash_core.drafters.base import Context
from whiflash_core.engine import GenerationRequest, SpeculationConfig
from whiflash_core.rounds import Round, RoundTimes
from whiflash_core.machine import CONTEXT
from whiflash_core.router import Candidate, Options, Priced, Route, Router, best, choose_shared
from whiflash_core.router_mlp import RouterMLP, RouterMLPConfig

# --- the cost model ------------------------------------------------------------------------------


def test_linear_cost_recovers_a_line_and_forgets_the_past():
    fit = LinearCost()
    assert fit(5) == 0.0   # never observed: free (the router tries it once)
    for k in (1, 2, 3, 4):
        fit.add(k, 0.002 + 0.001 * k, decay=1.0)
    a, b = fit.coefficients()
    assert a == pytest.approx(0.002) and b == pytest.approx(0.001)
    single = LinearCost()
    single.add(3, 0.01)
    assert single(3) == pytest.approx(0.01) and single(7) == pytest.approx(0.01)  # one x: no slope
    # the machine slowed down: after enough decayed observations the fit follows
    for _ in range(200):
        for k in (1, 4):
            fit.add(k, 2 * (0.002 + 0.001 * k))
    assert fit(2) == pytest.approx(2 * 0.004, rel=1e-3)


def test_verify_cost_keeps_the_tables_shape_and_learns_its_level():
    # the int4 shape: 1-4 rows about the same, a fifth row starts a second block
    table = {1: 0.010, 4: 0.012, 5: 0.016, 8: 0.018}
    v = VerifyCost(table=dict(table))
    est = v.estimates(9)
    assert est[0] == 0.0 and est[1] == 0.010 and est[5] == 0.016
    assert est[2] == pytest.approx(0.010 + 0.002 / 3)     # interpolated
    assert est[9] == pytest.approx(0.018 + 0.002 / 3)     # extrapolated from the last two points
    for _ in range(3):
        v.add(4, 0.024)   # the real model runs 2x the table here
    est = v.estimates(8)
    assert est[4] == pytest.approx(0.024) and est[8] == pytest.approx(0.036) and est[1] == pytest.approx(0.020)


def test_a_start_up_model_ignores_observations_unless_adaptive():
    slow = RoundTimes(router=1e-4, catch_up=0.01, draft=0.05, verify=0.2)
    for adaptive in (False, True):
        model = CostModel.with_table({1: 0.01, 4: 0.012}, adaptive=adaptive)
        model.draft["eagle3"] = LinearCost()
        model.draft["eagle3"].add(3, 0.001)
        before = model.round_time("eagle3", 3, 0)
        model.observe("eagle3", 3, 4, 5, slow)
        after = model.round_time("eagle3", 3, 0)
        assert (after == before) != adaptive
    # router and verify: the observation itself (a first one); draft: the decayed mean of the two
    assert after == pytest.approx(1e-4 + (0.95 * 0.001 + 0.05) / 1.95 + 0.2)


def test_round_time_adds_catch_up_draft_and_verify():
    model = CostModel.with_table({1: 0.010, 2: 0.011, 3: 0.012, 4: 0.013})
    model.catch_up["d"], model.draft["d"] = LinearCost(), LinearCost()
    for x in (1, 10):
        model.catch_up["d"].add(x, 0.0001 * x, decay=1.0)
        model.draft["d"].add(x, 0.001 * x, decay=1.0)
    # the catch-up at its share (it serves the rounds after it too)
    assert model.round_time("d", 3, 10) == pytest.approx(CATCH_UP_SHARE * 0.001 + 0.003 + 0.013)
    assert model.round_time("d", 3, 0) == pytest.approx(0.003 + 0.013)   # nothing to catch up on
    assert model.round_time(None, 0, 0) == pytest.approx(0.010)           # a plain step
    model.catch_up_share = 1.0
    assert model.round_time("d", 3, 10) == pytest.approx(0.001 + 0.003 + 0.013)


def test_a_drafter_that_sat_out_is_not_priced_out_by_its_growing_backlog():
    """An idle drafter's catch-up grows with every round it sits out. Charged in full to the round
    that picks it, a drafter that pays (here 1.6 tokens for 13.9 ms against 1 for 10 ms) loses to a
    plain step once its backlog is long enough, and its backlog then only grows; at the share it
    is picked again."""
    model = CostModel.with_table({1: 0.010, 2: 0.011, 3: 0.012, 4: 0.013})
    model.catch_up["d"], model.draft["d"] = LinearCost(), LinearCost()
    for x in (1, 32):
        model.catch_up["d"].add(x, 0.0006 + 0.00002 * x, decay=1.0)   # Zen 3's EAGLE-3 line, rounded
        model.draft["d"].add(x, 0.0003 * x, decay=1.0)
    gain, plain = 1.6, 1.0 / model.round_time(None, 0, 0)
    assert gain / model.round_time("d", 3, 0) > plain                  # it pays when caught up
    full = dataclasses.replace(model, catch_up_share=1.0)
    assert gain / full.round_time("d", 3, 200) < plain                 # ...but not after 200 idle positions
    assert gain / model.round_time("d", 3, 200) > plain                # at the share it still does


def test_a_shared_step_is_priced_by_the_table_less_its_attention_plus_each_requests_own():
    """The shared table is timed over 4-row requests after machine.CONTEXT cached positions each;
    shared_forward takes that attention off, and each request adds per_position(rows) x its own
    context (CostModel.attention, added per request by choose_shared)."""
    model = CostModel.with_table({1: 0.010, 4: 0.016}, shared={4: 0.016, 8: 0.020})
    model.set_per_position({1: 2e-6, 4: 5e-6})
    shared = model.shared_forward(8)
    assert shared[8] == pytest.approx(0.020 - 2 * CONTEXT * 5e-6) and shared[4] == pytest.approx(0.016 - CONTEXT * 5e-6)
    assert model.attention(4, 1000)[4] == pytest.approx(5e-3)
    assert model.attention(4, 1000)[2] == pytest.approx(1000 * 3e-6)   # interpolated by rows
    # nothing measured: the table as timed, no attention term
    flat = CostModel.with_table({1: 0.010, 4: 0.016}, shared={4: 0.016, 8: 0.020})
    assert flat.shared_forward(8) == flat.shared.estimates(8) and flat.attention(4, 5000) == [0.0] * 5


def test_a_request_alone_is_priced_as_timed_whatever_its_context():
    """Only a shared step reads the context term: a request alone routes by the tables (the term
    moved its picks without a gain, costs.py)."""
    costs = CostModel.with_table({1: 0.010, 4: 0.012})
    costs.set_per_position({1: 1e-6, 2: 2.2e-6, 4: 4e-6})
    costs.draft["eagle3"], costs.draft["dflash"] = LinearCost(), LinearCost()
    costs.draft["eagle3"].add(3, 0.001, decay=1.0)
    costs.draft["dflash"].add(3, 0.050, decay=1.0)
    logits = torch.zeros(VOCAB)
    router, states, ctx = _router(1.0, costs, prompt_lookup=False, num_draft_tokens=3)
    long_ctx = Context(torch.arange(20_001) % 7, 20_000, ctx.taps, ctx.tap_layers)
    short, long_ = router.route(states, ctx, logits), router.route(states, long_ctx, logits)
    assert (short.drafter, short.draft_len, short.expected_s) == (long_.drafter, long_.draft_len, long_.expected_s)
    assert short.expected_s == pytest.approx(0.001 + 0.012)
    assert router.options(states, long_ctx, logits).first.seconds == pytest.approx(0.010)


def test_a_shared_step_prices_each_request_by_its_own_context():
    """choose_shared: t_step = the forward of all rows less attention + each pick's drafting and
    attention over its own context: a request at a long context keeps to a plain step where one
    at a short context drafts, in the same step."""
    options = [Candidate(None, 0, 1.0, 0.0, 0.0), Candidate("d", 3, 2.0, 0.0, 0.001)]
    costs = CostModel()
    costs.set_per_position({1: 1e-6, 4: 4e-6})
    forward = [0.0] + [0.010 + 0.001 * r for r in range(1, 9)]
    short, long_ = choose_shared([options, options], [1.0, 1.0], forward,
                                 [costs.attention(4, 100), costs.attention(4, 20_000)])
    assert (short.drafter, long_.drafter) == ("d", None)


# --- the expected gain ---------------------------------------------------------------------------


def test_expected_tokens_is_one_plus_the_sum_of_survival_products():
    rates = [0.9, 0.5, 0.2]
    assert expected_tokens(rates, 0) == 1.0
    assert expected_tokens(rates, 3) == pytest.approx(1 + 0.9 + 0.45 + 0.09)
    assert expected_tokens_by_k(rates, 3) == pytest.approx([expected_tokens(rates, k) for k in range(4)])


def test_position_rates_count_accepts_up_to_the_first_rejection_only():
    r = PositionRates()
    r.update(k=4, accepted=1)          # position 1 accepted, 2 rejected, 3-4 unseen
    assert r.rates == [1.0, 0.0] and r.weights == [1.0, 1.0]
    r.update(k=4, accepted=4)          # all four accepted
    assert r.rates[:2] == pytest.approx([1.0, 1 / 1.9]) and r.rates[2:] == [1.0, 1.0]


def test_acceptance_is_kept_per_drafter_and_situation_and_shrinks_to_the_prior():
    model = AcceptanceModel()
    prior = model.rates("eagle3", 3, 2)
    for _ in range(20):
        model.update("eagle3", 3, 2, 2)    # confident target: everything accepted
        model.update("eagle3", 0, 2, 0)    # uncertain target: nothing accepted
    confident, uncertain = model.rates("eagle3", 3, 2), model.rates("eagle3", 0, 2)
    assert confident[0] > prior[0] > uncertain[0]
    assert confident[0] > 0.8 and uncertain[0] < 0.2
    assert model.rates("dflash", 3, 2) == model.rates("dflash", 0, 2)   # other drafters untouched
    assert situation("ngram", 0.99, 3) == 3 and situation("eagle3", 0.99, 3) == 3
    assert situation("eagle3", 0.1, 3) == 0


def test_rates_asked_every_round_follow_every_update():
    """The routers ask for every drafter's rates every round (kept until the drafter's next
    update): asked between updates, they are those of a model that was never asked."""
    asked, fresh = AcceptanceModel(), AcceptanceModel()
    rounds = [("eagle3", 3, 4, 4), ("eagle3", 3, 4, 0), ("dflash", 1, 6, 2), ("eagle3", 0, 4, 1), ("eagle3", 3, 4, 3)]
    for drafter, where, k, accepted in rounds:
        before = {(d, w): asked.rates(d, w, 6) for d in ("eagle3", "dflash") for w in (0, 1, 3)}
        asked.update(drafter, where, k, accepted)
        fresh.update(drafter, where, k, accepted)
        for d in ("eagle3", "dflash"):
            for w in (0, 1, 3):
                assert asked.rates(d, w, 6) == fresh.rates(d, w, 6)
        assert asked.rates(drafter, where, 6) != before[drafter, where]   # the update did change them


# --- the choice rule -----------------------------------------------------------------------------


def test_alpha_zero_picks_the_most_tokens_and_alpha_one_the_most_tokens_per_second():
    cands = [Candidate(None, 0, 1.0, 0.010),
             Candidate("fast", 3, 2.0, 0.012),     # 167 tokens/s
             Candidate("long", 7, 3.0, 0.030)]     # 100 tokens/s, most tokens per forward
    assert best(cands, 0.0).drafter == "long"
    assert best(cands, 1.0).drafter == "fast"
    # a plain step wins when drafting does not pay
    assert best([Candidate(None, 0, 1.0, 0.010), Candidate("slow", 3, 1.1, 0.020)], 1.0).drafter is None
    assert best([Candidate(None, 0, 1.0, 0.010), Candidate("slow", 3, 1.1, 0.020)], 0.0).drafter == "slow"


def test_options_pick_from_their_arrays_what_best_picks_from_the_candidates():
    """A request alone takes Options.best straight from the priced arrays: the candidate, fields and
    ties included, that `best` takes from the built list (what a shared step reads)."""
    rng = random.Random(0)
    for trial in range(300):
        verify = [0.0] + sorted(rng.choice([0.004, 0.005, 0.006]) for _ in range(9))   # equal times: ties
        priced = []
        for name in rng.sample(["eagle3", "dflash", "ngram"], rng.randint(0, 3)):
            k_max = rng.randint(1, 8)
            rates = [rng.choice([0.0, 0.5, 0.9, 1.0]) for _ in range(k_max)]
            raw = expected_tokens_by_k([min(p * 1.2, 1.0) for p in rates], k_max) if rng.random() < 0.3 else None
            priced.append(Priced(name, expected_tokens_by_k(rates, k_max), 1e-4, rng.choice([0.0, 1e-3]),
                                 rng.choice([0.0, 2e-4]), rng.choice([0.0, 1e-4]), rng.randint(0, 3), raw))
        options = Options(Candidate(None, 0, 1.0, 1e-4 + verify[1], 1e-4), priced, verify)
        built = options.candidates()
        assert len(built) == 1 + sum(len(p.gains) - 1 for p in priced)
        assert options.longest() == max(c.k for c in built)
        for alpha in (0.0, 0.25, 1.0):
            assert options.best(alpha) == best(built, alpha), (trial, alpha)


def _router(alpha: float, costs: CostModel, **spec) -> tuple[Router, dict, Context]:
    eng = tiny_engine(torch.float32)
    router = Router(eng.drafters, SpeculationConfig(method="whiflash", policy="cost", alpha=alpha, **spec), 0.0, costs)
    states = {n: d.new_state(64) for n, d in router.drafters.items()}
    ids = torch.arange(20) % 7
    ctx = Context(ids, 10, torch.zeros(64, len(eng.tap_layers), 32, dtype=torch.float32), eng.tap_layers)
    return router, states, ctx


def test_router_shortens_the_draft_where_a_longer_one_does_not_pay():
    # int4-like verify: rows 1-4 cost the same, a fifth row +50 %; drafting one token costs 1 ms
    costs = CostModel.with_table({1: 0.010, 4: 0.010, 5: 0.015, 8: 0.016})
    for name in ("eagle3", "dflash"):
        costs.draft[name] = LinearCost()
        costs.draft[name].add(1, 0.001 if name == "eagle3" else 0.005, decay=1.0)
        costs.draft[name].add(4, 0.004 if name == "eagle3" else 0.005, decay=1.0)
    logits = torch.zeros(VOCAB)
    picks = {}
    for alpha in (0.0, 1.0):
        router, states, ctx = _router(alpha, costs, prompt_lookup=False, num_draft_tokens=4)
        picks[alpha] = router.route(states, ctx, logits)
    # alpha 0: time is free, the longest draft with the most expected tokens (eagle3 k=4, DFlash's
    # block of 5 drafts 4 too, with the same prior: the first listed wins the tie)
    assert (picks[0.0].drafter, picks[0.0].draft_len) == ("eagle3", 4)
    # alpha 1: with the prior 0.6 per position, k=3 fills the 4-row verify; a 4th draft token
    # would start the costly second block
    assert (picks[1.0].drafter, picks[1.0].draft_len) == ("eagle3", 3)
    assert picks[1.0].expected_tokens == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    assert picks[1.0].expected_s == pytest.approx(0.003 + 0.010)


def test_router_learns_a_drafters_acceptance_within_the_request():
    costs = CostModel.with_table({1: 0.010, 8: 0.010})
    router, states, ctx = _router(1.0, costs, prompt_lookup=False)
    logits = torch.zeros(VOCAB)
    first = router.route(states, ctx, logits)
    # the first pick never gets a draft accepted: the router moves to the other drafter
    for i in range(6):
        route = router.route(states, ctx, logits)
        if route.drafter == first.drafter:
            router.observe(route, Round(i + 1, route.drafter, route.draft_len, 0))
    assert router.route(states, ctx, logits).drafter not in (first.drafter, None)


def test_prompt_lookup_learns_from_every_round_whoever_drafted():
    """A copy's outcome is known whatever drafted: rounds of EAGLE-3 whose tokens follow the copy
    raise prompt lookup's rates in its copy-run situation up to the tokens emitted (later
    positions stay unknown), and rounds whose first token leaves the copy lower its first rate."""
    router, states, ctx = _router(1.0, CostModel.with_table({1: 0.010, 16: 0.010}))
    # ids = 0..6 0..6 0..5, pending ids[10] = 3: the trigram 1 2 3 occurred at 1..3, and the copy
    # run reaches back 4 tokens (0 1 2 3 twice); its copy is ids[4:11] = 4 5 6 0 1 2 3
    where = copy_situation(4)
    before = router.copying.rates("ngram", where, 7)
    for i in range(8):
        router.route(states, ctx, torch.zeros(VOCAB))
        router.observe(Route("eagle3", 3), Round(i + 1, "eagle3", 3, 2, tokens=[4, 5, 6]))
    grown = router.copying.rates("ngram", where, 7)
    assert all(grown[i] > before[i] for i in range(3)) and grown[3:] == before[3:]
    for i in range(8):
        router.route(states, ctx, torch.zeros(VOCAB))
        router.observe(Route(None), Round(i + 9, None, 0, 0, tokens=[9]))
    assert router.copying.rates("ngram", where, 7)[0] < grown[0]
    assert router.copying.observed("ngram", copy_situation(2)) == 0 < router.copying.observed("ngram", where)


def test_long_copy_runs_get_long_lookup_drafts():
    """Where copies of this run went on (the measured copy prior says so) the router drafts the
    whole copy at once; where they did not, it does not draft from it."""
    eng = tiny_engine(torch.float32)
    costs = CostModel.with_table({1: 0.010, 8: 0.012, 16: 0.030})
    picks = {}
    for p in (0.97, 0.05):
        prior = {w: [p] * 15 for w in range(5)}
        router = Router(eng.drafters, SpeculationConfig(method="whiflash", policy="cost", alpha=1.0), 0.0, costs,
                        None, prior)
        states = {n: d.new_state(64) for n, d in router.drafters.items()}
        ctx = Context(torch.arange(20) % 7, 10, torch.zeros(64, len(eng.tap_layers), 32), eng.tap_layers)
        picks[p] = router.route(states, ctx, torch.zeros(VOCAB))
    assert (picks[0.97].drafter, picks[0.97].draft_len) == ("ngram", 7)   # all 7 tokens after the match
    assert picks[0.05].drafter != "ngram"


def test_every_policy_and_alpha_equals_plain_decode_float32():
    """Lossless whatever the router picks: float32 identity for every policy and alpha 0, 0.5, 1,
    with a cost model whose verify steps make alpha change the picks (`learned` with a random MLP:
    its predictions are arbitrary, and still only the target decides)."""
    eng = tiny_engine(torch.float32)
    eng.costs = CostModel.with_table({1: 0.010, 4: 0.011, 5: 0.016, 8: 0.018, 16: 0.040})
    lens = {name: d.draft_len(SpeculationConfig()) for name, d in eng.drafters.items()}
    torch.manual_seed(0)
    eng.router_mlp = RouterMLP(RouterMLPConfig(eng.target.cfg.hidden_size, tuple(lens), tuple(lens.values()))).eval()
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    prompt = prompt + prompt[:12]   # a repeat, so prompt lookup has matches
    plain = eng.generate(GenerationRequest(prompt, 60, speculation=SpeculationConfig(method="none"))).output
    shapes = {}
    for policy in ("cost", "entropy", "learned"):
        for alpha in (0.0, 0.5, 1.0):
            spec = SpeculationConfig(method="whiflash", policy=policy, alpha=alpha, entropy_threshold=3.5)
            gen = eng.generate(GenerationRequest(prompt, 60, speculation=spec))
            assert gen.output == plain, (policy, alpha)
            assert gen.stats()["policy"] == policy
            shapes[policy, alpha] = gen.stats()["draft_tokens"]
    # the knob moves the cost and learned policies: alpha 0 drafts the most
    assert shapes["cost", 0.0] > shapes["cost", 1.0]
    assert shapes["learned", 0.0] > shapes["learned", 1.0]
