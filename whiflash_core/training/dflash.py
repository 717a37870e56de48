"""`whiflash train dflash`: train a DFlash block-diffusion drafter (arXiv 2602.06036, §3 recipe).

Per sequence (prompt + response, teacher-forced through the frozen target):

  * features: taps at z-lab `target_layer_ids` (output of decoder layer i = HF hidden_states[i+1]),
    default 4 spread by `default_target_layer_ids`; `context_kv` turns them into every layer's
    context K/V (KV injection), computed once per sequence for all of its blocks;
  * anchors: random response positions p (the anchor is the pending token, as at inference; the
    first response token is the first anchor a prompt ever gets), re-drawn every step;
  * block = [token p, MASK x (b-1)] at positions p..p+b-1; its queries see the context K/V of
    positions strictly before p plus their own block (bidirectional), never another block;
  * labels are same-position: slot j predicts token p+j (j = 1..b-1), cross-entropy weighted
    exp(-(j-1)/gamma), over a reduced draft vocabulary (an extension: the 49k LM head would
    dominate CPU cost) whose head starts as the target's LM-head rows. The target's embedding is
    shared and frozen.

All blocks of a sequence run in one forward of the drafter's own layers (`DFlashLayer.forward`
with a block-diagonal + context mask), so the layers are the inference modules unchanged.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..drafters.dflash import SMOLLM2_MASK_TOKEN_ID, DFlashConfig, DFlashDrafter, default_target_layer_ids
from ..layers import init_linear_
from ..target import TargetModel
from ..cli_args import add_arguments, setting
from .loop import TrainSettings, train
from .task import DrafterTask, Item, chain_metrics, init_head_norm, slot_counts

# a fresh drafter's block (z-lab trains 16 or 10; on a CPU each slot past the first few costs a
# verify row: the shipped drafter went on at 4, models/smollm2-135m-instruct/dflash/README.md)
DEFAULT_BLOCK_SIZE = 8


@dataclass
class DFlashSettings(TrainSettings):
    lr: float = setting(6e-4, "peak learning rate")
    clip: float = setting(1.0, "gradient-norm clip")
    block_size: int | None = setting(None, "block length b (b-1 drafts per forward); default: an --init-from "
                                     "drafter's, else 8 (weights do not depend on it: a run may change it)")
    layers: int = setting(2, "drafter decoder layers")
    # paper: 7 at b=16, 5 at b=10, 4 at b=8
    gamma: float = setting(4.0, "slot j's loss weight is exp(-(j-1)/gamma)")
    anchors_per_seq: int = setting(64, "random blocks per sequence per step")
    num_features: int = setting(4, "tapped target layers (z-lab default rule)")
    target_layer_ids: str | None = setting(None, "explicit z-lab layer ids (outputs of decoder layer i), "
                                           "comma-separated")
    mask_token_id: int | None = setting(None, f"default {SMOLLM2_MASK_TOKEN_ID} (SmolLM2 <empty_output>)")
    val_anchor_stride: int = setting(1, "validate every k-th response position")
    max_block_queries: int = setting(1024, "evaluation: queries per forward (memory bound)", cli=False)


# --------------------------------------------------------------------------- block forward

def block_hidden_many(drafter: DFlashDrafter, ctx_kv, anchors: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Hidden states of many blocks at once.

    ctx_kv: per-layer context (k, v) of positions 0..Tc-1 (Tc >= max anchor); anchors: [A] positions
    of the blocks' first slots; block_ids: [A, b]. Block a sees context keys < anchors[a] and its own
    b keys. Equivalent to `drafter.block_hidden(block_ids[a], anchors[a], ctx_kv[:anchors[a]])` for
    each a. Returns [A, b, H].
    """
    A, b = block_ids.shape
    tc = ctx_kv[0][0].shape[1]
    x = drafter.embed_tokens(block_ids.reshape(-1)).to(drafter.fc.weight.dtype)
    cos, sin = drafter.rotary.tables((anchors.unsqueeze(1) + torch.arange(b)).reshape(-1), x.dtype)
    blk = torch.arange(A).repeat_interleave(b)
    mask = torch.cat([torch.arange(tc).unsqueeze(0) < anchors[blk].unsqueeze(1),  # context strictly before
                      blk.unsqueeze(1) == blk.unsqueeze(0)], dim=1)                # own block, both ways
    for layer, (k, v) in zip(drafter.layers, ctx_kv):
        x = layer(x, cos, sin, k, v, mask)
    return x.view(A, b, -1)


# --------------------------------------------------------------------------- the task

class DFlashTask(DrafterTask):
    name = "dflash"
    need_hidden = False

    def __init__(self, drafter: DFlashDrafter, vocab_ids: torch.Tensor, s: DFlashSettings):
        self.model = drafter
        self.tap_layers = drafter.tap_layers
        self.b = drafter.cfg.block_size
        self.n_slots = self.b - 1
        self.anchors_per_seq = s.anchors_per_seq
        self.val_stride = s.val_anchor_stride
        self.max_queries = s.max_block_queries
        self.weights = torch.tensor([math.exp(-(j - 1) / s.gamma) for j in range(1, self.b)])
        cfg = drafter.cfg
        ids = torch.sort(vocab_ids).values if cfg.draft_vocab_size else torch.arange(cfg.vocab_size)
        self.vocab_ids = ids  # draft index -> target id
        self.t2d_index = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
        self.t2d_index[ids] = torch.arange(len(ids))

    def config(self) -> dict[str, Any]:
        return asdict(self.model.cfg)

    def _blocks(self, item: Item, anchors: torch.Tensor):
        """(block ids [A, b], label draft indices [A, b-1], label-in-sequence mask, labels' target ids)."""
        e = item.example
        block = torch.full((len(anchors), self.b), self.model.cfg.mask_token_id, dtype=torch.long)
        block[:, 0] = e.ids[anchors]
        pos = anchors.unsqueeze(1) + torch.arange(1, self.b)      # slot j predicts position anchor + j
        in_seq = pos <= e.length - 1
        tokens = e.ids[pos.clamp(max=e.length - 1)]
        return block, self.t2d_index[tokens], in_seq, pos.clamp(max=e.length - 1)

    def prepare(self, items: list[Item], gen: torch.Generator) -> float:
        total = 0.0
        for item in items:
            e = item.example
            candidates = torch.arange(e.prompt_len, e.length - 1)   # anchors with at least one label
            pick = torch.randperm(len(candidates), generator=gen)[: self.anchors_per_seq]
            anchors = candidates[pick].sort().values
            block, labels, in_seq, _ = self._blocks(item, anchors)
            valid = in_seq & (labels >= 0)
            item.data.update(anchors=anchors, block=block, labels=labels, valid=valid)
            total += float((self.weights * valid).sum())
        return max(total, 1e-9)

    def loss(self, item: Item, norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        d = item.data
        counts = slot_counts(self.n_slots)
        anchors, valid = d["anchors"], d["valid"]
        ctx_kv = self.model.context_kv(item.feats.taps[: int(anchors.max())], 0)
        h = block_hidden_many(self.model, ctx_kv, anchors, d["block"])[:, 1:]   # [A, b-1, H]
        logits = self.model.head_logits(h[valid]).float()
        ce = F.cross_entropy(logits, d["labels"][valid], reduction="none")
        w = self.weights.expand_as(valid)[valid]
        loss = (w * ce).sum() / norm
        slot = torch.arange(self.n_slots).expand_as(valid)[valid]
        counts["n"] += torch.bincount(slot, minlength=self.n_slots).double()
        counts["ce"] += torch.bincount(slot, weights=ce.detach().double(), minlength=self.n_slots)
        hit = (logits.argmax(-1) == d["labels"][valid]).double()
        counts["correct"] += torch.bincount(slot, weights=hit, minlength=self.n_slots)
        return loss, counts

    def evaluate(self, items: list[Item]) -> dict[str, Any]:
        """Every `val_anchor_stride`-th response position as an anchor. Correct = the slot's draft
        equals the target's greedy token there (what greedy verification checks)."""
        correct, avail, sources = [], [], []
        ce_num = ce_den = 0.0
        for item in items:
            e = item.example
            anchors = torch.arange(e.prompt_len, e.length - 1, self.val_stride)
            ctx_kv = self.model.context_kv(item.feats.taps[: int(anchors.max())], 0)
            chunk = max(1, self.max_queries // self.b)
            for i in range(0, len(anchors), chunk):
                a = anchors[i:i + chunk]
                block, labels, in_seq, pos = self._blocks(item, a)
                logits = self.model.head_logits(block_hidden_many(self.model, ctx_kv, a, block)[:, 1:]).float()
                draft = self.vocab_ids[logits.argmax(-1)]
                correct.append((draft == item.feats.argmax[pos - 1]) & in_seq)
                avail.append(in_seq)
                sources += [e.source] * len(a)
                valid = in_seq & (labels >= 0)
                ce = F.cross_entropy(logits[valid], labels[valid], reduction="none")
                w = self.weights.expand_as(valid)[valid]
                ce_num += float((w * ce).sum())
                ce_den += float(w.sum())
        return {"loss": round(ce_num / max(ce_den, 1e-9), 4),
                **chain_metrics(torch.cat(correct), torch.cat(avail), sources)}

    def export(self, path: str, extra: dict[str, Any]) -> None:
        self.model.save(path, dtype=torch.bfloat16, extra=extra)


def build_task(target: TargetModel, vocab_ids: torch.Tensor, s: DFlashSettings,
               config: dict[str, Any] | None) -> DFlashTask:
    """A fresh drafter (config None) or the skeleton a checkpoint's weights are loaded into."""
    c = target.cfg
    reduced = len(vocab_ids) < c.vocab_size
    if config is None:
        ids = ([int(x) for x in s.target_layer_ids.split(",")] if s.target_layer_ids
               else default_target_layer_ids(c.num_layers, s.num_features))
        mask = s.mask_token_id
        if mask is None:
            mask = SMOLLM2_MASK_TOKEN_ID if c.vocab_size > SMOLLM2_MASK_TOKEN_ID else c.vocab_size - 1
        cfg = DFlashConfig(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_layers=s.layers,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
            block_size=s.block_size or DEFAULT_BLOCK_SIZE, mask_token_id=mask, target_layer_ids=ids,
            num_target_layers=c.num_layers,
            rms_norm_eps=c.rms_norm_eps, draft_vocab_size=len(vocab_ids) if reduced else None)
    else:   # a checkpoint's or an --init-from drafter's config; --block-size may change the block
        cfg = DFlashConfig(**config)
        if s.block_size:
            cfg.block_size = s.block_size
    drafter = DFlashDrafter(cfg, target.embed_tokens, target.lm_head)
    if config is None:
        init_linear_(drafter)
        if cfg.draft_vocab_size:  # reduced head = the target's LM-head rows for the draft ids
            drafter.set_vocab(vocab_ids, target.lm_head.weight)
        init_head_norm(drafter.norm, target)
    return DFlashTask(drafter, vocab_ids, s)


# --------------------------------------------------------------------------- CLI

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("dflash", help="train a DFlash block drafter",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, DFlashSettings)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    train(build_task, "dflash", DFlashSettings.from_args(args))
    return 0
