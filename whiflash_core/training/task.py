"""What a trainer provides to the shared loop (`DrafterTask`), and the helpers both trainers use.

A trainer is a `DrafterTask`: it builds the drafter, turns a batch into per-sequence work items
(`prepare`), gives one item's loss (`loss`), evaluates teacher-forced accuracy on the val split
(`evaluate`) and exports the published checkpoint (`export`). Sequences are processed one at a
time (the target and the drafter modules use the [T, H] batch-1 layout); a batch is a gradient
accumulation over sequences whose loss normaliser is computed up front (`prepare`), so the
gradient equals that of the whole-batch mean while only one sequence's activations are alive.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..target import TargetModel
from .data import Example
from .features import Features


@dataclass
class Item:
    """One sequence's work in a batch, as prepared by a task."""
    example: Example
    feats: Features
    data: dict[str, Any] = field(default_factory=dict)


class DrafterTask(ABC):
    """What a trainer provides to the shared loop."""

    name: str
    model: nn.Module
    tap_layers: tuple[int, ...]
    need_hidden: bool
    n_slots: int  # accuracy is tracked per unroll step (EAGLE-3) / block slot (DFlash)

    def trainable(self, freeze_head: bool) -> list[nn.Parameter]:
        """Parameters the optimiser updates: everything except shared target weights."""
        params = []
        for name, p in self.model.named_parameters():
            if name.startswith("embed_tokens.") or (freeze_head and name.startswith("lm_head.")):
                p.requires_grad_(False)
                continue
            params.append(p)
        return params

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if not k.startswith("embed_tokens.")}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.startswith("embed_tokens.")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the {self.name} drafter: "
                             f"missing {missing}, unexpected {unexpected}")

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The drafter config as a plain dict (stored in the checkpoint to rebuild on resume)."""

    @abstractmethod
    def prepare(self, items: list[Item], gen: torch.Generator) -> Any:
        """Fill each item's `data` (masks, anchors...) and return the batch normaliser."""

    @abstractmethod
    def loss(self, item: Item, norm: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(this item's share of the batch loss, counts {"n", "correct", "ce"} per slot)."""

    @abstractmethod
    def evaluate(self, items: list[Item]) -> dict[str, Any]:
        """Teacher-forced validation metrics (no gradients)."""

    @abstractmethod
    def export(self, path: str, extra: dict[str, Any]) -> None:
        """Save the drafter in its published layout."""


def slot_counts(n_slots: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(n_slots, dtype=torch.float64) for k in ("n", "correct", "ce")}


def chain_metrics(correct: torch.Tensor, available: torch.Tensor, sources: list[str],
                  chain4: int = 4) -> dict[str, Any]:
    """Validation summary from per-start correctness.

    correct/available: [N, K] bool, row = one drafting start (a context position for EAGLE-3, an
    anchor for DFlash), column k = draft k. Teacher forcing makes "draft k correct" equal to
    "draft k is accepted given drafts < k were", so the leading run of correct drafts is the
    greedy acceptance of a chain started there; tau = 1 + its mean (tokens per target forward).
    """
    ok = correct & available
    run = torch.cumprod(ok.long(), dim=1)
    acc = (ok.sum(0).double() / available.sum(0).clamp(min=1)).tolist()
    tau = 1 + run.sum(1).double()
    tau4 = 1 + run[:, :chain4].sum(1).double()
    by_source: dict[str, list[float]] = defaultdict(list)
    for src, t in zip(sources, tau.tolist()):
        by_source[src].append(t)
    return {
        "acc": [round(a, 4) for a in acc],
        "tau": round(float(tau.mean()), 4) if len(tau) else 0.0,
        "tau4": round(float(tau4.mean()), 4) if len(tau4) else 0.0,
        "tau_by_source": {s: round(sum(v) / len(v), 3) for s, v in sorted(by_source.items())},
        "starts": int(correct.shape[0]),
    }


# The drafters' reduced heads start as the target's LM-head rows (tied embedding for SmolLM2). With
# the target's final-norm gain as well, an untrained drafter's random hidden state gives large,
# confidently wrong logits (soft CE 14-22 for EAGLE-3, 70-120 for DFlash, against ln 8192 = 9 for a
# uniform guess) and gradient norms in the hundreds. A tenth of that gain starts near uniform. EAGLE-3
# A/B on 40 steps of the real data: val tau 1.24 (gain x0.1) vs 1.18 (x1); step-4 acc .106 vs .062.
HEAD_GAIN_INIT = 0.1


def init_head_norm(norm: nn.Module, target: TargetModel) -> None:
    """The drafter's output norm gain := HEAD_GAIN_INIT x the target's final-norm gain."""
    with torch.no_grad():
        norm.weight.copy_(target.norm.weight.float() * HEAD_GAIN_INIT)
