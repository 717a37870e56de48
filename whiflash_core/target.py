"""The target model: a plain Llama / Qwen3 decoder with a length-indexed KV cache.

One forward over k new tokens returns their logits and the hidden states of the layers the
drafters tap ("taps"), captured in that same forward. Tap index i means Hugging Face's
`hidden_states[i]`: the residual stream entering decoder layer i (0 = embeddings), and
i = num_layers the final-norm output.

Rolling the cache back to any accepted length is a single integer assignment: slots past
`length` are simply overwritten by the next forward.

This file is the model only; building it from Hugging Face / GGUF weights lives in loading.py,
the lighter int4 / int8 weight formats in quant.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import decode_ops
from .layer_stack import LayerStack
from .layers import RMSNorm, Rotary, apply_rope, attend, attention_mask

@dataclass
class TargetConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    qk_norm: bool = False          # Qwen3: per-head RMSNorm on q and k
    attention_bias: bool = False   # Qwen2-style q/k/v biases
    model_type: str = "llama"
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg) -> "TargetConfig":
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
        return cls(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size, num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rms_norm_eps=cfg.rms_norm_eps, rope_theta=float(theta),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qk_norm=cfg.model_type in ("qwen3",), attention_bias=bool(getattr(cfg, "attention_bias", False)),
            model_type=cfg.model_type, eos_token_ids=[e for e in eos if e is not None],
        )


Alloc = Callable[[tuple, torch.dtype, torch.device], torch.Tensor]   # (shape, dtype, device) -> tensor


def _zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    """Per-request cache: k, v of shape [layers, kv_heads, capacity, head_dim]; `length` is the valid prefix."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device="cpu", alloc: Alloc | None = None):
        # alloc: where the buffers come from (a BufferPool's `empty`: recycled and not zeroed;
        # positions past `length` are never read), default fresh zeros
        self.alloc = alloc or _zeros
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = self.alloc(shape, dtype, device)
        self.v = self.alloc(shape, dtype, device)
        self.length = 0
        # Whose bits its K/V are: its own (a new lineage) until it copies a prefix-cache entry's
        # positions 0..m-1, which makes them the entry's lineage up to m. Two caches of one lineage
        # hold the same K/V at positions below both lineage_lens (verified positions never change),
        # which lets requests read a shared prefix once (layer_stack.shared_prefixes).
        self.lineage: object = object()
        self.lineage_len: int = 1 << 62

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def reserve(self, n: int) -> None:
        """Make room for n tokens past `length`."""
        self.ensure(self.length + n)

    def ensure(self, end: int) -> None:
        """Capacity for positions < end (doubling, so growth is amortised; all slots are kept)."""
        if end <= self.capacity:
            return
        new_cap = max(end, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = self.alloc(old.shape[:2] + (new_cap,) + old.shape[3:], old.dtype, old.device)
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def rollback(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def load_prefix(self, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        """Positions 0..length-1 copied from another cache's k, v ([layers, kv_heads, >= length,
        head_dim]); the cache then holds exactly them. Its lineage is the caller's to set."""
        self.k[:, :, :length] = k[:, :, :length]
        self.v[:, :, :length] = v[:, :, :length]
        self.length = length


class Attention(nn.Module):
    native_ops = False   # decode_ops.use_for: few bf16 rows through kernels/decode_ops.c

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        # Hugging Face's q_proj, k_proj, v_proj stacked by rows: one matmul call per layer instead of
        # three (same results bit for bit; at one row the call overhead is most of the cost).
        self.sizes = (nh * hd, nkv * hd, nkv * hd)
        self.qkv_proj = nn.Linear(h, sum(self.sizes), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, k_cache, v_cache, start: int, mask):
        return self.o_proj(self.attend_rows(self.qkv_proj(x), cos, sin, k_cache, v_cache, start, mask))

    def forward_many(self, x, segments: list[Segment], layer: int):
        """Rows of several requests: one q/k/v and one output projection for all of them, attention
        per request over its own cache (`segments`, in row order)."""
        qkv = self.qkv_proj(x)
        out, row = [], 0
        for s in segments:
            out.append(self.attend_rows(qkv[row:row + s.rows], s.cos, s.sin, s.cache.k[layer], s.cache.v[layer],
                                        s.start, s.mask))
            row += s.rows
        return self.o_proj(torch.cat(out))

    def attend_rows(self, qkv, cos, sin, k_cache, v_cache, start: int, mask):
        """Attention of t rows (their stacked q/k/v projections [t, (nh + 2 nkv) hd]) at positions
        start..start+t-1: rotate, append k/v to the cache, attend over the cache: [t, nh hd]."""
        t, nh = qkv.shape[0], self.nh
        if (self.native_ops and self.q_norm is None and t <= decode_ops.MAX_ATTENTION_ROWS
                and decode_ops.applies(qkv, self.hd) and k_cache.is_contiguous() and v_cache.is_contiguous()):
            # the C path builds the causal mask itself: `mask` is always attention_mask(t, start),
            # the only mask target forwards use
            return decode_ops.attend_rows(qkv, cos, sin, k_cache, v_cache, start, nh, self.nkv)
        qkv = qkv.view(t, nh + 2 * self.nkv, self.hd)
        qk, v = qkv[:, :nh + self.nkv], qkv[:, nh + self.nkv:]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])], dim=1)
        qk = apply_rope(qk.transpose(0, 1), cos, sin)  # q and k heads rotated in one go
        q, k = qk[:nh], qk[nh:]
        k_cache[:, start:start + t] = k
        v_cache[:, start:start + t] = v.transpose(0, 1)
        end = start + t
        return attend(q, k_cache[:, :end], v_cache[:, :end], mask)


class GatedMLP(nn.Module):
    """SwiGLU with gate_proj and up_proj stacked by rows into one matmul (as `qkv_proj`)."""
    native_ops = False   # decode_ops.use_for: bf16 rows through kernels/decode_ops.c

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native_ops and decode_ops.applies(gate_up) and gate_up.dim() == 2:
            return self.down_proj(decode_ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# Our stacked linears and the Hugging Face / GGUF linears they are made of, in row order.
STACKED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_many(self, x, segments: list[Segment], layer: int):
        x = x + self.self_attn.forward_many(self.input_layernorm(x), segments, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class Segment:
    """One request's rows in a shared forward (TargetModel.forward_many)."""
    rows: int
    start: int                   # its cache length before the forward: the rows' first position
    cache: KVCache
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class TargetOutput:
    logits: torch.Tensor        # [rows, vocab] float32, rows = positions from `logits_from` on
    taps: torch.Tensor | None   # [T, n_taps, hidden] in model dtype
    last_hidden: torch.Tensor   # [T, hidden] final-norm output (what the LM head reads)


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig, rotary: Rotary | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = rotary or Rotary.default(cfg.head_dim, cfg.rope_theta, min(cfg.max_position_embeddings, 4096))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    # A long input (prefill) may run through a float32 twin of this model: where the CPU emulates
    # bf16, a float32 GEMM is several times faster than a bf16 one (bench/results/prefill_probe_avx2.json:
    # a 1,024-token prompt in 2.5 s against 13.9 s on an AVX2 EPYC), while the int4 kernels that
    # decode fastest take bf16 activations only at speed. See `whiflash_core.machine`.
    prefill_twin: "TargetModel | None" = None
    formats = None  # the `machine.Formats` it was loaded in, when --weights auto chose them
    prefill_from_rows: int = 10**9
    # decode_ops.use_for: decode and verify rows through all decoder layers in one C call
    layer_stack: LayerStack | None = None

    def set_prefill_twin(self, twin: "TargetModel", from_rows: int) -> None:
        """Run forwards of `from_rows` rows or more through `twin` (same weights, other dtype).
        The twin is kept out of this module's submodules, so `.to()`, state dicts and weight swaps
        of this model never touch it."""
        self.__dict__["prefill_twin"] = twin
        self.__dict__["prefill_from_rows"] = from_rows

    def new_cache(self, capacity: int, alloc: Alloc | None = None) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device, alloc)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, taps: tuple[int, ...] = (),
                logits_from: int = 0) -> TargetOutput:
        """Run `tokens` (1-D) at positions cache.length..; append their K/V; advance the cache."""
        t = tokens.shape[0]
        if t >= self.prefill_from_rows and self.prefill_twin is not None:
            return self._forward_in_twin(tokens, cache, taps, logits_from)
        if self._chunks_through_stack(t):
            return self._forward_in_chunks(tokens, cache, taps, logits_from)
        start = cache.length
        cache.reserve(t)
        cos, sin = self.rotary.tables(slice(start, start + t), self.dtype, tokens.device)
        x = self.embed_tokens(tokens)
        stack = self._stack(x, [t])
        if stack is not None:
            h, tap_tensor = self._run_stack(stack, x, cos, sin, [(t, start, cache)], taps)
        else:
            mask = attention_mask(t, start, self.cfg.num_heads, self.cfg.num_kv_heads, self.dtype, tokens.device)
            h, tap_tensor = self.run_layers(x, cos, sin, cache.k, cache.v, start, mask, taps)
        cache.length = start + t
        logits = (self.logits(h[logits_from:]) if logits_from < t   # a chunk before the logits wanted: none
                  else h.new_zeros(0, self.cfg.vocab_size, dtype=torch.float32))
        return TargetOutput(logits=logits, taps=tap_tensor, last_hidden=h)

    def _chunks_through_stack(self, t: int) -> bool:
        """Too many rows for the layer stack, but fewer than where the linears switch to their dense
        copies: the module forward would run the same Q4_1 kernels with Python and SDPA between them
        (a prefill of the few new tokens of an agent turn, a long prompt-lookup verify). Consecutive
        forwards of at most the stack's rows run those kernels from C instead: measured on an AMD EPYC
        (Zen 4, one thread, 700 cached positions) 17 rows 57.9 -> 42.3 ms, 31 rows 92.7 -> 66 ms."""
        stack = self.layer_stack
        return stack is not None and stack.current(self) and stack.takes_in_chunks(self.dtype, self.device, t)

    def _forward_in_chunks(self, tokens: torch.Tensor, cache: KVCache, taps: tuple[int, ...],
                           logits_from: int) -> TargetOutput:
        """forward() as consecutive forwards of the layer stack's most rows each: a chunk attends
        to the chunks before it through the cache, as the rows of one forward attend to the earlier
        ones, so the output is the same function of the tokens (up to bf16 rounding of the shapes)."""
        size, t, outs = self.layer_stack.max_rows, tokens.shape[0], []
        for a in range(0, t, size):
            b = min(a + size, t)
            outs.append(self.forward(tokens[a:b], cache, taps, logits_from=min(max(logits_from - a, 0), b - a)))
        return TargetOutput(logits=torch.cat([o.logits for o in outs]),
                            taps=torch.cat([o.taps for o in outs]) if taps else None,
                            last_hidden=torch.cat([o.last_hidden for o in outs]))

    @torch.inference_mode()
    def forward_many(self, tokens: list[torch.Tensor], caches: list[KVCache],
                     taps: tuple[int, ...] = (), logits_from: list[int] | None = None) -> list[TargetOutput]:
        """`forward` for several requests at once (their verify rows, or a prompt's last rows): the
        embedding, norms, MLPs, projections and LM head run over all rows together, attention per
        request over its own cache. Returns each request's output as `forward` would: logits for
        its rows from `logits_from[i]` on (default all of them)."""
        segments = []
        for t, cache in zip(tokens, caches):
            rows, start = t.shape[0], cache.length
            cache.reserve(rows)
            cos, sin = self.rotary.tables(slice(start, start + rows), self.dtype)
            segments.append(Segment(rows, start, cache, cos, sin, None))
        x = self.embed_tokens(torch.cat(tokens))
        stack = self._stack(x, [s.rows for s in segments])
        if stack is not None:   # builds its causal masks itself
            h, tap_tensor = self._run_stack(stack, x, torch.cat([s.cos for s in segments]),
                                            torch.cat([s.sin for s in segments]),
                                            [(s.rows, s.start, s.cache) for s in segments], taps)
        else:
            for s in segments:
                s.mask = attention_mask(s.rows, s.start, self.cfg.num_heads, self.cfg.num_kv_heads, self.dtype,
                                        x.device)
            captured = {}
            for i, layer in enumerate(self.layers):
                if i in taps:
                    captured[i] = x
                x = layer.forward_many(x, segments, i)
            h = self.norm(x)
            captured[self.cfg.num_layers] = h
            tap_tensor = torch.stack([captured[i] for i in taps], dim=1) if taps else None
        firsts = logits_from or [0] * len(segments)
        if any(firsts):   # the LM head only for the rows whose logits are asked for
            keep, row = [], 0
            for s, first in zip(segments, firsts):
                keep += range(row + first, row + s.rows)
                row += s.rows
            logits = self.logits(h[keep])
        else:
            logits = self.logits(h)
        outs, row, logit_row = [], 0, 0
        for s, first in zip(segments, firsts):
            s.cache.length = s.start + s.rows
            end, n_logits = row + s.rows, s.rows - first
            outs.append(TargetOutput(logits=logits[logit_row:logit_row + n_logits],
                                     taps=None if tap_tensor is None else tap_tensor[row:end], last_hidden=h[row:end]))
            row, logit_row = end, logit_row + n_logits
        return outs

    def _forward_in_twin(self, tokens, cache: KVCache, taps: tuple[int, ...], logits_from: int) -> TargetOutput:
        """The same forward computed by the prefill twin, layer by layer: each layer reads its cached
        prefix converted to the twin's dtype (one layer's worth of scratch at a time, not a copy of
        the whole cache), and its new K/V go back into `cache` in ours; taps and hidden states come
        back in ours, logits are float32."""
        twin, start, t = self.prefill_twin, cache.length, tokens.shape[0]
        cache.reserve(t)
        end = start + t
        cos, sin = twin.rotary.tables(slice(start, end), twin.dtype, tokens.device)
        mask = attention_mask(t, start, twin.cfg.num_heads, twin.cfg.num_kv_heads, twin.dtype, tokens.device)
        x, captured = twin.embed_tokens(tokens), {}
        for i, layer in enumerate(twin.layers):
            if i in taps:
                captured[i] = x
            k, v = cache.k[i, :, :end].to(twin.dtype), cache.v[i, :, :end].to(twin.dtype)   # [kv_heads, end, hd]
            x = layer(x, cos, sin, k, v, start, mask)   # writes this layer's new K/V at start..end-1
            cache.k[i, :, start:end] = k[:, start:]
            cache.v[i, :, start:end] = v[:, start:]
        h = twin.norm(x)
        captured[twin.cfg.num_layers] = h
        cache.length = end
        tap_tensor = torch.stack([captured[i] for i in taps], dim=1).to(self.dtype) if taps else None
        return TargetOutput(logits=twin.logits(h[logits_from:]), taps=tap_tensor, last_hidden=h.to(self.dtype))

    def _stack(self, x: torch.Tensor, rows: list[int]) -> LayerStack | None:
        """The layer stack, where it takes these rows (requests' row counts) of x."""
        stack = self.layer_stack
        return stack if stack is not None and stack.current(self) and stack.takes(x, rows) else None

    def _run_stack(self, stack: LayerStack, x, cos, sin, segments, taps: tuple[int, ...]):
        """`run_layers` by the layer stack: (h, taps) for segments (rows, start, KVCache)."""
        tap_tensor = stack.run(x, cos, sin, segments, taps)
        h = self.norm(x)
        if self.cfg.num_layers in taps:
            tap_tensor[:, taps.index(self.cfg.num_layers)] = h
        return h, tap_tensor

    def run_layers(self, x, cos, sin, k_cache, v_cache, start: int, mask, taps: tuple[int, ...]):
        """Decoder layers + final norm: (h [T, hidden], taps [T, n_taps, hidden] or None)."""
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in taps:
                captured[i] = x
            x = layer(x, cos, sin, k_cache[i], v_cache[i], start, mask)
        h = self.norm(x)
        captured[self.cfg.num_layers] = h
        return h, (torch.stack([captured[i] for i in taps], dim=1) if taps else None)

    # bf16 logits are coarse (spacing 0.125 for logits of 16-32): plain greedy decode hits exact
    # top-1/top-2 ties at a few % of steps, and which one wins then depends on rounding that differs
    # between a 1-token and a k-token forward. A float32 LM head would cost ~3x the bf16 one here,
    # so only the leading candidates are recomputed in float32 (a few hundred multiply-adds).
    refine_top: int = 8

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 logits of final-norm hidden states h."""
        logits = self.lm_head(h).float()
        exact_head = isinstance(self.lm_head, nn.Linear) and self.dtype in (torch.float32, torch.float64)
        if exact_head or self.refine_top <= 0:  # a light (int8) head needs the refinement in float32 too
            return logits
        if decode_ops.refine_top(logits, h, self.lm_head.weight, self.refine_top):   # the same, in one C call
            return logits
        top = decode_ops.topk_indices(logits, self.refine_top)       # [rows, k]
        if top is None:
            top = logits.topk(self.refine_top, dim=-1).indices
        w = self.lm_head.weight[top].float()                         # [rows, k, hidden]
        exact = torch.einsum("rkh,rh->rk", w, h.float())
        return logits.scatter(-1, top, exact)
