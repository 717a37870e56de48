"""Router calibration picks the thresholds alpha interpolates between; alpha moves the router."""
from __future__ import annotations

import torch

from tiny import tiny_dflash, tiny_eagle, tiny_target
from whiflash_core.bench.calibrate import ThresholdResult, choose, sweep
from whiflash_core.bench.workload import BenchPrompt
from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig
from whiflash_core.router import RouterCalibration
from whiflash_core.sampling import SamplingParams


def test_choose_maximises_acceptance_and_speed_separately():
    rs = [ThresholdResult(1.0, rounds=10, round_tokens=30, decode_tokens=30, decode_s=3.0),   # AL 3, 10 tok/s
          ThresholdResult(2.0, rounds=10, round_tokens=25, decode_tokens=25, decode_s=1.0),   # AL 2.5, 25 tok/s
          ThresholdResult(3.0, rounds=10, round_tokens=20, decode_tokens=20, decode_s=1.0)]   # AL 2, 20 tok/s
    cal = choose(rs, "test")
    assert (cal.threshold_al, cal.threshold_tps) == (1.0, 2.0)
    assert cal.threshold(0.0) == 1.0 and cal.threshold(1.0) == 2.0
    assert [r["threshold"] for r in cal.sweep] == [1.0, 2.0, 3.0]
    # alpha 0.5: a 200 ms round budget; only the tokens/s-best point (100 ms rounds) fits
    assert cal.threshold(0.5) == 2.0
    # without a measured sweep, alpha interpolates the two thresholds linearly
    assert RouterCalibration(1.0, 2.0).threshold(0.5) == 1.5


def test_higher_alpha_never_picks_longer_measured_rounds():
    """The documented promise, on many random sweeps: mean round time (as measured by the
    calibration bench) is non-increasing in alpha, and both ends are the calibrated thresholds."""
    gen = torch.Generator().manual_seed(0)
    alphas = [i / 20 for i in range(21)]
    for trial in range(200):
        results = []
        for j in range(int(torch.randint(1, 8, (1,), generator=gen))):
            rounds = 10
            tokens = int(torch.randint(10, 60, (1,), generator=gen))
            seconds = float(torch.rand(1, generator=gen)) * 2 + 0.1
            results.append(ThresholdResult(0.5 * j, rounds, tokens, tokens, seconds))
        cal = choose(results, "random")
        round_ms = {p["threshold"]: p["round_ms"] for p in cal.sweep}
        picked = [round_ms[cal.threshold(a)] for a in alphas]
        assert all(b <= a + 1e-9 for a, b in zip(picked, picked[1:])), (trial, picked)
        assert cal.threshold(1.0) == cal.threshold_tps
        if cal.latency_path()[0]["threshold"] == cal.threshold_al:
            assert cal.threshold(0.0) == cal.threshold_al


def test_calibration_saves_and_loads(tmp_path):
    cal = RouterCalibration(0.5, 3.0, "unit", sweep=[{"threshold": 0.5}])
    cal.save(str(tmp_path / "router.json"))
    assert RouterCalibration.load(str(tmp_path / "router.json")) == cal


def test_sweep_runs_the_engine_and_alpha_shifts_rounds_between_drafters():
    target = tiny_target()
    engine = Engine(target, None, {"eagle3": tiny_eagle(target), "dflash": tiny_dflash(target)})
    prompts = [BenchPrompt(str(i), "c", []) for i in range(2)]
    for i, p in enumerate(prompts):
        p.ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(i)).tolist()
    results = sweep(engine, prompts, [0.0, 100.0], 30, SamplingParams(), SpeculationConfig())
    share = [r.as_dict()["eagle3_round_share"] for r in results]
    assert share == [1.0, 0.0]  # entropy > 0 always: eagle3; entropy > 100 never: dflash
    # alpha interpolates the threshold: from all-eagle3 (alpha 0) to all-dflash (alpha 1)
    engine.calibration = RouterCalibration(threshold_al=0.0, threshold_tps=100.0)
    rounds = {}
    for alpha in (0.0, 1.0):
        gen = engine.generate(GenerationRequest(prompts[0].ids, 30, speculation=SpeculationConfig(policy="entropy", alpha=alpha)))
        rounds[alpha] = {k: v["rounds"] for k, v in gen.stats()["drafters"].items()}
    assert rounds[0.0]["dflash"] == 0 and rounds[1.0]["eagle3"] == 0
