"""Per-round drafter routing.

Entropy policy (WhiFlash-Entropy): the target's next-token entropy at the last accepted position
decides. High entropy means uncertain text, where a sequential chain drafter (EAGLE-3) does
better; low entropy means predictable text, where a block drafter (DFlash) commits many tokens
cheaply. So: entropy > threshold -> eagle3, else dflash.

The `alpha` knob (0..1) trades expected accepted tokens against latency. Calibration (from
`whiflash bench --calibrate-router`) measures a sweep of thresholds and keeps two: `threshold_al`,
the one that maximised acceptance length, and `threshold_tps`, the one that maximised tokens/s.
alpha=0 picks the first, alpha=1 the second. In between, alpha sets a round-latency budget
interpolated between the two points' measured round times, and the router takes the measured
threshold with the longest rounds that fit it. So on the calibration bench, a higher alpha never
picks a threshold with longer mean rounds (the tokens/s-best point never has longer rounds than the
acceptance-best one: tok/s = AL / round time). Without a measured sweep it falls back to linear
interpolation of the two thresholds.

`Router` is where methods meet drafters: it knows which drafters a method uses, asks the chosen
drafter how long a draft it makes (`Drafter.draft_len`), and decides each round's drafter. The
engine never names a drafter.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

import torch

from .drafters.base import Context, Drafter, DrafterState
from .layers import entropy_from_logits

if TYPE_CHECKING:
    from .config import SpeculationConfig

Method = Literal["none", "eagle3", "dflash", "ngram", "whiflash"]
METHODS: tuple[str, ...] = get_args(Method)
# The drafters each method routes between: one is used every round, two go through the entropy
# router as (autoregressive, block).
ROUTED: dict[str, tuple[str, ...]] = {"none": (), "eagle3": ("eagle3",), "dflash": ("dflash",),
                                      "ngram": ("ngram",), "whiflash": ("eagle3", "dflash")}
# whiflash consults prompt lookup first and takes its draft when the context's last LOOKUP_FIRST_NGRAM
# tokens occurred before (a shorter match is too often chance in free text to beat the router's pick)
LOOKUP, LOOKUP_FIRST_METHODS, LOOKUP_FIRST_NGRAM = "ngram", ("whiflash",), 3


def available_methods(drafters) -> list[str]:
    """The methods whose drafters are all loaded, in METHODS order."""
    return [m for m in METHODS if all(name in drafters for name in ROUTED[m])]


@dataclass
class RouterCalibration:
    threshold_al: float = 2.0
    threshold_tps: float = 2.0
    source: str = "uncalibrated default"
    sweep: list[dict] = field(default_factory=list)  # per threshold: acceptance length, tok/s, round ms

    def threshold(self, alpha: float) -> float:
        path = self.latency_path()
        if not path:
            return (1.0 - alpha) * self.threshold_al + alpha * self.threshold_tps
        budget = (1.0 - alpha) * path[0]["round_ms"] + alpha * path[-1]["round_ms"]
        return next(p["threshold"] for p in path if p["round_ms"] <= budget + 1e-9)

    def latency_path(self) -> list[dict]:
        """Measured sweep points alpha can pick, longest rounds first: the acceptance-best point,
        then those whose round time lies between it and the tokens/s-best point (ties: faster
        first), ending at the tokens/s-best point. Empty without a sweep holding both ends."""
        by_t = {p["threshold"]: p for p in self.sweep if "round_ms" in p}
        if self.threshold_al not in by_t or self.threshold_tps not in by_t:
            return []
        hi, lo = by_t[self.threshold_al], by_t[self.threshold_tps]
        if lo["round_ms"] >= hi["round_ms"]:  # measurement noise: the fast end is the only safe pick
            return [lo]
        middle = [p for p in by_t.values() if p is not hi and p is not lo
                  and lo["round_ms"] <= p["round_ms"] <= hi["round_ms"]]
        middle.sort(key=lambda p: (-p["round_ms"], -p["tokens_per_s"]))
        # at the fast end's round time the fast end itself wins any tie (it has the best tok/s)
        middle = [p for p in middle if p["round_ms"] > lo["round_ms"]]
        return [hi, *middle, lo]

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


@dataclass
class Route:
    """This round's decision: which drafter, how long a draft (before the request's own limits)."""
    drafter: str | None              # None: no drafting (method "none")
    draft_len: int = 0
    switched: bool = False           # differs from the previous round's drafter
    entropy: float | None = None     # the entropy router's input, when it decided


class Router:
    """Per-request routing: the drafters a method uses and each round's choice among them."""

    def __init__(self, drafters: dict[str, Drafter], spec: SpeculationConfig, threshold: float):
        routed = ROUTED[spec.method]
        lookup_first = spec.method in LOOKUP_FIRST_METHODS and spec.prompt_lookup
        names = routed + ((LOOKUP,) if lookup_first else ())
        self.drafters = {name: drafters[name] for name in names}      # every drafter this request may use
        self.draft_lens = {name: d.draft_len(spec) for name, d in self.drafters.items()}
        self.lookup = drafters[LOOKUP] if lookup_first else None
        self.routed = routed
        self.entropy = EntropyRouter(threshold, *routed) if len(routed) == 2 else None
        self.previous: str | None = None

    @property
    def longest_draft(self) -> int:
        return max(self.draft_lens.values(), default=0)

    def route(self, states: dict[str, DrafterState], ctx: Context, logits: torch.Tensor) -> Route:
        """Choose from the verified context and the target's logits at its last position [V]."""
        entropy = None
        if not self.routed:
            return Route(None)
        if self.lookup is not None and self.lookup.match(states[LOOKUP], ctx.ids, ctx.n)[0] >= LOOKUP_FIRST_NGRAM:
            name = LOOKUP
        elif self.entropy is None:
            name = self.routed[0]
        else:
            name, entropy = self.entropy.choose(logits)
        switched = self.previous is not None and name != self.previous
        self.previous = name
        return Route(name, self.draft_lens[name], switched, entropy)
