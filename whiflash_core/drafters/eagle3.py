"""EAGLE-3 drafter (arXiv 2503.01840): one decoder layer on fused low/mid/high target features.

Per position t the drafter sees the pair (g_t, token_{t+1}) at RoPE position t, where g_t is
`fc` over three tapped target hidden states. Its first layer takes [norm(embedding), norm(g)]
(2H wide) into q/k/v; its pre-norm output `a` gives draft logits through `norm` + a reduced-
vocabulary `lm_head` and is fed back (unfused) as the hidden input of the next chain step.

Checkpoints: SafeAILab (`midlayer.*`, flat Llama config) and vLLM `speculators`
(`layers.0.*`, nested `transformer_layer_config`, norm flags). Tap layers use the Hugging Face
hidden_states index ("hidden state entering layer i"), default {2, L//2, L-3}; explicit ids in a
config are read as vLLM reads them (as-is).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import decode_ops
from ..layers import RMSNorm, Rotary, SwiGLU, apply_rope, attend, causal_mask, init_linear_
from ..target import KVCache, TargetModel
from .base import Context, Draft, Drafter, DrafterState, DraftSampling, pick_tokens_many, to_sharing
from .checkpoint import load_state_dict, save_state_dict


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int                 # target vocabulary
    draft_vocab_size: int
    tap_layers: list[int] = field(default_factory=list)
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0     # EAGLE-3 drafters train with 1e4 whatever the target uses
    max_position_embeddings: int = 8192
    target_hidden_size: int | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    num_draft_tokens: int = 4       # default chain length

    @property
    def tap_width(self) -> int:
        return self.target_hidden_size or self.hidden_size


class DraftAttention(nn.Module):
    """Attention whose q/k/v read `in_dim` features (2H in EAGLE-3's first layer)."""
    native_ops = False   # decode_ops.use_for: chain steps with q/k/v in one matmul, attention in C

    def __init__(self, in_dim: int, hidden: int, nh: int, nkv: int, hd: int):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(in_dim, nh * hd, bias=False)
        self.k_proj = nn.Linear(in_dim, nkv * hd, bias=False)
        self.v_proj = nn.Linear(in_dim, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, hidden, bias=False)

    def qkv(self) -> nn.Module:
        """q_proj, k_proj and v_proj stacked by rows (quant.stack_linears), built at first use for
        the native chain step (an inference copy: the weights are not trained after use_for)."""
        stacked = self.__dict__.get("_qkv")
        if stacked is None:
            from ..quant import stack_linears
            stacked = self.__dict__["_qkv"] = stack_linears([self.q_proj, self.k_proj, self.v_proj])
        return stacked

    def rows_natively(self, x, cos, sin, caches: list[tuple[torch.Tensor, torch.Tensor]], positions: list[int]):
        """`Eagle3Layer.forward_rows`' attention through decode_ops.attend_rows (rotary, the cache
        write and the attention of one row in one C call), or None where that does not apply."""
        if not (self.native_ops and decode_ops.applies(x, self.hd)
                and all(k.is_contiguous() and v.is_contiguous() for k, v in caches)):
            return None
        qkv = self.qkv()(x)
        out = [decode_ops.attend_rows(qkv[i:i + 1], cos[i:i + 1], sin[i:i + 1], k_cache, v_cache, p, self.nh, self.nkv)
               for i, ((k_cache, v_cache), p) in enumerate(zip(caches, positions))]
        return self.o_proj(out[0] if len(out) == 1 else torch.cat(out))

    def write_kv(self, x, cos, sin, k_cache, v_cache, start):
        t = x.shape[0]
        k = self.k_proj(x).view(t, self.nkv, self.hd).transpose(0, 1)
        k_cache[:, start:start + t] = apply_rope(k, cos, sin)
        v_cache[:, start:start + t] = self.v_proj(x).view(t, self.nkv, self.hd).transpose(0, 1)

    def query(self, x, cos, sin, k_cache, v_cache, q_start, end):
        """Attend rows x (at positions q_start..) causally over cached keys 0..end-1."""
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.nh, self.hd).transpose(0, 1), cos, sin)
        mask = causal_mask(t, q_start, x.device)
        if mask is not None:
            mask = mask[:, :end]
        return self.o_proj(attend(q, k_cache[:, :end], v_cache[:, :end], mask))


class Eagle3Layer(nn.Module):
    """Decoder layer; the first one reads [norm(embedding), norm(hidden)] (2H)."""

    def __init__(self, cfg: Eagle3Config, first: bool):
        super().__init__()
        h = cfg.hidden_size
        self.first = first
        self.self_attn = DraftAttention(2 * h if first else h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.mlp = SwiGLU(h, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps) if first else None
        self.norm_before_residual = cfg.norm_before_residual

    def inputs(self, emb, hidden):
        """(attention input, residual) for this layer."""
        if not self.first:
            return self.input_layernorm(hidden), hidden
        h_normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(emb), h_normed], dim=-1)  # order: [embedding, hidden]
        return x, (h_normed if self.norm_before_residual else hidden)

    def forward(self, emb, hidden, cos, sin, k_cache, v_cache, start, full_from: int = 0):
        """Write K/V for all rows; run attention + MLP only for rows >= full_from (KV-only prefill)."""
        x, residual = self.inputs(emb, hidden)
        t = x.shape[0]
        self.self_attn.write_kv(x, cos, sin, k_cache, v_cache, start)
        if full_from >= t:
            return residual[:0]
        q_rows = slice(full_from, t)
        h = residual[q_rows] + self.self_attn.query(x[q_rows], cos[q_rows], sin[q_rows], k_cache, v_cache,
                                                    start + full_from, start + t)
        return h + self.mlp(self.post_attention_layernorm(h))

    def native_layer(self, index: int):
        """This layer in C (layer_stack.DraftLayer: Q4_1 weights, bf16, decode_ops on), built at
        first use, or None where that does not apply."""
        if not self.self_attn.native_ops:
            return None
        if "_native" not in self.__dict__:
            from ..layer_stack import DraftLayer
            self.__dict__["_native"] = DraftLayer.build(self, index)
        return self.__dict__["_native"]

    def forward_rows(self, emb, hidden, cos, sin, caches: list[tuple[torch.Tensor, torch.Tensor]],
                     positions: list[int]):
        """One row per request, row i at positions[i] over its own cache caches[i] = (k, v) of this
        layer: the projections and the MLP run over all rows at once, attention per request."""
        x, residual = self.inputs(emb, hidden)
        a, t = self.self_attn, x.shape[0]
        native = a.rows_natively(x, cos, sin, caches, positions)
        if native is not None:
            h = residual + native
            return h + self.mlp(self.post_attention_layernorm(h))
        q = apply_rope(a.q_proj(x).view(t, a.nh, a.hd).transpose(0, 1), cos, sin)     # [nh, R, hd]
        k = apply_rope(a.k_proj(x).view(t, a.nkv, a.hd).transpose(0, 1), cos, sin)    # [nkv, R, hd]
        v = a.v_proj(x).view(t, a.nkv, a.hd).transpose(0, 1)
        out = []
        for i, ((k_cache, v_cache), p) in enumerate(zip(caches, positions)):
            k_cache[:, p] = k[:, i]
            v_cache[:, p] = v[:, i]
            out.append(attend(q[:, i:i + 1], k_cache[:, :p + 1], v_cache[:, :p + 1], None))
        h = residual + a.o_proj(torch.cat(out))
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3State(DrafterState):
    def __init__(self, cache: KVCache):
        self.cache = cache
        self.n_seen = 0


class Eagle3Drafter(Drafter, nn.Module):
    name = "eagle3"
    cache_lookahead = 1   # position t's K/V reads the pair (g_t, token t+1)
    # beside a q4_1 target: Q4_1 weights, chain steps in C (Spec-Bench, 13 prompts: the same
    # 838 rounds for 1,476 tokens as int8 weights, in 11.0 s instead of 12.3)
    q4_1_weights = "q4_1"

    def __init__(self, cfg: Eagle3Config, embed_tokens: nn.Embedding | None = None):
        nn.Module.__init__(self)
        self.cfg = cfg
        n_taps, tw = len(cfg.tap_layers), cfg.tap_width
        self.tap_layers = tuple(cfg.tap_layers)
        self.max_draft_tokens = 64
        self.fc = nn.Linear(n_taps * tw, cfg.hidden_size, bias=False)
        self.input_norm = RMSNorm(n_taps * tw, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(tw, cfg.rms_norm_eps) for _ in range(n_taps)) if cfg.fc_norm else None
        self.layers = nn.ModuleList(Eagle3Layer(cfg, first=i == 0) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # The embedding is the target's (frozen, not saved) unless a checkpoint ships its own.
        self.own_embedding = embed_tokens is None
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary.default(cfg.head_dim, cfg.rope_theta, 4096)

    # -- model pieces -------------------------------------------------------------------------

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """[T, n_taps, Ht] target taps -> [T, H] fused feature g."""
        if self.fc_norm is not None:
            taps = torch.stack([norm(taps[:, i]) for i, norm in enumerate(self.fc_norm)], dim=1)
        flat = taps.reshape(taps.shape[0], -1)
        if self.input_norm is not None:
            flat = self.input_norm(flat)
        return self.fc(flat)

    def run(self, cache: KVCache, emb, hidden, start: int, full_from: int = 0) -> torch.Tensor:
        """Layers over rows at positions start..; returns pre-norm outputs of rows >= full_from."""
        t = emb.shape[0]
        cache.ensure(start + t)
        cos, sin = self.rotary.tables(slice(start, start + t), emb.dtype, emb.device)
        if len(self.layers) > 1:
            full_from = 0  # later layers need every row of the first layer's output
        h = hidden
        for i, layer in enumerate(self.layers):
            h = layer(emb, h, cos, sin, cache.k[i], cache.v[i], start, full_from if i == 0 else 0)
        cache.length = max(cache.length, start + t)
        return h

    def run_rows(self, caches: list[KVCache], emb, hidden, positions: list[int]) -> torch.Tensor:
        """`run` for one row per request, each at its own position over its own cache: [R, H]."""
        for cache, p in zip(caches, positions):
            cache.ensure(p + 1)
        cos, sin = self.rotary.tables(torch.tensor(positions), emb.dtype, emb.device)
        h = hidden
        for i, layer in enumerate(self.layers):
            native = layer.native_layer(i)
            if native is not None and emb.dtype == torch.bfloat16:
                x, residual = layer.inputs(emb, h)
                h = native.run(x, residual, cos, sin, [(1, p, c) for c, p in zip(caches, positions)])
            else:
                h = layer.forward_rows(emb, h, cos, sin, [(c.k[i], c.v[i]) for c in caches], positions)
        for cache, p in zip(caches, positions):
            cache.length = max(cache.length, p + 1)
        return h

    def logits(self, a: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(a))

    # -- Drafter interface -----------------------------------------------------------------

    @property
    def default_draft_len(self) -> int:
        return self.cfg.num_draft_tokens

    def new_state(self, capacity: int) -> Eagle3State:
        c = self.cfg
        return Eagle3State(KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.fc.weight.dtype,
                                   self.fc.weight.device))

    @torch.inference_mode()
    def catch_up(self, state: Eagle3State, ctx: Context) -> None:
        """KV-only prefill of verified pairs the drafter has not seen, except the newest one.

        Their keys/values are all a one-layer drafter needs from them; the newest pair runs the
        full layer in `propose`, because its output seeds the draft chain.
        """
        start, end = state.n_seen, ctx.n - 1
        if start >= end:
            return
        chain = self._chain(ctx)
        if chain is not None and end - start < chain.catch_up_rows:   # the same rows in one C call
            state.cache.ensure(end)
            cos, sin = self.rotary.tables(slice(start, end), torch.bfloat16)
            chain.catch_up(ctx.features(self.tap_layers, start, end), ctx.ids[start + 1:end + 1], cos, sin, start,
                           state.cache)
            state.n_seen = state.cache.length = end
            return
        g = self.fuse(ctx.features(self.tap_layers, start, end))
        self.run(state.cache, self.embed_tokens(ctx.ids[start + 1:end + 1]), g, start, full_from=end - start)
        state.n_seen = state.cache.length = end

    @torch.inference_mode()
    def catch_up_many(self, states: list[Eagle3State], ctxs: list[Context]) -> None:
        """`catch_up` for several requests: the unseen pairs of all of them through `fc` and the
        k/v projections at once (all a one-layer drafter needs from them), written to each cache."""
        spans = [(state, ctx, state.n_seen, ctx.n - 1) for state, ctx in zip(states, ctxs) if state.n_seen < ctx.n - 1]
        if len(self.layers) > 1 or len(spans) < 2:   # deeper drafters run full layers on caught-up rows
            return super().catch_up_many(states, ctxs)
        g = self.fuse(torch.cat([ctx.features(self.tap_layers, a, b) for _, ctx, a, b in spans]))
        emb = self.embed_tokens(torch.cat([ctx.ids[a + 1:b + 1] for _, ctx, a, b in spans]))
        cos, sin = self.rotary.tables(torch.cat([torch.arange(a, b) for _, _, a, b in spans]), emb.dtype, emb.device)
        layer = self.layers[0]
        attn, t = layer.self_attn, emb.shape[0]
        x, _ = layer.inputs(emb, g)
        k = apply_rope(attn.k_proj(x).view(t, attn.nkv, attn.hd).transpose(0, 1), cos, sin)   # [nkv, t, hd]
        v = attn.v_proj(x).view(t, attn.nkv, attn.hd).transpose(0, 1)
        row = 0
        for state, _, a, b in spans:
            state.cache.ensure(b)
            state.cache.k[0][:, a:b] = k[:, row:row + b - a]
            state.cache.v[0][:, a:b] = v[:, row:row + b - a]
            state.n_seen = state.cache.length = b
            row += b - a

    @torch.inference_mode()
    def propose(self, state: Eagle3State, ctx: Context, num_tokens: int, sampling: DraftSampling) -> Draft:
        chain = self._chain(ctx) if sampling.greedy and num_tokens > 0 else None
        if chain is None:
            return self.propose_many([state], [ctx], [num_tokens], [sampling])[0]
        # propose_many's greedy chain for this one request, all of it in one C call (same bits)
        self.catch_up(state, ctx)
        n = ctx.n
        state.cache.ensure(n - 1 + num_tokens)   # positions n-1 (the newest pair) .. n+k-2
        cos, sin = self.rotary.tables(slice(n - 1, n - 1 + num_tokens), torch.bfloat16)
        tokens = chain.run(ctx.features(self.tap_layers, n - 1, n)[0], int(ctx.ids[n]), cos, sin, n - 1,
                           state.cache, num_tokens)
        state.n_seen = state.cache.length = n
        return Draft(tokens)   # the chain runs on the CPU only (bf16 C kernels)

    def _chain(self, ctx: Context | None = None):
        """The greedy chain in C (layer_stack.EagleChain) where it applies with the native ops on
        (and to ctx's taps: bf16), built at first use; else None."""
        if not (self.norm.native_ops and self.layers[0].self_attn.native_ops) or (
                ctx is not None and ctx.taps.dtype != torch.bfloat16):
            return None
        if "_chain_c" not in self.__dict__:
            from ..layer_stack import EagleChain
            self.__dict__["_chain_c"] = EagleChain.build(self)
        return self.__dict__["_chain_c"]

    @torch.inference_mode()
    def propose_many(self, states: list[Eagle3State], ctxs: list[Context], num_tokens: list[int],
                     samplings: list[DraftSampling]) -> list[Draft]:
        """Chains of several requests, one drafter pass per chain step for all of them: each step's
        projections, MLP and head run over one row per request, attention per request over its own
        cache (`run_rows`). A request's chain is the one it drafts alone."""
        for state, ctx in zip(states, ctxs):
            self.catch_up(state, ctx)   # now n_seen = n - 1: the newest pair is left for the first step
        ns = [ctx.n for ctx in ctxs]
        caches = [state.cache for state in states]
        # first step: the newest verified pair (g_{n-1}, pending token) at position n-1 runs the full
        # layer; its output seeds the chain
        g = self.fuse(torch.cat([ctx.features(self.tap_layers, n - 1, n) for ctx, n in zip(ctxs, ns)]))
        emb = self.embed_tokens(torch.stack([ctx.ids[n] for ctx, n in zip(ctxs, ns)]))
        a = self.run_rows(caches, emb, g, [n - 1 for n in ns])
        for state, n in zip(states, ns):
            state.n_seen = state.cache.length = n
        tokens: list[list[torch.Tensor]] = [[] for _ in ns]
        probs: list[list[torch.Tensor | None]] = [[] for _ in ns]
        live = [i for i, k in enumerate(num_tokens) if k > 0]   # requests whose chains go on; a's rows
        for j in range(max(num_tokens, default=0)):
            picked = pick_tokens_many(self.logits(a), [1] * len(live), [samplings[i] for i in live], self.d2t,
                                      self.cfg.vocab_size)
            for i, (tok, p) in zip(live, picked):
                tokens[i].append(tok)
                probs[i].append(p)
            rows = [r for r, i in enumerate(live) if j + 1 < num_tokens[i]]
            if not rows:
                break
            live = [live[r] for r in rows]
            hidden = (self.norm(a) if self.cfg.norm_output else a)[rows]
            # chain step: (a, draft token) at position n+j; its K/V sit past n_seen and are
            # overwritten by the next catch-up, so drafts never pollute the verified cache.
            a = self.run_rows([caches[i] for i in live], self.embed_tokens(torch.cat([tokens[i][j] for i in live])),
                              hidden, [ns[i] + j for i in live])
        drafts = []
        for state, ctx, toks, ps in zip(states, ctxs, tokens, probs):
            state.cache.length = ctx.n
            drafts.append(Draft(torch.cat(toks), None if ps[0] is None else torch.cat(ps)) if toks
                          else Draft(ctx.ids[:0]))
        return drafts

    # -- construction, loading, saving ------------------------------------------------------

    @classmethod
    def random(cls, cfg: Eagle3Config, embed_tokens: nn.Embedding, seed: int = 0,
               dtype=torch.float32, vocab_rows: torch.Tensor | None = None) -> "Eagle3Drafter":
        """Randomly initialised drafter; draft vocabulary = `vocab_rows` (target ids) or the first ids."""
        torch.manual_seed(seed)
        model = cls(cfg, embed_tokens)
        init_linear_(model)
        rows = vocab_rows if vocab_rows is not None else torch.arange(cfg.draft_vocab_size)
        model.set_vocab(rows)
        return model.to(dtype).eval()

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        ids = torch.sort(target_ids).values
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def state_dict_for_save(self, layout: str = "speculators") -> dict[str, torch.Tensor]:
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.") or self.own_embedding}
        if layout == "safeailab":
            sd = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v for k, v in sd.items()}
        return sd

    def save(self, path: str, layout: str = "speculators", dtype=torch.bfloat16, extra: dict | None = None) -> None:
        os.makedirs(path, exist_ok=True)
        c = self.cfg
        if layout == "speculators":
            config = {
                "speculators_model_type": "eagle3",
                "architectures": ["Eagle3Speculator"],
                "transformer_layer_config": {
                    "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                    "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
                    "head_dim": c.head_dim, "num_hidden_layers": c.num_layers, "rms_norm_eps": c.rms_norm_eps,
                    "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
                    "attention_bias": False, "mlp_bias": False, "vocab_size": c.vocab_size,
                },
                "draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
                "eagle_aux_hidden_state_layer_ids": list(c.tap_layers),
                "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc,
                "fc_norm": c.fc_norm, "norm_output": c.norm_output,
                "speculators_config": {
                    "algorithm": "eagle3",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.num_draft_tokens,
                                          "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                    "default_proposal_method": "greedy",
                },
            }
        elif layout == "safeailab":
            if c.norm_before_residual or c.norm_before_fc or c.fc_norm or c.norm_output or c.num_layers != 1:
                raise ValueError("the SafeAILab layout has no norm flags and exactly one layer")
            config = {
                "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
                "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
                "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
                "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
                "draft_vocab_size": c.draft_vocab_size, "tie_word_embeddings": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.tap_layers), "use_aux_hidden_state": True},
            }
            if c.target_hidden_size:
                config["target_hidden_size"] = c.target_hidden_size
        else:
            raise ValueError(f"unknown layout {layout!r}")
        config["torch_dtype"] = str(dtype).replace("torch.", "")
        if extra:
            config.update(extra)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_state_dict(self.state_dict_for_save(layout), os.path.join(path, "model.safetensors"), dtype)

    @classmethod
    def load(cls, path: str, target: TargetModel, dtype: torch.dtype | None = None) -> "Eagle3Drafter":
        """The checkpoint in `path` (SafeAILab or speculators layout) for `target`, whose embedding
        it shares unless it ships its own; on the target's device, in its dtype unless `dtype` says
        otherwise."""
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        cfg = config_from_json(raw, target.cfg.num_layers)
        target_embed, dtype = target.embed_tokens, dtype or target.dtype
        sd = load_state_dict(path)
        sd = {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v for k, v in sd.items()}
        sd = {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}
        if "draft_id_to_target_id" in sd:
            sd["d2t"] = sd.pop("draft_id_to_target_id")
        own_embed = "embed_tokens.weight" in sd
        model = cls(cfg, None if own_embed else target_embed)
        if "d2t" not in sd:  # draft vocab == target vocab: identity mapping
            sd["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        if "t2d" not in sd:
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[torch.arange(cfg.draft_vocab_size) + sd["d2t"].long()] = True
            sd["t2d"] = t2d
        sd["d2t"] = sd["d2t"].long()
        sd["t2d"] = sd["t2d"].bool()
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.startswith("embed_tokens.")]
        if missing or unexpected:
            raise ValueError(f"EAGLE-3 checkpoint {path}: missing {missing}, unexpected {unexpected}")
        return to_sharing(model, (None if own_embed else target_embed,), target.device, dtype).eval()


def config_from_json(raw: dict, num_target_layers: int) -> Eagle3Config:
    """Read either published config layout into an Eagle3Config."""
    L = num_target_layers
    default_taps = [2, L // 2, L - 3]
    if raw.get("speculators_model_type") == "eagle3" or "transformer_layer_config" in raw:
        t = raw["transformer_layer_config"]
        rope = t.get("rope_parameters") or {}
        proposals = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
        return Eagle3Config(
            hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
            num_heads=t["num_attention_heads"], num_kv_heads=t.get("num_key_value_heads", t["num_attention_heads"]),
            head_dim=t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
            vocab_size=t["vocab_size"], draft_vocab_size=raw.get("draft_vocab_size", 32000),
            tap_layers=list(raw.get("eagle_aux_hidden_state_layer_ids") or default_taps),
            num_layers=t.get("num_hidden_layers", 1), rms_norm_eps=t.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
            max_position_embeddings=t.get("max_position_embeddings", 8192),
            target_hidden_size=raw.get("target_hidden_size"),
            # vLLM's default when the field is missing is True; converted SafeAILab heads carry False.
            norm_before_residual=bool(raw.get("norm_before_residual", True)),
            norm_before_fc=bool(raw.get("norm_before_fc", False)), fc_norm=bool(raw.get("fc_norm", False)),
            norm_output=bool(raw.get("norm_output", False)),
            num_draft_tokens=int(proposals[0].get("speculative_tokens", 4)),
        )
    eagle = raw.get("eagle_config") or {}
    rope = raw.get("rope_parameters") or {}
    return Eagle3Config(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_heads=raw["num_attention_heads"], num_kv_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        vocab_size=raw["vocab_size"], draft_vocab_size=raw.get("draft_vocab_size", raw["vocab_size"]),
        tap_layers=list(eagle.get("eagle_aux_hidden_state_layer_ids") or default_taps),
        num_layers=1, rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        # the rope-theta trap: SafeAILab configs carry no rope_theta and were trained at 1e4
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        target_hidden_size=raw.get("target_hidden_size"),
        norm_before_fc=bool(raw.get("norm_before_fc", False)),
    )

