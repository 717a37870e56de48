"""Per-round drafter routing.

Entropy policy (WhiFlash-Entropy): the target's next-token entropy at the last accepted position
decides. High entropy means uncertain text, where a sequential chain drafter (EAGLE-3) does
better; low entropy means predictable text, where a block drafter (DFlash) commits many tokens
cheaply. So: entropy > threshold -> eagle3, else dflash.

The `alpha` knob (0..1) trades expected accepted tokens against latency. Calibration (from
`whiflash bench`) gives two thresholds: `threshold_al`, the one that maximised acceptance length,
and `threshold_tps`, the one that maximised tokens/s; alpha interpolates linearly between them
(alpha=0 -> most accepted tokens per round, alpha=1 -> most tokens per second).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

import torch

from .layers import entropy_from_logits


@dataclass
class RouterCalibration:
    threshold_al: float = 2.0
    threshold_tps: float = 2.0
    source: str = "uncalibrated default"
    sweep: list[dict] = field(default_factory=list)  # per threshold: acceptance length, tok/s, round ms

    def threshold(self, alpha: float) -> float:
        return (1.0 - alpha) * self.threshold_al + alpha * self.threshold_tps

    @classmethod
    def load(cls, path: str) -> "RouterCalibration":
        with open(path) as f:
            raw = json.load(f)
        return cls(**{k: raw[k] for k in ("threshold_al", "threshold_tps", "source", "sweep") if k in raw})

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)


class EntropyRouter:
    """Chooses between an autoregressive (`ar`) and a block (`block`) drafter each round."""

    def __init__(self, threshold: float, ar: str = "eagle3", block: str = "dflash"):
        self.threshold = threshold
        self.ar, self.block = ar, block

    def choose(self, logits: torch.Tensor) -> tuple[str, float]:
        h = entropy_from_logits(logits)
        return (self.ar if h > self.threshold else self.block), h
