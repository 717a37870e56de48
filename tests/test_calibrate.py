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
    assert cal.threshold(0.0) == 1.0 and cal.threshold(1.0) == 2.0 and cal.threshold(0.5) == 1.5
    assert [r["threshold"] for r in cal.sweep] == [1.0, 2.0, 3.0]


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
        gen = engine.generate(GenerationRequest(prompts[0].ids, 30, speculation=SpeculationConfig(alpha=alpha)))
        rounds[alpha] = {k: v["rounds"] for k, v in gen.stats()["drafters"].items()}
    assert rounds[0.0]["dflash"] == 0 and rounds[1.0]["eagle3"] == 0
