"""Building blocks shared by the target and the drafters: RMSNorm, RoPE, SwiGLU, attention.

Plain PyTorch, batch 1, sequences laid out as [T, H]. Attention tensors are [heads, T, head_dim].
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 as Hugging Face Llama/Qwen3 do, then cast back.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary:
    """Precomputed cos/sin tables. `inv_freq` may come from transformers (any rope type)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0):
        self.inv_freq = inv_freq.float()
        self.scaling = scaling
        self._build(max_positions)

    @classmethod
    def default(cls, head_dim: int, theta: float, max_positions: int) -> "Rotary":
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        return cls(inv_freq.float(), max_positions)

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos() * self.scaling
        self.sin = emb.sin() * self.scaling
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, positions: slice | torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        stop = positions.stop if isinstance(positions, slice) else int(positions.max()) + 1
        if stop > self.cos.shape[0]:
            self._build(max(stop, 2 * self.cos.shape[0]))
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        cos, sin = self._cast[dtype]
        return cos[positions], sin[positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [heads, T, head_dim]; cos/sin: [T, head_dim]."""
    return x * cos + rotate_half(x) * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q: [nh, Tq, hd]; k, v: [nkv, Tk, hd]; mask: bool [Tq, Tk] (True = may attend) or None (all).

    Returns [Tq, nh*hd]. Grouped-query attention is expanded by the kernel (enable_gqa).
    """
    out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                         attn_mask=mask, enable_gqa=q.shape[0] != k.shape[0])
    return out[0].transpose(0, 1).reshape(q.shape[1], -1)


def causal_mask(n_new: int, n_past: int, device=None) -> torch.Tensor | None:
    """Row i (absolute position n_past+i) may see keys 0..n_past+i. None when nothing is masked."""
    if n_new == 1:
        return None
    cols = torch.arange(n_past + n_new, device=device)
    rows = torch.arange(n_new, device=device) + n_past
    return cols.unsqueeze(0) <= rows.unsqueeze(1)


def init_linear_(module: nn.Module, std: float = 0.02) -> None:
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def entropy_from_logits(logits: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-(logp.exp() * logp).sum())


__all__ = ["RMSNorm", "SwiGLU", "Rotary", "apply_rope", "attend", "causal_mask", "init_linear_",
           "entropy_from_logits", "math"]
