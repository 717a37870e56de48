"""Router calibration: sweep the entropy threshold, keep the two that matter for `alpha`.

    whiflash bench --workload FILE --calibrate-router 0.5,1,1.5,2,3,4 [--router-out DIR/router.json]

For every threshold the `whiflash` method runs every prompt (thresholds interleaved per prompt,
as the bench interleaves methods). Per threshold: acceptance length (tokens per target forward),
decode tokens/s and mean round latency. `threshold_al` maximises acceptance length and
`threshold_tps` tokens/s; a request's `alpha` interpolates between them (router.py). The sweep is
written next to them so the effect of alpha can be checked against what was measured.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..router import RouterCalibration


@dataclass
class ThresholdResult:
    threshold: float
    rounds: int = 0
    round_tokens: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    eagle3_rounds: int = 0

    @property
    def acceptance_length(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def round_ms(self) -> float:
        return 1000 * self.decode_s / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {"threshold": self.threshold, "acceptance_length": round(self.acceptance_length, 4),
                "tokens_per_s": round(self.tokens_per_s, 3), "round_ms": round(self.round_ms, 3),
                "eagle3_round_share": round(self.eagle3_rounds / self.rounds, 4) if self.rounds else 0.0,
                "rounds": self.rounds}


def choose(results: list[ThresholdResult], source: str) -> RouterCalibration:
    """Thresholds maximising acceptance length and tokens/s (ties: the cheaper rounds win)."""
    best_al = max(results, key=lambda r: (round(r.acceptance_length, 6), -r.round_ms))
    best_tps = max(results, key=lambda r: (r.tokens_per_s, -r.round_ms))
    return RouterCalibration(threshold_al=best_al.threshold, threshold_tps=best_tps.threshold, source=source,
                             sweep=[r.as_dict() for r in results])


def sweep(engine, prompts, thresholds: list[float], max_tokens: int, sampling, base_spec) -> list[ThresholdResult]:
    from dataclasses import replace

    from ..engine import GenerationRequest

    results = {t: ThresholdResult(t) for t in thresholds}
    for i, prompt in enumerate(prompts):
        order = thresholds[i % len(thresholds):] + thresholds[: i % len(thresholds)]
        for t in order:
            spec = replace(base_spec, method="whiflash", policy="entropy", entropy_threshold=t, trace=False)
            gen = engine.start(GenerationRequest(prompt.ids, max_tokens, sampling, spec))
            gen.prefill()
            t0 = time.perf_counter()
            while not gen.finished:
                gen.step()
            r = results[t]
            r.decode_s += time.perf_counter() - t0
            r.rounds += gen.tally.rounds
            r.round_tokens += gen.tally.decided
            r.decode_tokens += max(0, len(gen.output) - 1)
            r.eagle3_rounds += gen.tally.drafters["eagle3"].rounds
    return [results[t] for t in thresholds]
