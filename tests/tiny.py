"""A tiny random Llama target and small random drafters, for exact (float64) tests."""
from __future__ import annotations

import torch

from whiflash_core.drafters.dflash import DFlashConfig, DFlashDrafter
from whiflash_core.drafters.eagle3 import Eagle3Config, Eagle3Drafter
from whiflash_core.engine import Engine
from whiflash_core.layers import init_linear_
from whiflash_core.target import TargetConfig, TargetModel

VOCAB = 64


def tiny_target(dtype=torch.float64, seed: int = 0, vocab: int = VOCAB, layers: int = 6) -> TargetModel:
    torch.manual_seed(seed)
    cfg = TargetConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=layers,
                       num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
                       max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=[])
    model = TargetModel(cfg)
    init_linear_(model, std=0.2)
    torch.nn.init.normal_(model.embed_tokens.weight, std=1.0)
    return model.to(dtype).eval()


def tiny_eagle(target: TargetModel, seed: int = 1, draft_vocab: int | None = None, **flags) -> Eagle3Drafter:
    c = target.cfg
    cfg = Eagle3Config(hidden_size=c.hidden_size, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8,
                       vocab_size=c.vocab_size, draft_vocab_size=draft_vocab or c.vocab_size,
                       tap_layers=[2, c.num_layers // 2, c.num_layers - 3], num_draft_tokens=4, **flags)
    rows = torch.randperm(c.vocab_size, generator=torch.Generator().manual_seed(seed))[: cfg.draft_vocab_size]
    return Eagle3Drafter.random(cfg, target.embed_tokens, seed=seed, dtype=target.dtype, vocab_rows=rows)


def tiny_dflash(target: TargetModel, seed: int = 2, block: int = 5, draft_vocab: int | None = None) -> DFlashDrafter:
    c = target.cfg
    cfg = DFlashConfig(hidden_size=c.hidden_size, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=8, vocab_size=c.vocab_size, block_size=block, mask_token_id=c.vocab_size - 1,
                       target_layer_ids=[0, 2, c.num_layers - 3], num_target_layers=c.num_layers,
                       draft_vocab_size=draft_vocab)
    return DFlashDrafter.random(cfg, target.embed_tokens, target.lm_head, seed=seed, dtype=target.dtype)


def tiny_engine(dtype=torch.float64, seed: int = 0, **kw) -> Engine:
    target = tiny_target(dtype, seed)
    drafters = {"eagle3": tiny_eagle(target, **kw), "dflash": tiny_dflash(target)}
    return Engine(target, None, drafters)
