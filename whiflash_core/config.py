"""Speculation settings: the one definition of every knob, its default, bounds and help.

The engine reads `SpeculationConfig`; the API's `speculation` object (app/schemas.py) and the
server's defaults (app/settings.py) are generated from its fields, so a default or a bound is
written once, here.

Field metadata: `help` (text for the API schema and CLIs), `ge` / `le` (bounds checked by the API
and the server settings), `api=False` for engine-only knobs a request cannot set.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .router import Method, Policy


@dataclass
class SpeculationConfig:
    method: Method = field(default="whiflash", metadata={
        "help": "drafting method: none, eagle3, dflash, ngram (prompt lookup) or whiflash (routed)"})
    policy: Policy = field(default="learned", metadata={
        "help": "whiflash routing: learned (argmax over every drafter and draft length of expected tokens / "
                "expected round time ** alpha, the expected tokens predicted by the MLP that `whiflash train "
                "router` ships beside the drafters; without that file, cost), cost (the same argmax, the "
                "expected tokens from this request's acceptance so far) or entropy (the paper's threshold "
                "rule, the baseline)"})
    # 1 by default: on one stream the tokens/s-best choice (Spec-Bench alpha sweep, README "Routing
    # and alpha"); a server whose verify forwards are shared between many requests may want less
    alpha: float = field(default=1.0, metadata={
        "ge": 0.0, "le": 1.0, "help": "router trade-off: 1 = most tokens per second for this request (lowest "
                                      "latency), 0 = most tokens per target forward"})
    num_draft_tokens: int | None = field(default=None, metadata={
        "ge": 1, "le": 64, "help": "EAGLE-3 chain / prompt-lookup draft length (default: the drafter's)"})
    block_size: int | None = field(default=None, metadata={
        "ge": 2, "le": 65, "help": "DFlash block incl. the anchor (default: the drafter's)"})
    prompt_lookup: bool = field(default=True, metadata={
        "help": "whiflash: route to prompt lookup too (the entropy policy takes its draft first where the "
                "context repeats)"})
    trace: bool = field(default=False, metadata={"help": "return every token with its source and round"})
    entropy_threshold: float | None = field(default=None, metadata={
        "api": False, "help": "explicit router threshold instead of the calibrated one"})


def speculation_field(name: str) -> dict[str, Any]:
    """Default, bounds and description of one SpeculationConfig field (for pydantic's Field)."""
    f = next(f for f in fields(SpeculationConfig) if f.name == name)
    out: dict[str, Any] = {"default": None if f.default is MISSING else f.default, "description": f.metadata["help"]}
    out.update({k: f.metadata[k] for k in ("ge", "le") if k in f.metadata})
    return out


def api_fields() -> list[str]:
    """The fields a request's `speculation` object may set."""
    return [f.name for f in fields(SpeculationConfig) if f.metadata.get("api", True)]
