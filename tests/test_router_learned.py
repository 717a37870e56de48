"""The learned policy: its label builder, its replay of rounds, its MLP file, and its fallback."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from tiny import VOCAB, tiny_engine
from whiflash_core import router as router_module
from whiflash_core.acceptance import AcceptanceModel
from whiflash_core.drafters.base import Context, Draft, Drafter, DrafterState
from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig
from whiflash_core.loading import SHIPPED_DRAFTERS
from whiflash_core.router_mlp import FILE_NAME, RouterMLP, RouterMLPConfig, features, scalar_names
from whiflash_core.training.router import (draft_lens, label_sequence, make_router, position_targets, replay,
                                           rows_loss, single_pick)

MAX_NEW = 48


def _prompt() -> list[int]:
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(11)).tolist()
    return prompt + prompt[:10]   # a repeat, so prompt lookup finds matches


def _random_mlp(eng, seed: int = 0) -> RouterMLP:
    lens = draft_lens(eng, 4)
    torch.manual_seed(seed)
    mlp = RouterMLP(RouterMLPConfig(eng.target.cfg.hidden_size, tuple(lens), tuple(lens.values())))
    return mlp.eval()


class PositionalOracle(Drafter):
    """Drafts plain decode's continuation with a wrong token wherever (position + 2 * i) % 5 == 0:
    a deterministic function of the verified context, so labelling every position and decoding
    for real see the same drafts, and acceptances of every length occur."""

    name = "oracle"
    tap_layers = ()
    max_draft_tokens = 6

    def __init__(self, truth: list[int], prompt_len: int):
        self.truth, self.prompt_len = truth, prompt_len

    def new_state(self, capacity):
        return DrafterState()

    def propose(self, state, ctx: Context, num_tokens, sampling) -> Draft:
        pos = ctx.n + 1 - self.prompt_len   # index in the answer of the first draft token
        out = [self.truth[pos + i] if pos + i < len(self.truth) else 0 for i in range(num_tokens)]
        out = [(t + 1) % VOCAB if (ctx.n + 2 * i) % 5 == 0 else t for i, t in enumerate(out)]
        return Draft(torch.tensor(out))


def _labelled(oracle: bool):
    """A tiny float64 engine (its EAGLE-3 slot an oracle drafter, or the random tiny EAGLE-3), a
    prompt, plain decode's answer and its labels."""
    eng = tiny_engine(torch.float64)
    prompt = _prompt()
    plain = eng.generate(GenerationRequest(prompt, MAX_NEW, speculation=SpeculationConfig(method="none"))).output
    if oracle:
        eng = Engine(eng.target, None, {"eagle3": PositionalOracle(plain, len(prompt)), "dflash": eng.drafters["dflash"]})
    lens = draft_lens(eng, 4)
    labels = label_sequence(eng, torch.tensor(prompt + plain), len(prompt), lens)
    return eng, prompt, plain, lens, labels


@pytest.fixture(scope="module")
def labelled():
    return _labelled(oracle=False)


@pytest.mark.parametrize("oracle", [False, True], ids=["tiny-drafters", "oracle-drafter"])
def test_labels_are_what_each_round_of_a_real_decode_accepts(oracle):
    eng, prompt, _, lens, labels = _labelled(oracle)
    p = len(prompt)
    assert labels.length == MAX_NEW - 1 and labels.hidden.shape == (MAX_NEW - 1, eng.target.cfg.hidden_size)
    compared = {}
    for method in ("eagle3", "dflash", "ngram"):
        col = labels.col(method)
        spec = SpeculationConfig(method=method, num_draft_tokens=lens[method], block_size=lens[method] + 1)
        gen = eng.start(GenerationRequest(prompt, MAX_NEW, speculation=spec))
        gen.prefill()
        compared[method] = []
        while not gen.finished:
            j = gen.cache.length - p          # the round position: verified ids[:n], pending ids[n]
            r = gen.step()
            if r.draft_len == 0:
                assert labels.drafted[j, col] == 0 or method != "ngram"   # no lookup match: no label draft
                continue
            if r.draft_len == labels.drafted[j, col]:
                assert r.accepted == labels.accepted[j, col], (method, j)
                compared[method].append(r.accepted)
            elif method != "dflash":          # a shorter chain / lookup draft is a prefix of the labelled one
                assert r.accepted == min(int(labels.accepted[j, col]), r.draft_len), (method, j)
    assert all(len(v) >= 3 for v in compared.values()), compared
    # prompt lookup (and the oracle) get drafts accepted at several lengths, not only rejections
    assert len(set(compared["ngram"])) >= 2
    if oracle:
        assert len(set(compared["eagle3"])) >= 3


def test_a_replay_of_a_single_drafter_is_the_real_decode(labelled):
    eng, prompt, _, lens, labels = labelled
    spec = SpeculationConfig(method="eagle3", num_draft_tokens=lens["eagle3"])
    gen = eng.start(GenerationRequest(prompt, MAX_NEW, speculation=spec))
    gen.prefill()
    real = []
    while not gen.finished:
        real.append((gen.cache.length - len(prompt), gen.step().accepted))
    seen = []
    router = make_router(eng, "cost", 1.0, None)
    router.draft_lens["eagle3"] = lens["eagle3"]
    replay(router, labels, single_pick("eagle3"), record=lambda j, inputs: seen.append(j))
    # the same round positions, until the real request's max_tokens starts to cut its drafts
    tail = lens["eagle3"] + 2
    assert [j for j, _ in real if j < MAX_NEW - tail] == [j for j in seen if j < MAX_NEW - tail]


def test_position_targets_mask_what_a_round_does_not_observe():
    y, m = position_targets(torch.tensor([4, 4, 2, 0]), torch.tensor([1, 4, 2, 0]), 4)
    assert y.tolist() == [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert m.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    # the loss is lower for probabilities that match the outcome
    drafters = ("d",)
    good = rows_loss({"d": torch.tensor([[5.0, -5.0, 0, 0]])}, torch.tensor([[4]]), torch.tensor([[1]]), drafters)
    bad = rows_loss({"d": torch.tensor([[-5.0, 5.0, 0, 0]])}, torch.tensor([[4]]), torch.tensor([[1]]), drafters)
    assert good < 0.01 < 5 < bad


def test_the_mlp_file_round_trips_in_bf16_and_a_576_wide_one_is_under_a_megabyte(tmp_path):
    cfg = RouterMLPConfig(576, ("eagle3", "dflash", "ngram"), (4, 7, 4))
    assert cfg.width == 72 and cfg.n_features == 576 + len(scalar_names(cfg.drafters))
    mlp = RouterMLP(cfg).eval()
    mlp.fit_scaling(torch.randn(64, cfg.n_features) * 3 + 1)
    path = str(tmp_path / FILE_NAME)
    mlp.save(path, summary={"note": "test"})
    assert os.path.getsize(path) < 1_000_000
    back = RouterMLP.load(path)
    assert back.cfg == cfg and back.summary == {"note": "test"}
    x = torch.randn(cfg.n_features)
    # the serving path (standardisation folded into fc1) computes what forward does, and follows
    # a change of the weights
    for model in (mlp, back):
        assert sum(model.rates(x).values(), []) == pytest.approx(torch.sigmoid(model(x[None]))[0].tolist(), abs=1e-6)
    # a serving round's call (hidden state and scalars apart, weights bound once) computes the same
    hidden, scalars = x[:576].bfloat16(), x[576:].tolist()
    whole = torch.cat([hidden.float(), x[576:]])
    assert back.rates_at(hidden, scalars) == back.rates(whole)
    # float32 and strided hidden states too (read in place, or copied first)
    assert back.rates_at(hidden.float(), scalars) == back.rates(whole)
    assert back.rates_at(torch.stack([hidden, hidden], 1)[:, 0], scalars) == back.rates(whole)
    threads = torch.get_num_threads()
    try:   # its hidden rows are shared among the pool's threads: the same bits on any count
        torch.set_num_threads(1)
        one = back.rates_at(hidden, scalars)
        torch.set_num_threads(2)
        assert back.rates_at(hidden, scalars) == one
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError):   # the C call would read past a shorter row
        back.rates_at(hidden[:500], scalars)
    with pytest.raises(ValueError):
        back.rates_at(hidden, scalars[:-1])
    with torch.no_grad():
        back.fc1.bias.add_(1.0)
    assert sum(back.rates(x).values(), []) == pytest.approx(torch.sigmoid(back(x[None]))[0].tolist(), abs=1e-6)
    assert back.rates_at(hidden, scalars) == back.rates(whole)   # ...and sees the changed weights
    with torch.no_grad():
        back.fc1.bias.sub_(1.0)
    for name, rates in back.rates(x).items():
        assert len(rates) == dict(zip(cfg.drafters, cfg.draft_lens))[name]
        assert rates == pytest.approx(mlp.rates(x)[name], abs=0.02)   # bf16 weights
    # serving freezes it (loading.load_router_mlp): the fold made once, the same predictions
    before = back.rates_at(hidden, scalars)
    assert back.freeze().rates_at(hidden, scalars) == before and back.rates(whole) == before
    assert not any(p.requires_grad for p in back.parameters())


def test_features_read_the_requests_acceptance_history():
    cfg = RouterMLPConfig(8, ("eagle3", "ngram"), (3, 3))
    acc = AcceptanceModel()
    before = features(cfg, torch.zeros(8), 1.0, 0.9, 3, acc)
    for _ in range(10):
        acc.update("eagle3", 3, 3, 3)    # accepted in another situation (top1 > 0.95): the drafter-wide rates move
        acc.update("ngram", 3, 3, 0)     # prompt lookup rejected in this one (a 3-token match)
    after = features(cfg, torch.zeros(8), 1.0, 0.9, 3, acc)
    names = scalar_names(cfg.drafters)
    at = {n: i + 8 for i, n in enumerate(names)}
    assert after[at["eagle3_rate_1"]] > before[at["eagle3_rate_1"]] and after[at["eagle3_observed"]] == 0.0
    assert after[at["ngram_rate_1"]] < before[at["ngram_rate_1"]] and after[at["ngram_observed"]] > 0.7
    assert after[at["lookup_match_3"]] == 1.0 and after[at["lookup_match_2"]] == 0.0


def test_learned_without_its_mlp_routes_by_cost_and_says_so(caplog):
    eng = tiny_engine(torch.float32)
    assert eng.router_mlp is None
    prompt = _prompt()
    runs = {}
    router_module._logged.clear()
    with caplog.at_level(logging.WARNING, logger="whiflash_core.router"):
        for policy in ("cost", "learned"):
            spec = SpeculationConfig(method="whiflash", policy=policy)
            gen = eng.generate(GenerationRequest(prompt, 30, speculation=spec))
            runs[policy] = (gen.output, gen.stats())
    assert runs["learned"][1]["policy"] == "cost"
    assert runs["learned"][0] == runs["cost"][0] and runs["learned"][1]["drafters"] == runs["cost"][1]["drafters"]
    assert any("no router MLP is loaded" in r.message for r in caplog.records)


def test_learned_routing_follows_its_predictions():
    """With a head that says 'DFlash accepts everything, EAGLE-3 nothing', the learned policy
    drafts with DFlash where the cost policy starts from its prior. (Prompt lookup is off: where
    its copy run is known, its drafts are priced by the request's copy rates, not by the head.)"""
    eng = tiny_engine(torch.float32)
    mlp = _random_mlp(eng)
    with torch.no_grad():
        mlp.fc2.weight.zero_()
        bias = torch.full((mlp.cfg.n_outputs,), -8.0)
        start = 0
        for name, k in zip(mlp.cfg.drafters, mlp.cfg.draft_lens):
            if name == "dflash":
                bias[start:start + k] = 8.0
            start += k
        mlp.fc2.bias.copy_(bias)
    eng.router_mlp = mlp
    gen = eng.generate(GenerationRequest(_prompt(), 30, speculation=SpeculationConfig(
        method="whiflash", policy="learned", alpha=0.0, prompt_lookup=False)))
    assert gen.stats()["policy"] == "learned"
    rounds = gen.stats()["drafters"]
    assert rounds["dflash"]["rounds"] > 0 and rounds["eagle3"]["rounds"] == 0 and "ngram" not in rounds


def test_the_shipped_router_mlp_loads_and_is_small():
    path = os.path.join(SHIPPED_DRAFTERS, FILE_NAME)
    if not os.path.exists(path):
        pytest.skip("no shipped router MLP")
    assert os.path.getsize(path) < 1_000_000
    mlp = RouterMLP.load(path)
    assert mlp.cfg.hidden_size == 576 and set(mlp.cfg.drafters) == {"eagle3", "dflash", "ngram"}
    assert os.path.exists(os.path.join(SHIPPED_DRAFTERS, "router_mlp.md"))


def test_learned_predictions_are_calibrated_by_what_the_request_accepts():
    """An MLP that promises EAGLE-3 drafts of 0.9 per position: while the request accepts them the
    router keeps drafting; once they are all rejected, this request's calibration scales the
    promise down until a plain step wins (the MLP alone would keep drafting forever)."""
    from whiflash_core.costs import CostModel
    from whiflash_core.rounds import Round

    eng = tiny_engine(torch.float32)
    mlp = _random_mlp(eng)
    mlp.rates = lambda x: {name: [0.9 if name == "eagle3" else 0.0] * k
                           for name, k in zip(mlp.cfg.drafters, mlp.cfg.draft_lens)}
    costs = CostModel.with_table({1: 1.0, 2: 1.25, 3: 1.5, 4: 1.75, 5: 2.0})
    spec = SpeculationConfig(method="whiflash", policy="learned", alpha=1.0, prompt_lookup=False)

    def run(accept_all: bool) -> list[str | None]:
        router = router_module.Router(eng.drafters, spec, 2.0, costs, mlp)
        picked = []
        for i in range(30):
            inputs = router_module.RoundInputs(limit=8, top1=0.5, entropy=1.0, backlogs=dict.fromkeys(router.drafters, 0),
                                               hidden=torch.zeros(eng.target.cfg.hidden_size))
            route = router.choose(inputs)
            picked.append(route.drafter)
            k = route.draft_len
            router.observe(route, Round(index=i + 1, drafter=route.drafter, draft_len=k, accepted=k if accept_all else 0))
        return picked

    accepted, rejected = run(True), run(False)
    assert set(accepted) == {"eagle3"}
    assert rejected[0] == "eagle3" and set(rejected[-10:]) == {None}
