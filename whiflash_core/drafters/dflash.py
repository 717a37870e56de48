"""DFlash drafter (arXiv 2602.06036): a whole block drafted in one forward pass.

A small Qwen3-style stack with no embedding or LM head of its own (it borrows the target's).
Context: target hidden states of a few layers, fused by `fc` + `hidden_norm`, are projected by
every layer's own k/v projections into extra K/V ("KV injection"); those context K/V are the
drafter's only persistent cache, so catching up never needs queries, MLPs or logits (KV-only
by construction). The block is [pending token, MASK x (b-1)] at absolute positions, attention
inside it is bidirectional, and slot j predicts the token at its own position (same-position
prediction), so one pass yields b-1 draft tokens.

Layer ids follow z-lab: id i names the *output* of decoder layer i, i.e. Hugging Face
`hidden_states[i + 1]` (vLLM / speculators store i + 1 instead).

Extension (not in z-lab checkpoints): an optional reduced-vocabulary head (`lm_head.weight` of
shape [draft_vocab, H] plus `d2t`), which cuts the cost of the 49k-row LM head on CPU.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..layers import RMSNorm, Rotary, SwiGLU, apply_rope, attend, init_linear_
from ..target import KVCache, TargetModel
from .base import Context, Draft, Drafter, DrafterState, DraftSampling, pick_tokens_many, to_sharing
from .checkpoint import load_state_dict, save_state_dict


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)  # z-lab convention (layer outputs)
    num_target_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    draft_vocab_size: int | None = None  # extension: reduced head

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.target_layer_ids)


# SmolLM2's tokenizer has no mask token. DFlash needs one whose (frozen) embedding row marks
# "to be predicted" and which never occurs in chat text: `<empty_output>` (id 16) is a special
# token from SmolLM2's Jupyter pretraining data that chat prompts and answers never contain.
SMOLLM2_MASK_TOKEN_ID = 16


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """z-lab's rule: spread between the second layer and the third-to-last."""
    L, n = num_target_layers, num_features
    if n == 1:
        return [L // 2]
    return [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(h, nh * hd, bias=False)
        a.k_proj = nn.Linear(h, nkv * hd, bias=False)
        a.v_proj = nn.Linear(h, nkv * hd, bias=False)
        a.o_proj = nn.Linear(nh * hd, h, bias=False)
        a.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        a.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def kv(self, x, cos, sin):
        """K/V of rows x ([T, H]): k_norm then RoPE on keys; values as projected."""
        a, t = self.self_attn, x.shape[0]
        k = a.k_norm(a.k_proj(x).view(t, self.nkv, self.hd)).transpose(0, 1)
        v = a.v_proj(x).view(t, self.nkv, self.hd).transpose(0, 1)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask=None):
        """Block rows x attend to [context K/V ; block K/V], bidirectionally within the block."""
        a, t = self.self_attn, x.shape[0]
        h = self.input_layernorm(x)
        q = apply_rope(a.q_norm(a.q_proj(h).view(t, self.nh, self.hd)).transpose(0, 1), cos, sin)
        k, v = self.kv(h, cos, sin)
        k = torch.cat([ctx_k, k], dim=1)
        v = torch.cat([ctx_v, v], dim=1)
        x = x + a.o_proj(attend(q, k, v, mask))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_blocks(self, x, cos, sin, contexts: list[tuple[torch.Tensor, torch.Tensor]], sizes: list[int]):
        """Several requests' blocks, rows in request order (sizes[i] rows each), block i attending to
        [contexts[i] ; its own block] (no mask: bidirectional): the projections and the MLP run over
        all rows at once, attention per request."""
        a, t = self.self_attn, x.shape[0]
        h = self.input_layernorm(x)
        q = apply_rope(a.q_norm(a.q_proj(h).view(t, self.nh, self.hd)).transpose(0, 1), cos, sin)
        k, v = self.kv(h, cos, sin)                                                   # [nkv, t, hd]
        out, row = [], 0
        for (ctx_k, ctx_v), size in zip(contexts, sizes):
            rows = slice(row, row + size)
            out.append(attend(q[:, rows], torch.cat([ctx_k, k[:, rows]], dim=1), torch.cat([ctx_v, v[:, rows]], dim=1),
                              None))
            row += size
        x = x + a.o_proj(torch.cat(out))
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashState(DrafterState):
    def __init__(self, cache: KVCache):
        self.cache = cache  # context K/V only; block K/V are never stored
        self.n_seen = 0


class DFlashDrafter(Drafter, nn.Module):
    name = "dflash"
    # beside a q4_1 target: Q4_1 weights through the C matmul (quant.Q41Linear). PyTorch's int8
    # weight-only matmul took 3-4.5x longer for a block's 8 rows (gate 576 -> 1536: 259 vs 85 us,
    # 1 thread); Spec-Bench, 3 a category: draft 4.67 -> 2.12 ms a round, catch-up 0.80 -> 0.61,
    # acceptance 1.483 -> 1.479 (bench/results/dflash_weights_{int8,q4_1}_xeon.json)
    q4_1_weights = "q4_1"

    def __init__(self, cfg: DFlashConfig, embed_tokens: nn.Embedding, target_lm_head: nn.Linear):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.tap_layers = cfg.tap_layers
        self.max_draft_tokens = cfg.block_size - 1
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        # Shared with the target; kept out of this module's state_dict (see state_dict_for_save).
        self._shared = {"embed": embed_tokens, "head": target_lm_head}
        if cfg.draft_vocab_size:
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        else:
            self.lm_head = None
            self.d2t = None
        self.rotary = Rotary.default(cfg.head_dim, cfg.rope_theta, 4096)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._shared["embed"]

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self._shared["head"]
        return head(self.norm(h).to(head.weight.dtype))

    # -- context K/V (catch-up) -----------------------------------------------------------

    def context_kv(self, taps: torch.Tensor, start: int):
        """Per-layer (k, v) of fused context features at positions start.. (used by training too)."""
        t = taps.shape[0]
        ctx = self.hidden_norm(self.fc(taps.reshape(t, -1)))
        cos, sin = self.rotary.tables(slice(start, start + t), ctx.dtype, ctx.device)
        return [layer.kv(ctx, cos, sin) for layer in self.layers]

    @torch.inference_mode()
    def catch_up(self, state: DFlashState, ctx: Context) -> None:
        start, n = state.n_seen, ctx.n
        if start >= n:
            return
        cache = state.cache
        cache.ensure(n)
        for i, (k, v) in enumerate(self.context_kv(ctx.features(self.tap_layers, start, n), start)):
            cache.k[i][:, start:n] = k
            cache.v[i][:, start:n] = v
        cache.length = n
        state.n_seen = n

    @torch.inference_mode()
    def catch_up_many(self, states: list[DFlashState], ctxs: list[Context]) -> None:
        """`catch_up` for several requests: the unseen positions of all of them through `fc` and
        every layer's k/v projections at once, written to each cache."""
        spans = [(state, ctx, state.n_seen, ctx.n) for state, ctx in zip(states, ctxs) if state.n_seen < ctx.n]
        if len(spans) < 2:
            return super().catch_up_many(states, ctxs)
        taps = torch.cat([ctx.features(self.tap_layers, a, b) for _, ctx, a, b in spans])
        hidden = self.hidden_norm(self.fc(taps.reshape(taps.shape[0], -1)))
        cos, sin = self.rotary.tables(torch.cat([torch.arange(a, b) for _, _, a, b in spans]), hidden.dtype,
                                      hidden.device)
        kvs = [layer.kv(hidden, cos, sin) for layer in self.layers]   # per layer ([nkv, t, hd], [nkv, t, hd])
        row = 0
        for state, _, a, b in spans:
            state.cache.ensure(b)
            for i, (k, v) in enumerate(kvs):
                state.cache.k[i][:, a:b] = k[:, row:row + b - a]
                state.cache.v[i][:, a:b] = v[:, row:row + b - a]
            state.n_seen = state.cache.length = b
            row += b - a

    # -- block drafting ---------------------------------------------------------------------

    def block_hidden(self, block_ids: torch.Tensor, start: int, ctx_kv) -> torch.Tensor:
        """Hidden states of a block at positions start.. given per-layer context (k, v)."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos, sin = self.rotary.tables(slice(start, start + x.shape[0]), x.dtype, x.device)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, k, v)
        return x

    def draft_len(self, spec) -> int:
        """A block drafter drafts a whole block: block_size - 1 tokens after the anchor (the
        request's block_size may shrink the trained block, never grow it)."""
        block = spec.block_size or self.cfg.block_size
        return max(0, min(block, self.cfg.block_size) - 1)

    def new_state(self, capacity: int) -> DFlashState:
        c = self.cfg
        return DFlashState(KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.fc.weight.dtype,
                                   self.fc.weight.device))

    @torch.inference_mode()
    def propose(self, state: DFlashState, ctx: Context, num_tokens: int, sampling: DraftSampling) -> Draft:
        return self.propose_many([state], [ctx], [num_tokens], [sampling])[0]

    @torch.inference_mode()
    def propose_many(self, states: list[DFlashState], ctxs: list[Context], num_tokens: list[int],
                     samplings: list[DraftSampling]) -> list[Draft]:
        """Blocks of several requests in one pass: block i is [pending, MASK x (B - 1)] at positions
        n_i.., attending to its own context K/V; the projections and MLPs run over all blocks' rows
        at once (`DFlashLayer.forward_blocks`), the head over the first k_i drafted slots of each. A
        request's block is the one it drafts alone.

        A draft of k < B - 1 tokens is the first k slots of a whole block B (the trained size), not
        a block of k + 1: the block attends to itself both ways, so every slot's prediction depends
        on how many mask slots follow it, and a block shorter than the trained one is text the
        drafter never saw (Spec-Bench, 3 a category, k = 2: acceptance 1.23 from a block of 3, 1.43
        from the first two slots of the block of 8; bench/results/dflash_block3_{shipped,prefix}.json)."""
        for state, ctx in zip(states, ctxs):
            self.catch_up(state, ctx)
        counts = [min(k, self.max_draft_tokens) for k in num_tokens]
        sizes = [self.cfg.block_size if k > 0 else 1 for k in counts]
        device = ctxs[0].ids.device
        blocks, positions = [], []
        for ctx, size in zip(ctxs, sizes):
            block = torch.full((size,), self.cfg.mask_token_id, dtype=torch.long, device=device)
            block[0] = ctx.ids[ctx.n]
            blocks.append(block)
            positions.append(torch.arange(ctx.n, ctx.n + size))
        x = self.embed_tokens(torch.cat(blocks)).to(self.fc.weight.dtype)
        cos, sin = self.rotary.tables(torch.cat(positions), x.dtype, x.device)
        for i, layer in enumerate(self.layers):
            contexts = [(state.cache.k[i][:, :ctx.n], state.cache.v[i][:, :ctx.n]) for state, ctx in zip(states, ctxs)]
            x = layer.forward_blocks(x, cos, sin, contexts, sizes)
        # each block's slot j > 0 predicts the token at its own position: its draft token j
        starts = torch.tensor([0] + sizes[:-1]).cumsum(0).tolist()
        drafted = torch.cat([x[s + 1:s + 1 + k] for s, k in zip(starts, counts)])
        picked = pick_tokens_many(self.head_logits(drafted), counts, samplings, self.d2t, self.cfg.vocab_size)
        return [Draft(tokens, probs) for tokens, probs in picked]

    # -- construction, loading, saving ------------------------------------------------------

    @classmethod
    def random(cls, cfg: DFlashConfig, embed_tokens, target_lm_head, seed: int = 0,
               dtype=torch.float32, vocab_rows: torch.Tensor | None = None) -> "DFlashDrafter":
        torch.manual_seed(seed)
        model = cls(cfg, embed_tokens, target_lm_head)
        init_linear_(model)
        if cfg.draft_vocab_size:
            model.set_vocab(vocab_rows if vocab_rows is not None else torch.arange(cfg.draft_vocab_size),
                            target_lm_head.weight)
        return model.to(dtype).eval()

    def set_vocab(self, target_ids: torch.Tensor, target_head_weight: torch.Tensor) -> None:
        """Reduced head = the target LM head's rows for `target_ids` (sorted)."""
        ids = torch.sort(target_ids).values
        self.d2t.copy_(ids - torch.arange(len(ids)))
        with torch.no_grad():
            self.lm_head.weight.copy_(target_head_weight[ids].to(self.lm_head.weight.dtype))

    def save(self, path: str, dtype=torch.bfloat16, extra: dict | None = None) -> None:
        os.makedirs(path, exist_ok=True)
        c = self.cfg
        config = {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "block_size": c.block_size, "num_target_layers": c.num_target_layers,
            "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
            "num_hidden_layers": c.num_layers, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "attention_bias": False,
            "hidden_act": "silu", "tie_word_embeddings": False,
            "layer_types": ["full_attention"] * c.num_layers, "torch_dtype": str(dtype).replace("torch.", ""),
        }
        if c.draft_vocab_size:
            config["draft_vocab_size"] = c.draft_vocab_size
        if extra:
            config.update(extra)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_state_dict(dict(self.state_dict()), os.path.join(path, "model.safetensors"), dtype)

    @classmethod
    def load(cls, path: str, target: TargetModel, dtype: torch.dtype | None = None) -> "DFlashDrafter":
        """The z-lab checkpoint in `path` for `target`, whose embedding and (without a reduced
        head) LM head it shares; on the target's device, in its dtype unless `dtype` says otherwise."""
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        cfg = config_from_json(raw, target.cfg.num_layers)
        embed_tokens, target_lm_head, dtype = target.embed_tokens, target.lm_head, dtype or target.dtype
        sd = load_state_dict(path)
        sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}
        # Some uploads carry the target's embedding / full LM head: ignore them (they are shared).
        sd.pop("embed_tokens.weight", None)
        if not cfg.draft_vocab_size:
            sd.pop("lm_head.weight", None)
        model = cls(cfg, embed_tokens, target_lm_head)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise ValueError(f"DFlash checkpoint {path}: missing {missing}, unexpected {unexpected}")
        return to_sharing(model, (embed_tokens, target_lm_head), target.device, dtype).eval()


def _get(raw: dict, key: str, default=None):
    """Schema drift: keys live in `dflash_config` (newer) or at the top level (older heads)."""
    sub = raw.get("dflash_config") or {}
    if key in sub:
        return sub[key]
    return raw.get(key, default)


def config_from_json(raw: dict, num_target_layers: int) -> DFlashConfig:
    n_layers = raw["num_hidden_layers"]
    layer_ids = _get(raw, "target_layer_ids") or default_target_layer_ids(
        raw.get("num_target_layers", num_target_layers), n_layers)
    rope = raw.get("rope_parameters") or {}
    mask = _get(raw, "mask_token_id")
    if mask is None:
        raise ValueError("DFlash config has no mask_token_id (dflash_config.mask_token_id)")
    return DFlashConfig(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"], num_layers=n_layers,
        num_heads=raw["num_attention_heads"], num_kv_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        vocab_size=raw["vocab_size"], block_size=int(_get(raw, "block_size", 16)), mask_token_id=int(mask),
        target_layer_ids=list(layer_ids), num_target_layers=raw.get("num_target_layers", num_target_layers),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
        max_position_embeddings=raw.get("max_position_embeddings", 40960),
        draft_vocab_size=raw.get("draft_vocab_size"),
    )
