"""`--init-from DIR`: continue from a shipped or exported drafter instead of a random init, so
every training session adds to the weights (and the hours) already spent.

What comes from DIR, so its weights load one to one: the architecture (layers, block size, taps,
chain length...) and the draft vocabulary (head rows and d2t/t2d), including a head pruned at ship
time. The run's own `--draft-vocab`, `--layers`, `--taps`, ... are ignored; `--grow-vocab N`
widens that vocabulary to N rows (grow_vocab()).

Bookkeeping, so model cards stay truthful across sessions: every export records this run's steps,
tokens and wall hours, the cumulative totals (the init drafter's plus this run's), where it
started from and the lineage (one entry per earlier run: data, filters, steps, tokens, hours).
Drafters exported before these fields existed (the first shipped ones) carry the totals only in
their model card, which is read instead.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..target import TargetModel
from .data import Example, build_draft_vocab, data_dirs


@dataclass
class InitDrafter:
    """A drafter to continue: what the task needs to rebuild it, and its training history."""
    config: dict[str, Any]              # the task config (the drafter's config dataclass as a dict)
    vocab_ids: torch.Tensor             # target id of each draft-vocabulary row, sorted
    state: dict[str, torch.Tensor]      # weights, as DrafterTask.state_dict() gives them
    prior: dict[str, Any]               # init_from, steps, tokens, hours, lineage (see history())


def _kind(raw: dict[str, Any]) -> str:
    """Which drafter a published config.json describes."""
    if "dflash_config" in raw or "DFlashDraftModel" in raw.get("architectures", []):
        return "dflash"
    if raw.get("speculators_model_type") == "eagle3" or "eagle_config" in raw:
        return "eagle3"
    raise SystemExit("--init-from: the config.json is neither an EAGLE-3 nor a DFlash drafter")


def load_init(path: str, name: str, target: TargetModel) -> InitDrafter:
    """The drafter in `path` (published layout) as the starting point of a `name` run."""
    from ..drafters.dflash import DFlashDrafter
    from ..drafters.eagle3 import Eagle3Drafter

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    if _kind(raw) != name:
        raise SystemExit(f"--init-from {path} is a {_kind(raw)} drafter, not {name}")
    # the drafters' own loaders read every published layout; float32 is what the loop trains in
    cls = Eagle3Drafter if name == "eagle3" else DFlashDrafter
    drafter = cls.load(path, target, dtype=torch.float32)
    state = {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens.")}
    if drafter.d2t is None:  # a DFlash head over the whole target vocabulary
        vocab_ids = torch.arange(target.cfg.vocab_size)
    else:
        vocab_ids = torch.arange(len(drafter.d2t)) + drafter.d2t
    return InitDrafter(asdict(drafter.cfg), vocab_ids, state, history(path, raw))


def grow_vocab(init: InitDrafter, examples: list[Example], size: int, target: TargetModel) -> InitDrafter:
    """`init` with its draft vocabulary widened to `size` rows: the most frequent response tokens of
    `examples` that it lacks are added. Why: a head is chosen once, on the data of its first run, and
    `--init-from` keeps it, so text that came later (translation, summaries) stays out of reach: a
    target token outside the head can never be drafted (and is left out of the loss). Every trained
    row keeps its weights; a new row starts as the target's LM-head row for its token, as a fresh
    head does (build_task)."""
    old = init.vocab_ids
    if "lm_head.weight" not in init.state or init.config.get("draft_vocab_size") != len(old):
        raise SystemExit("--grow-vocab: the init drafter has no reduced head to grow")
    if size <= len(old):
        raise SystemExit(f"--grow-vocab {size}: the init drafter's head already has {len(old)} rows")
    lacking = torch.ones(target.cfg.vocab_size, dtype=torch.bool).index_fill_(0, old, False).nonzero().flatten()
    added, _ = build_draft_vocab(examples, size - len(old), target.cfg.vocab_size, within=lacking)
    ids = torch.sort(torch.cat([old, added])).values
    # row r of the grown head: the old head's row for ids[r] where it had one, else the target's
    head = target.lm_head.weight.detach().float()[ids].clone()
    row_of_old = torch.searchsorted(ids, old)  # old is sorted, so its rows land in order
    head[row_of_old] = init.state["lm_head.weight"].float()
    state = dict(init.state, **{"lm_head.weight": head})
    # the vocabulary maps, as the drafters' set_vocab() writes them
    if "d2t" in state:
        state["d2t"] = ids - torch.arange(len(ids))
    if "t2d" in state:
        state["t2d"] = torch.zeros_like(state["t2d"]).index_fill_(0, ids, True)
    return InitDrafter(dict(init.config, draft_vocab_size=size), ids, state, init.prior)


# --------------------------------------------------------------------------- bookkeeping

def history(path: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The training behind the drafter in `path`: {"init_from", "steps", "tokens", "hours",
    "lineage"}, where lineage lists every run that made the weights, oldest first."""
    info = raw.get("whiflash_training")
    if not info:
        raise SystemExit(f"--init-from {path}: no whiflash_training block in config.json, so its "
                         "training cannot be counted (only drafters trained here can be continued)")
    if "cumulative_steps" in info:
        lineage = [*info.get("lineage", []), run_entry(info)]
    else:
        lineage = [_legacy_entry(path, info)]
    return {"init_from": os.path.abspath(path),
            "steps": sum(r["steps"] for r in lineage),
            "tokens": sum(r["tokens"] for r in lineage),
            "hours": round(sum(r["hours"] for r in lineage), 3),
            "lineage": lineage}


def run_entry(info: dict[str, Any]) -> dict[str, Any]:
    """One run's lineage entry from the whiflash_training block its export wrote."""
    return {"data": _as_list(info["data"]), "exclude_sources": info.get("exclude_sources", ""),
            "repeat_sources": info.get("repeat_sources", ""), "steps": info["step"], "tokens": info["tokens"],
            "hours": info["wall_hours"], "init_from": info.get("init_from")}


def _as_list(data: str | list[str]) -> list[str]:
    return data_dirs(data) if isinstance(data, str) else list(data)


def _legacy_entry(path: str, info: dict[str, Any]) -> dict[str, Any]:
    """A drafter shipped before exports counted tokens and hours: its model card states them."""
    card_path = os.path.join(path, "README.md")
    card = open(card_path).read() if os.path.exists(card_path) else ""
    tokens = re.search(r"tokens seen: ([\d,]+)", card)
    hours = re.search(r"wall time: ([\d.]+) h", card)
    if not (tokens and hours):
        raise SystemExit(f"--init-from {path}: neither its config.json nor a model card records the tokens "
                         "and hours it was trained for")
    excluded = re.search(r"--exclude-sources (\S+)", card)
    return {"data": _as_list(info["data"]), "exclude_sources": excluded.group(1).rstrip("`") if excluded else "",
            "steps": info["step"], "tokens": int(tokens.group(1).replace(",", "")),
            "hours": float(hours.group(1)), "init_from": None}


def totals(prior: dict[str, Any] | None, steps: int, tokens: int, hours: float) -> dict[str, Any]:
    """The whiflash_training fields that count a run: its own steps' tokens and hours, where it
    started from, the cumulative totals including every earlier run, and their lineage."""
    p = prior or {"init_from": None, "steps": 0, "tokens": 0, "hours": 0.0, "lineage": []}
    return {"tokens": tokens, "wall_hours": round(hours, 3), "init_from": p["init_from"],
            "cumulative_steps": p["steps"] + steps, "cumulative_tokens": p["tokens"] + tokens,
            "cumulative_hours": round(p["hours"] + hours, 3), "lineage": p["lineage"]}
