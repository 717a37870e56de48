"""Assemble an Engine: target + drafters (shipped, given, or random) + router calibration.

Drafter directory layout (what `whiflash train` writes and what ships under models/):

    DIR/eagle3/{config.json, model.safetensors}   SafeAILab or speculators format
    DIR/dflash/{config.json, model.safetensors}   z-lab format
    DIR/router.json                               entropy thresholds from `whiflash bench`
"""
from __future__ import annotations

import logging
import os
import sys

import torch

from .drafters.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids
from .drafters.eagle3 import Eagle3Config, Eagle3Drafter
from .embedded import EMBEDDED_NAME
from .engine import Engine
from .router import RouterCalibration
from .quant import quantize_int8
from .target import DENSE_FROM_ROWS, DTYPES, TargetModel, load_target

log = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED_DRAFTERS = os.path.join(REPO_ROOT, "models", "smollm2-135m-instruct")

# SmolLM2's tokenizer has no mask token. DFlash needs one whose (frozen) embedding row marks
# "to be predicted" and which never occurs in chat text: `<empty_output>` (id 16) is a special
# token from SmolLM2's Jupyter pretraining data that chat prompts and answers never contain.
SMOLLM2_MASK_TOKEN_ID = 16


def random_drafters(target: TargetModel, seed: int = 0, draft_vocab: int = 8192,
                    block_size: int = 8, dflash_layers: int = 2) -> dict:
    """Untrained drafters shaped for `target` (tests, and a fallback with a warning)."""
    c = target.cfg
    dv = min(draft_vocab, c.vocab_size)
    eagle_cfg = Eagle3Config(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size, draft_vocab_size=dv,
        tap_layers=[2, c.num_layers // 2, c.num_layers - 3], rms_norm_eps=c.rms_norm_eps, fc_norm=True,
        num_draft_tokens=4)
    dflash_cfg = DFlashConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_layers=dflash_layers,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
        block_size=block_size, mask_token_id=SMOLLM2_MASK_TOKEN_ID if c.vocab_size > 16 else c.vocab_size - 1,
        target_layer_ids=default_target_layer_ids(c.num_layers, 4), num_target_layers=c.num_layers,
        rms_norm_eps=c.rms_norm_eps, draft_vocab_size=dv if dv < c.vocab_size else None)
    return {
        "eagle3": Eagle3Drafter.random(eagle_cfg, target.embed_tokens, seed=seed, dtype=target.dtype),
        "dflash": DFlashDrafter.random(dflash_cfg, target.embed_tokens, target.lm_head, seed=seed + 1,
                                       dtype=target.dtype),
    }


def load_drafters(path: str, target: TargetModel) -> dict:
    drafters = {}
    L = target.cfg.num_layers
    if os.path.exists(os.path.join(path, "eagle3", "config.json")):
        drafters["eagle3"] = Eagle3Drafter.load(os.path.join(path, "eagle3"), target.embed_tokens, L, target.dtype)
    if os.path.exists(os.path.join(path, "dflash", "config.json")):
        drafters["dflash"] = DFlashDrafter.load(os.path.join(path, "dflash"), target.embed_tokens, target.lm_head,
                                                L, target.dtype)
    return drafters


def load_engine(model: str | None = None, drafters: str | None = None, dtype: str = "bfloat16",
                eagle3: str | None = None, dflash: str | None = None, threads: int | None = None,
                weights: str = "dense") -> Engine:
    """The engine for `model` (None = embedded SmolLM2) with drafters from `drafters` (a directory
    in the layout above), or explicit `eagle3` / `dflash` checkpoint directories."""
    if threads:
        torch.set_num_threads(threads)
    target, tokenizer = load_target(model, DTYPES[dtype], weights)
    found: dict = {}
    directory = drafters or (SHIPPED_DRAFTERS if model is None else None)
    if directory and os.path.isdir(directory):
        found = load_drafters(directory, target)
    L = target.cfg.num_layers
    if eagle3:
        found["eagle3"] = Eagle3Drafter.load(eagle3, target.embed_tokens, L, target.dtype)
    if dflash:
        found["dflash"] = DFlashDrafter.load(dflash, target.embed_tokens, target.lm_head, L, target.dtype)
    if not found:
        print("warning: no trained drafters found; using randomly initialised drafters "
              "(output stays exact, but almost no draft token will be accepted)", file=sys.stderr)
        found = random_drafters(target)
    chosen = target.formats.weights if target.formats is not None else weights
    if chosen != "dense":  # a light target gets int8 drafters (see quantize_int8)
        for drafter in found.values():
            quantize_int8(drafter, DENSE_FROM_ROWS)
    calibration = RouterCalibration()
    if directory and os.path.exists(os.path.join(directory, "router.json")):
        calibration = RouterCalibration.load(os.path.join(directory, "router.json"))
    name = EMBEDDED_NAME if model is None else os.path.basename(os.path.normpath(model))
    return Engine(target, tokenizer, found, calibration, model_name=name)
