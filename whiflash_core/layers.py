"""Building blocks shared by the target and the drafters: RMSNorm, RoPE, SwiGLU, attention.

Plain PyTorch, batch 1, sequences laid out as [T, H]. Attention tensors are [heads, T, head_dim].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import decode_ops


class RMSNorm(nn.Module):
    native_ops = False   # decode_ops.use_for: bf16 rows through kernels/decode_ops.c

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_ops and decode_ops.applies(x) and self.weight.dtype == torch.bfloat16:
            return decode_ops.rms_norm(x, self.weight, self.eps)
        # Normalised in float32 as Hugging Face Llama/Qwen3 do, cast back, then scaled (same bits
        # as their x * rsqrt(mean(x^2) + eps) in float64/32/bf16, in fewer kernel calls).
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class SwiGLU(nn.Module):
    native_ops = False   # decode_ops.use_for: gate and up in one matmul, silu * up in C (bf16 rows)

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_ops and x.dim() == 2 and decode_ops.applies(x) and getattr(self.gate_proj, "bias", None) is None:
            return self.down_proj(decode_ops.silu_mul(self.gate_up()(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def gate_up(self) -> nn.Module:
        """gate_proj and up_proj stacked by rows (quant.stack_linears), built at first use: an
        inference copy for the native path (the weights are not trained after use_for)."""
        stacked = self.__dict__.get("_gate_up")
        if stacked is None:
            from .quant import stack_linears
            stacked = self.__dict__["_gate_up"] = stack_linears([self.gate_proj, self.up_proj])
        return stacked


class Rotary:
    """Precomputed cos/sin tables. `inv_freq` may come from transformers (any rope type)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0):
        # built on the CPU even under a `torch.device(...)` context: every device gets copies of
        # the same tables (see `tables`)
        self.inv_freq = inv_freq.float().cpu()
        self.scaling = scaling
        self._build(max_positions)

    @classmethod
    def default(cls, head_dim: int, theta: float, max_positions: int) -> "Rotary":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
        return cls(inv_freq.float(), max_positions)

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos() * self.scaling
        # sin with the first half negated: rotate_half(x) * sin == x.roll(half) * signed sin, exactly
        half = emb.shape[-1] // 2
        self.sin = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1) * self.scaling
        self._cast: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, positions: slice | torch.Tensor, dtype: torch.dtype,
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed sin rows for `positions`, in `dtype` on `device` (None: the CPU). The
        tables are computed once on the CPU and copied per (dtype, device), so every device reads
        the same values."""
        stop = positions.stop if isinstance(positions, slice) else int(positions.max()) + 1
        if stop > self.cos.shape[0]:
            self._build(max(stop, 2 * self.cos.shape[0]))
        key = (dtype, self.cos.device if device is None else torch.device(device))
        if key not in self._cast:
            self._cast[key] = (self.cos.to(key[1], dtype), self.sin.to(key[1], dtype))
        cos, sin = self._cast[key]
        return cos[positions], sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, T, head_dim]; cos / signed sin from `Rotary.tables`: [T, head_dim].

    Hugging Face's x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]: here the sign
    lives in the table, so the rotation is one roll (4 kernels instead of 6, same bits).
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q: [nh, Tq, hd]; k, v: [nkv, Tk, hd]; mask: [Tq, Tk] from `causal_mask` (or already repeated
    per query group, see `group_rows`), None = attend to all keys.

    Returns [Tq, nh*hd]. Grouped-query attention is expanded by the kernel (enable_gqa), except
    in the `group_rows` case.
    """
    nh, tq, hd = q.shape
    nkv = k.shape[0]
    if group_rows(tq, nh, nkv, q.dtype):
        group = nh // nkv
        if mask is not None and mask.shape[0] == tq:
            mask = mask.repeat(group, 1)
        out = F.scaled_dot_product_attention(q.reshape(nkv, group * tq, hd).unsqueeze(0), k.unsqueeze(0),
                                             v.unsqueeze(0), attn_mask=mask)
        return out[0].view(nh, tq, hd).transpose(0, 1).reshape(tq, -1)
    out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                         attn_mask=mask, enable_gqa=nh != nkv)
    return out[0].transpose(0, 1).reshape(tq, -1)


def group_rows(n_rows: int, n_heads: int, n_kv_heads: int, dtype: torch.dtype) -> bool:
    """Lay each kv head's query group out as extra query rows ([nkv, group*Tq, hd]) instead of GQA?

    For a few bf16/fp16 rows that gives bit-identical results and is 4.5x faster for one row
    (27 vs 127 us per layer at 300 keys: the CPU flash kernel's GQA path is slow for one row);
    measured faster up to 4 rows, even at 8, slower at 32. float32/64 keep the GQA path, whose
    rounding the float32 identity tests pin (it differs in the last bit at one row).
    """
    return n_heads != n_kv_heads and n_rows < 8 and dtype in (torch.bfloat16, torch.float16)


def causal_mask(n_new: int, n_past: int, device=None, dtype: torch.dtype = torch.bool) -> torch.Tensor | None:
    """Row i (absolute position n_past+i) may see keys 0..n_past+i. None when nothing is masked.

    bool: True = may attend. A float dtype gives the additive form (0 / -inf) that SDPA would
    otherwise build from the bool mask in every layer (same results).
    """
    if n_new == 1:
        return None
    cols = torch.arange(n_past + n_new, device=device)
    rows = torch.arange(n_new, device=device) + n_past
    allowed = cols.unsqueeze(0) <= rows.unsqueeze(1)
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def attention_mask(n_new: int, n_past: int, n_heads: int, n_kv_heads: int, dtype: torch.dtype,
                   device=None) -> torch.Tensor | None:
    """`causal_mask` in the exact form `attend` uses for these shapes (additive in `dtype`, rows
    repeated per query group when `group_rows`), built once per forward instead of in every layer."""
    mask = causal_mask(n_new, n_past, device, dtype)
    if mask is not None and group_rows(n_new, n_heads, n_kv_heads, dtype):
        mask = mask.repeat(n_heads // n_kv_heads, 1)
    return mask


def init_linear_(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def entropy_from_logits(logits: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-(logp.exp() * logp).sum())


__all__ = ["RMSNorm", "SwiGLU", "Rotary", "apply_rope", "attend", "group_rows", "causal_mask", "attention_mask",
           "init_linear_", "entropy_from_logits", "math"]
