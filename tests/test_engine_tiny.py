"""Exactness of every method on a tiny random float64 model, where no rounding can hide a bug."""
from __future__ import annotations

import pytest
import torch

from tiny import VOCAB, tiny_dflash, tiny_eagle, tiny_target
from whiflash_core.drafters.base import Context, Draft, Drafter, DrafterState, DraftSampling
from whiflash_core.engine import METHODS, Engine, Generation, GenerationRequest, SpeculationConfig

# float64 identity across methods: rerun with the AVX2 kernels forced (.ci/run)
pytestmark = pytest.mark.numerics

PROMPTS = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(s)).tolist()
           for s, n in [(1, 5), (2, 23), (3, 60)]]


class OracleDrafter(Drafter):
    """Test double that knows plain decode's continuation and corrupts some draft tokens, so that
    the engine's accept/reject bookkeeping is exercised at every acceptance length."""

    name = "oracle"

    def __init__(self, truth: list[int], prompt_len: int, error_rate: float, seed: int = 0, max_tokens: int = 6):
        self.truth, self.prompt_len, self.error_rate = truth, prompt_len, error_rate
        self.rng = torch.Generator().manual_seed(seed)
        self.tap_layers = (1,)
        self.max_draft_tokens = max_tokens
        self.expected_accepts: list[int] = []

    def new_state(self, capacity):
        return DrafterState()

    def propose(self, state, ctx: Context, num_tokens, sampling: DraftSampling) -> Draft:
        pos = ctx.n + 1 - self.prompt_len  # index in the output of the first draft token
        out, good = [], None
        for i in range(num_tokens):
            tok = self.truth[pos + i] if pos + i < len(self.truth) else 0
            if torch.rand(1, generator=self.rng).item() < self.error_rate:
                tok = (tok + 1) % VOCAB
                good = i if good is None else good
            out.append(tok)
        self.expected_accepts.append(num_tokens if good is None else good)
        return Draft(torch.tensor(out))


class EagerGeneration(Generation):
    """The naive scheme Lazy Catch-up is checked against: every drafter catches up every round."""

    def _catch_up(self, name, ctx):
        for other in self.router.drafters:
            super()._catch_up(other, ctx)


def run(eng: Engine, request: GenerationRequest, eager: bool = False):
    """(generation, its Round records), stepped to the end."""
    gen = EagerGeneration(eng, request) if eager else eng.start(request)
    gen.prefill()
    rounds = []
    while not gen.finished:
        rounds.append(gen.step())
    return gen, rounds


def median_entropy(eng: Engine, prompt: list[int], n: int) -> float:
    """A router threshold at the median entropy of this prompt, so the router switches often."""
    _, rounds = run(eng, GenerationRequest(prompt, n, speculation=SpeculationConfig(method="whiflash", policy="entropy")))
    return float(torch.tensor([r.entropy for r in rounds if r.entropy is not None]).median())


def engine(**kw) -> Engine:
    target = tiny_target()
    return Engine(target, None, {"eagle3": tiny_eagle(target, **kw), "dflash": tiny_dflash(target)})


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "medium", "long"])
@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
def test_every_method_equals_plain_decode_float64(prompt, eager):
    eng = engine()
    plain = eng.generate(GenerationRequest(prompt, 80, speculation=SpeculationConfig(method="none"))).output
    assert len(plain) == 80
    threshold = median_entropy(eng, prompt, 80)
    specs = [SpeculationConfig(method=m, policy="entropy", entropy_threshold=threshold) for m in METHODS[1:]]
    specs.append(SpeculationConfig(method="whiflash", policy="entropy", entropy_threshold=threshold,
                                   prompt_lookup=False))
    specs += [SpeculationConfig(method="whiflash", policy="cost", alpha=alpha) for alpha in (0.0, 1.0)]
    for spec in specs:
        gen, _ = run(eng, GenerationRequest(prompt, 80, speculation=spec), eager)
        assert gen.output == plain, spec
        stats = gen.stats()
        assert stats["rounds"] == gen.rounds and stats["rounds"] >= 1
        if spec.method == "whiflash" and spec.policy == "entropy":
            used = {n for n, d in stats["drafters"].items() if d["rounds"]}
            assert {"eagle3", "dflash"} <= used <= {"eagle3", "dflash", "ngram"}, stats
            assert ("ngram" in stats["drafters"]) == spec.prompt_lookup
            assert stats["switches"] >= 3, stats


def test_lazy_catch_up_matches_eager_catch_up_round_by_round():
    """The backlog caught up in one pass gives the same drafts as catching up every round."""
    eng = engine()
    runs = {}
    threshold = median_entropy(eng, PROMPTS[2], 80)
    for eager in (False, True):
        spec = SpeculationConfig(method="whiflash", policy="entropy", entropy_threshold=threshold)
        gen, rounds = run(eng, GenerationRequest(PROMPTS[2], 80, speculation=spec), eager)
        runs[eager] = (gen.output, [(r.drafter, r.accepted) for r in rounds], gen.stats())
    assert runs[False][0] == runs[True][0]
    assert runs[False][1] == runs[True][1]  # same drafter and same accepted count every round
    assert runs[False][2]["switches"] >= 3


@pytest.mark.parametrize("error_rate", [0.0, 0.1, 0.4])
def test_accept_reject_bookkeeping_with_an_oracle_drafter(error_rate):
    eng = engine()
    prompt = PROMPTS[1]
    plain = eng.generate(GenerationRequest(prompt, 70, speculation=SpeculationConfig(method="none"))).output
    oracle = OracleDrafter(plain, len(prompt), error_rate, seed=7)
    eng.drafters["eagle3"] = oracle
    gen, rounds = run(eng, GenerationRequest(prompt, 70, speculation=SpeculationConfig(method="eagle3",
                                                                                       num_draft_tokens=5)))
    assert gen.output == plain
    accepted = [r.accepted for r in rounds]
    assert accepted == oracle.expected_accepts
    stats = gen.stats()
    assert stats["accepted_tokens"] == sum(accepted)
    # every emitted token after the first comes from a round: a accepted drafts + 1 target token
    assert sum(a + 1 for a in accepted) >= len(plain) - 1
    assert stats["acceptance_length"] == pytest.approx((len(plain) - 1) / stats["rounds"], abs=1e-3)
    sources = gen.sources
    assert sources[0] == "target"
    assert sources.count("eagle3") == min(sum(accepted), len(plain) - 1)
    if error_rate == 0.0:
        assert stats["acceptance_length"] > 5.0


def test_trace_records_source_and_round_of_every_token():
    eng = engine()
    spec = SpeculationConfig(method="whiflash", entropy_threshold=3.2, trace=True)
    gen = eng.generate(GenerationRequest(PROMPTS[1], 40, speculation=spec))
    stats = gen.stats()
    assert len(stats["tokens"]) == len(gen.output) == 40
    assert [t["id"] for t in stats["tokens"]] == gen.output
    assert stats["tokens"][0]["round"] == 0 and stats["tokens"][0]["source"] == "target"
    rounds = [t["round"] for t in stats["tokens"]]
    assert rounds == sorted(rounds) and rounds[-1] == stats["rounds"]
    # each round ends with exactly one target token (unless the output was cut at max tokens)
    for r in range(1, stats["rounds"]):
        srcs = [t["source"] for t in stats["tokens"] if t["round"] == r]
        assert srcs[-1] == "target" and srcs.count("target") == 1
    assert set(t["source"] for t in stats["tokens"]) <= {"target", "eagle3", "dflash", "ngram"}


def test_stop_token_and_max_tokens():
    eng = engine()
    plain = eng.generate(GenerationRequest(PROMPTS[1], 30, speculation=SpeculationConfig(method="none"))).output
    stop = plain[10]
    first = plain.index(stop)
    for method in METHODS:
        gen = eng.generate(GenerationRequest(PROMPTS[1], 30, stop_token_ids=[stop],
                                             speculation=SpeculationConfig(method=method, entropy_threshold=3.2)))
        assert gen.output == plain[:first] and gen.finish_reason == "stop", method
        gen = eng.generate(GenerationRequest(PROMPTS[1], 7, speculation=SpeculationConfig(method=method)))
        assert gen.output == plain[:7] and gen.finish_reason == "length", method


def test_unknown_method_is_rejected():
    eng = Engine(tiny_target(), None, {})
    with pytest.raises(ValueError, match="not available"):
        eng.start(GenerationRequest([1, 2, 3], 5, speculation=SpeculationConfig(method="eagle3")))


def test_large_forwards_alone_run_on_the_large_thread_count(monkeypatch):
    """Engine.threads_for: a prefill of LARGE_FORWARD_ROWS rows or more runs on `large_threads`, the
    rounds after it on the caller's threads (a server's step_threads), and the count comes back."""
    from whiflash_core.engine import LARGE_FORWARD_ROWS

    target = tiny_target()
    engine = Engine(target, None, {"eagle3": tiny_eagle(target)})
    seen: list[tuple[int, int]] = []
    forward = type(target).forward

    def recording(self, tokens, *args, **kwargs):
        seen.append((tokens.shape[0], torch.get_num_threads()))
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(type(target), "forward", recording)
    before = torch.get_num_threads()
    large = before + 1
    prompt = torch.randint(0, VOCAB, (LARGE_FORWARD_ROWS + 3,), generator=torch.Generator().manual_seed(5)).tolist()
    request = GenerationRequest(prompt, 6, speculation=SpeculationConfig(method="eagle3"))
    plain = Engine(tiny_target(), None, {"eagle3": tiny_eagle(tiny_target())}).generate(request).output
    seen.clear()

    engine.large_threads = large
    try:
        out = engine.generate(request).output
    finally:
        torch.set_num_threads(before)
    assert out == plain   # the thread count never changes a token
    assert seen[0] == (LARGE_FORWARD_ROWS + 3, large)
    assert len(seen) > 1 and all(threads == before for rows, threads in seen[1:])
    assert torch.get_num_threads() == before

    seen.clear()
    engine.large_threads = None   # unset: every forward on the caller's threads
    engine.generate(request)
    assert {threads for _, threads in seen} == {before}

    seen.clear()
    engine.large_threads, engine.large_from_rows = large, len(prompt) + 1   # --large-forward-rows above the prompt
    try:
        engine.generate(request)
    finally:
        torch.set_num_threads(before)
    assert {threads for _, threads in seen} == {before}


def test_a_short_dflash_draft_is_the_prefix_of_its_whole_block():
    """A DFlash block attends to itself both ways, so a block of k + 1 slots predicts otherwise
    than the first k slots of the trained block: a draft of k tokens must be the whole block's
    first k (the router prices block prefixes, and its labels are taken at the whole block)."""
    target = tiny_target()
    drafter = tiny_dflash(target, block=5)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (40,), generator=gen)
    taps = torch.randn(40, len(drafter.tap_layers), target.cfg.hidden_size, generator=gen, dtype=target.dtype)
    for n in (6, 17, 30):
        ctx = Context(ids, n, taps, drafter.tap_layers)
        state = drafter.new_state(40)
        # sampled drafts carry the proposal distributions q [k, V]: equal floats, not just equal argmaxes
        sampling = DraftSampling(temperature=1.0)
        whole = drafter.propose(state, ctx, drafter.max_draft_tokens, sampling).probs
        assert whole.shape[0] == 4
        for k in range(1, 4):
            assert torch.equal(drafter.propose(state, ctx, k, sampling).probs, whole[:k]), (n, k)
