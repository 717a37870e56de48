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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_prefills_riding_in_shared_forwards_give_each_request_its_own_tokens(dtype, one_torch_thread):
    """Requests start one after another while the others step: each one's prompt rows go through
    the target in the others' shared forward (logits of its last row only), as an agent turn's
    new tokens do on a busy one-thread server; every request still gets the tokens it gets alone."""
    eng = engine(dtype)
    reqs = requests()
    alone = [eng.generate(r) for r in reqs]
    gens = [eng.start(r) for r in reqs]
    gens[0].prefill()
    active, rode = [gens[0]], 0
    for step in range(400):
        joining = [(g, g.begin_prefill()) for g in gens[len(active):len(active) + 1]] if step % 3 == 2 else []
        assert all(eng.prefill_rides(rows.shape[0]) for _, rows in joining)
        stepping = [g for g in active if not g.finished]
        results = eng.step_many(stepping, joining)
        assert not any(isinstance(r, Exception) for r in results), results
        assert results[len(stepping):] == [None] * len(joining)
        rode += bool(joining and stepping)   # (one that does not fit the step runs its own forward)
        active += [g for g, _ in joining]
        if len(active) == len(gens) and all(g.finished for g in gens):
            break
    assert rode >= 4   # most prefills shared a forward with running requests
    for a, g in zip(alone, gens):
        assert g.output == a.output, g.spec.method
        assert g.finish_reason == a.finish_reason
        # the drafters read the same context (the prompt's taps came from the shared forward)
        assert [d["accepted_tokens"] for d in g.stats()["drafters"].values()] == \
            [d["accepted_tokens"] for d in a.stats()["drafters"].values()]


def test_prefills_ride_only_where_the_target_runs_on_one_thread(one_torch_thread):
    eng = engine()
    assert eng.prefill_rides(20) and not eng.prefill_rides(65)   # no layer stack: SHARED_PREFILL_MAX_ROWS
    eng.large_threads = 2   # a server whose forwards of 8 rows or more run on two threads
    assert not eng.prefill_rides(20)


def test_a_failing_request_does_not_fail_the_others():
    eng = engine()
    gens = [eng.start(r) for r in requests()[:3]]
    for g in gens:
        g.prefill()

    def broken_plan(lone: bool = True):
        raise RuntimeError("boom")
    gens[1].round_options = broken_plan
    results = eng.step_many(gens)
    assert isinstance(results[1], RuntimeError)
    assert results[0] is not None and results[2] is not None and not isinstance(results[0], Exception)
    alone = eng.generate(requests()[0])
    while not gens[0].finished:
        eng.step_many([gens[0], gens[2]])
    assert gens[0].output == alone.output


def test_a_drafter_failing_for_one_request_of_a_shared_draft_fails_only_its_draft():
    """Requests that picked the same drafter draft together (propose_many); when that raises, each
    drafts alone, so only the request whose draft fails falls back to plain decoding."""
    eng = engine()
    reqs = [GenerationRequest(r.prompt_ids, r.max_new_tokens, speculation=SpeculationConfig(method="eagle3"))
            for r in requests()[:3]]
    alone = [eng.generate(r) for r in reqs]
    gens = [eng.start(r) for r in reqs]
    for g in gens:
        g.prefill()
    drafter = eng.drafters["eagle3"]
    broken = gens[1].states["eagle3"]
    propose, propose_many = drafter.propose, drafter.propose_many

    def failing_propose(state, *args):
        if state is broken:
            raise RuntimeError("boom")
        return propose(state, *args)

    def failing_propose_many(states, *args):
        if any(state is broken for state in states):
            raise RuntimeError("boom")
        return propose_many(states, *args)
    drafter.propose, drafter.propose_many = failing_propose, failing_propose_many
    while not all(g.finished for g in gens):
        results = eng.step_many([g for g in gens if not g.finished])
        assert not any(isinstance(r, Exception) for r in results), results
    assert [g.fallback_from for g in gens] == [None, "eagle3", None]
    assert [g.output for g in gens] == [a.output for a in alone]
    assert gens[0].stats()["drafters"] == alone[0].stats()["drafters"]


def mixed_drafting_requests() -> list[GenerationRequest]:
    """Requests that share drafters with different chain / block lengths, greedy and sampled."""
    out = []
    for i, (method, n, max_new, temperature, spec) in enumerate([
            ("eagle3", 5, 30, 0.0, {"num_draft_tokens": 2}), ("eagle3", 23, 26, 0.8, {"num_draft_tokens": 4}),
            ("eagle3", 40, 20, 0.0, {}), ("dflash", 60, 40, 0.0, {"block_size": 3}),
            ("dflash", 14, 33, 0.7, {}), ("whiflash", 31, 28, 0.0, {}), ("whiflash", 47, 35, 0.9, {})]):
        prompt = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(70 + i)).tolist()
        sampling = SamplingParams(temperature=temperature, seed=11 + i)
        out.append(GenerationRequest(prompt, max_new, sampling,
                                     SpeculationConfig(method=method, entropy_threshold=3.0, **spec)))
    return out


def recording_drafts(gen):
    """`gen` with every round's draft (the verified rows after the pending token) kept in gen.drafts."""
    gen.drafts = []
    finish = gen.finish_plan

    def finish_and_record(plan):
        finish(plan)
        gen.drafts.append(plan.draft.tokens.tolist())
    gen.finish_plan = finish_and_record
    return gen


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_drafting_together_gives_each_request_its_own_drafts(dtype):
    """EAGLE-3 chains and DFlash blocks of several requests, and their catch-ups, run through their
    drafter together (catch_up_many, propose_many): each request's drafts, round by round, and so
    its tokens are those it gets alone."""
    eng = engine(dtype)
    alone = []
    for r in mixed_drafting_requests():
        gen = recording_drafts(eng.start(r))
        gen.prefill()
        while not gen.finished:
            gen.step()
        alone.append(gen)
    sizes: dict[tuple[str, str], list[int]] = {}
    for name in ("eagle3", "dflash"):
        for call in ("catch_up_many", "propose_many"):
            def counted(states, *args, __many=getattr(eng.drafters[name], call), __key=(name, call)):
                sizes.setdefault(__key, []).append(sum(s.n_seen < c.n for s, c in zip(states, args[0]))
                                                   if __key[1] == "catch_up_many" else len(states))
                return __many(states, *args)
            setattr(eng.drafters[name], call, counted)
    gens = [recording_drafts(eng.start(r)) for r in mixed_drafting_requests()]
    for g in gens:
        g.prefill()
    while not all(g.finished for g in gens):
        results = eng.step_many([g for g in gens if not g.finished])
        assert not any(isinstance(r, Exception) for r in results), results
    # chains, blocks and catch-ups of several requests did run together (catch-ups: requests with
    # positions to catch up on)
    assert all(max(sizes[(name, call)]) >= 2 for name in ("eagle3", "dflash")
               for call in ("catch_up_many", "propose_many")), sizes
    for a, g in zip(alone, gens):
        assert g.drafts == a.drafts, g.spec
        assert g.output == a.output, g.spec


@pytest.mark.parametrize("name", ["eagle3", "dflash"])
def test_catching_up_together_writes_each_cache_as_catching_up_alone(name):
    """catch_up_many: every request's drafter cache gets the K/V its own catch_up would write
    (float64: the same values), whatever the other requests' backlogs."""
    eng = engine()
    drafter = eng.drafters[name]
    gens = [eng.start(r) for r in requests() if r.speculation.method in ("whiflash", "eagle3", "dflash")]
    for g in gens:
        g.prefill()
    together = [drafter.new_state(g.cache.length + 8) for g in gens]
    alone = [drafter.new_state(g.cache.length + 8) for g in gens]
    for i, g in enumerate(gens):   # a few positions already seen, a different number per request
        together[i].n_seen = alone[i].n_seen = together[i].cache.length = alone[i].cache.length = i
    drafter.catch_up_many(together, [g._context() for g in gens])
    for state, g in zip(alone, gens):
        drafter.catch_up(state, g._context())
    for a, b in zip(together, alone):
        assert a.n_seen == b.n_seen
        assert torch.allclose(a.cache.k[:, :, :a.n_seen], b.cache.k[:, :, :b.n_seen], rtol=0, atol=1e-12)
        assert torch.allclose(a.cache.v[:, :, :a.n_seen], b.cache.v[:, :, :b.n_seen], rtol=0, atol=1e-12)
