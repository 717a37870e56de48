"""The small ops of a bf16 decoder layer at decode / verify row counts, in C (kernels/decode_ops.c).

With the Q4_1 kernel doing the linears, a one-row forward spends about as long in RMSNorm, rotary,
the KV-cache writes, attention and SwiGLU's silu * up as in its weights: each of those is several
PyTorch kernels, and the CPU flash-attention kernel costs ~45 us per layer for one query row. Here
each is one call. They are used by a target whose linears are Q4_1 (`use_for`, set by
quant.quantize_target_int4), for bf16 rows on the CPU only; everything else keeps PyTorch's ops.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import native

SOURCE = Path(__file__).parent / "kernels" / "decode_ops.c"
# rows per request through the C attention and the layer stack (a decode step or a verify); more
# take the module forward and SDPA. Measured at 16 (bench/results/attention_rows_check.txt, one
# thread, 300 cached): a 9-row verify 25.9 -> 17.9 ms natively and 47.4 -> 39.2 ms with the AVX2
# kernels, 16 rows 35.6 -> 27.7 / 75.4 -> 65.1 ms, where at 8 they left the layer stack; 1-8 rows
# the same. Long prompt-lookup drafts (up to 15 tokens) verify here.
MAX_ATTENTION_ROWS = 16
# keys per attention task in kernels/decode_ops.c (its CHUNK): requests share a cached prefix's
# K/V reads in whole chunks (attend_segments)
ATTENTION_CHUNK = 64


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.build(SOURCE)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rms_norm_bf16.argtypes = [p, p, ctypes.c_float, i64, i64, p]
    lib.rms_norm_bf16.restype = None
    lib.silu_mul_bf16.argtypes = [p, i64, i64, p]
    lib.silu_mul_bf16.restype = None
    lib.attend_rows_bf16.argtypes = [p, p, p, p, p, i64, i64, i64, i64, i64, i64, p]
    lib.attend_rows_bf16.restype = ctypes.c_int
    lib.attend_segments_bf16.argtypes = [p, p, p, i64, p, p, p, p, p, p, p, i64, i64, i64, p]
    lib.attend_segments_bf16.restype = ctypes.c_int
    lib.ngram_match_i64.argtypes = [p, i64, i64, i64, i64, p]
    lib.ngram_match_i64.restype = None
    lib.softmax_stats_f32.argtypes = [p, i64, p]
    lib.softmax_stats_f32.restype = None
    lib.topk_rows_f32.argtypes = [p, i64, i64, i64, p]
    lib.topk_rows_f32.restype = None
    lib.argmax_rows_f32.argtypes = [p, i64, i64, p, i64, p]
    lib.argmax_rows_f32.restype = None
    lib.refine_top_f32.argtypes = [p, i64, i64, p, p, i64, i64]
    lib.refine_top_f32.restype = None
    lib.mlp2_f32.argtypes = [p, i64, p, p, i64, p, p, i64, p]
    lib.mlp2_f32.restype = None
    lib.mlp2_at_f32.argtypes = [p, i64, ctypes.c_int, p, i64, p, p, i64, p, p, i64, p]
    lib.mlp2_at_f32.restype = None
    lib.attention_amx_enable.argtypes = [ctypes.c_int]
    lib.attention_amx_enable.restype = ctypes.c_int
    # the router's round (router_native.py)
    lib.router_round.argtypes = [p, p, p, p, i64, p, i64, p, i64, p, ctypes.c_int, i64, ctypes.c_double,
                                 ctypes.c_double, p, p, p, p]
    lib.router_round.restype = None
    lib.router_apply.argtypes = [p, p, p, p, i64]
    lib.router_apply.restype = None
    lib.router_rates.argtypes = [p, p, i64, i64, i64, p]
    lib.router_rates.restype = None
    return lib


def use_amx_attention(on: bool) -> bool:
    """Attend 8 or more queries a kv head with AMX tiles (kernels/decode_ops.c) where this
    machine's build has them and the OS grants them; returns whether it does."""
    lib = _library()
    return lib is not None and bool(lib.attention_amx_enable(int(on)))


def available() -> bool:
    return _library() is not None


def applies(x: torch.Tensor, head_dim: int = 16) -> bool:
    """Whether these ops take x: bf16 on the CPU, last dimension (and head_dim) a multiple of 16,
    head_dim at most 256 (attention keeps a query head in registers)."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[-1] % 16 == 0
            and head_dim % 16 == 0 and head_dim <= 256)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm in one call: bf16(weight * bf16(x * rsqrt(mean(x^2) + eps))), x [..., K]."""
    x = x.contiguous()
    y = torch.empty_like(x)
    k = x.shape[-1]
    _library().rms_norm_bf16(x.data_ptr(), weight.data_ptr(), eps, x.numel() // k, k, y.data_ptr())
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up = [gate | up] ([M, 2H] bf16) -> [M, H]."""
    gate_up = gate_up.contiguous()
    m, h = gate_up.shape[0], gate_up.shape[1] // 2
    y = torch.empty(m, h, dtype=gate_up.dtype)
    _library().silu_mul_bf16(gate_up.data_ptr(), m, h, y.data_ptr())
    return y


def attend_rows(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, start: int, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """target.Attention.attend_rows for t <= MAX_ATTENTION_ROWS rows without q/k norms: rotate q
    and k of qkv [t, (nh + 2 nkv) hd], write k and v into the layer's cache ([nkv, capacity, hd],
    contiguous) at start.., attend causally. Returns [t, nh hd] bf16."""
    t, hd = qkv.shape[0], k_cache.shape[-1]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty(t, n_heads * hd, dtype=qkv.dtype)
    if _library().attend_rows_bf16(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                                   v_cache.data_ptr(), k_cache.shape[1], start, t, n_heads, n_kv_heads, hd,
                                   out.data_ptr()) != 0:
        raise MemoryError(f"attention scratch for {t} rows over {start + t} keys could not be allocated")
    return out


def int64s(values) -> ctypes.Array:
    """A C array of int64 (a ctypes argument)."""
    return (ctypes.c_int64 * len(values))(*values)


def pointers(values) -> ctypes.Array:
    """A C array of addresses (a ctypes argument)."""
    return (ctypes.c_void_p * len(values))(*values)


def attend_segments(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    segments: list[tuple[int, int, torch.Tensor, torch.Tensor]], lead: list[int], shared: list[int],
                    n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """`attend_rows` for the rows of several requests in one call: segments (rows, start, k_cache,
    v_cache) in row order, each cache one layer's [nkv, capacity, hd]; segment s's first shared[s]
    keys (whole ATTENTION_CHUNKs) are those of segment lead[s]'s cache bit for bit, and are read
    from there once for all that share them. The same bits as an attend_rows call per segment."""
    hd = segments[0][2].shape[-1]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    out = torch.empty(qkv.shape[0], n_heads * hd, dtype=qkv.dtype)
    if _library().attend_segments_bf16(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), len(segments), int64s([s[0] for s in segments]),
            int64s([s[1] for s in segments]), int64s([s[2].shape[1] for s in segments]),
            pointers([s[2].data_ptr() for s in segments]), pointers([s[3].data_ptr() for s in segments]),
            int64s(lead), int64s(shared), n_heads, n_kv_heads, hd, out.data_ptr()) != 0:
        raise MemoryError(f"attention scratch for {qkv.shape[0]} rows of {len(segments)} requests "
                          "could not be allocated")
    return out


_STATS = ctypes.c_float * 2
_MATCH = ctypes.c_int64 * 3


def ngram_match(ids: torch.Tensor, n: int, min_ngram: int, max_ngram: int,
                longest_run: int) -> tuple[int, int, int] | None:
    """Prompt lookup's search (NgramDrafter.match) in one C scan of ids[:n+1] (the verified context
    and the pending token): (size, start, copy run), (0, 0, 0) without a match; None where the C
    ops are not built (the drafter then scans in Python). A context off the CPU is read to the host
    once (one wait for the device a round, as any host read of it)."""
    lib = _library()
    if lib is None:
        return None
    if n >= ids.shape[0]:
        raise IndexError(f"pending token {n} past the {ids.shape[0]} ids")
    if ids.dtype is not torch.int64 or not ids.is_cpu or not ids.is_contiguous():
        ids = ids[:n + 1].to("cpu", torch.int64).contiguous()
    out = _MATCH()
    lib.ngram_match_i64(ids.data_ptr(), n, min_ngram, max_ngram, longest_run, out)
    return out[0], out[1], out[2]


def softmax_stats(logits: torch.Tensor) -> tuple[float, float] | None:
    """(entropy in nats, top-1 probability) of softmax(logits) for one float32 CPU row [V] in one
    C call (threaded over fixed spans: the same bits on any thread count), or None where the C ops
    are not built or do not take it (the caller then uses PyTorch's ops: acceptance.entropy_and_top1).
    Called once a round on cold objects, so the checks are few and cheap."""
    lib = _library()
    if lib is None or logits.dtype is not torch.float32 or not logits.is_cpu or logits.dim() != 1:
        return None
    if not logits.is_contiguous():
        logits = logits.contiguous()
    out = _STATS()
    lib.softmax_stats_f32(logits.data_ptr(), logits.shape[0], out)
    return out[0], out[1]


MAX_TOPK = 64   # topk_rows_f32 keeps the k largest on its stack


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """The indices [rows, k] of the k largest values of each row of a float32 CPU matrix, largest
    first, equal values by the lower index (torch.topk's set, with a fixed rule for ties), in one C
    pass a row; None where the C ops are not built or do not take x (the caller uses torch.topk)."""
    lib = _library()
    if (lib is None or x.dtype is not torch.float32 or x.device.type != "cpu" or x.dim() != 2
            or not 0 < k <= min(MAX_TOPK, x.shape[1])):
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], k, dtype=torch.long)
    lib.topk_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], k, out.data_ptr())
    return out


def refine_top(logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, k: int) -> bool:
    """TargetModel.logits' refinement in one C call, in place: each row's k largest logits [rows, V]
    (float32) recomputed as the float32 dot products of their dense weight rows [V, H] with the
    row's hidden state h [rows, H] (both bf16). False (nothing done) where the C ops are not built
    or do not take these tensors."""
    lib = _library()
    if (lib is None or not isinstance(weight, torch.Tensor) or logits.dtype is not torch.float32 or h.dtype is not torch.bfloat16
            or weight.dtype is not torch.bfloat16 or any(t.device.type != "cpu" or not t.is_contiguous()
                                                          for t in (logits, h, weight))
            or logits.dim() != 2 or h.shape != (logits.shape[0], weight.shape[1]) or weight.shape[0] != logits.shape[1]
            or weight.shape[1] % 16 or not 0 < k <= min(MAX_TOPK, logits.shape[1])):
        return False
    lib.refine_top_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], h.data_ptr(), weight.data_ptr(),
                       weight.shape[1], k)
    return True


def argmax_rows(x: torch.Tensor, allowed: torch.Tensor | None = None) -> list[int] | None:
    """torch.argmax(x, -1).tolist() of a float32 CPU matrix (the first largest value; the first NaN
    where a row has one) in one C call, or None where the C ops are not built or do not take x.
    With `allowed` (a grammar's packed masks, one row per row of x: engine.Constraint.bitmasks) the
    argmax of each row with the forbidden tokens at -inf, read without writing that copy."""
    lib = _library()
    if lib is None or x.dtype is not torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] == 0:
        return None
    if allowed is not None and (allowed.dtype is not torch.int32 or allowed.device.type != "cpu"
                                or allowed.dim() != 2 or allowed.shape[0] != x.shape[0]):
        return None
    x = x.contiguous()
    allowed = allowed.contiguous() if allowed is not None else None
    out = (ctypes.c_int64 * x.shape[0])()
    lib.argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], allowed.data_ptr() if allowed is not None else None,
                        allowed.shape[1] if allowed is not None else 0, out)
    return list(out)


MAX_MLP_WIDTH = 1024   # mlp2_f32's hidden layer lives on its stack


def _mlp2_library(w1: torch.Tensor, *tensors: torch.Tensor):
    """The C ops, where they are built and take these tensors (float32, CPU, contiguous; w1 first:
    its rows are the hidden layer, at most MAX_MLP_WIDTH), else None."""
    lib = _library()
    if (lib is None or w1.shape[0] > MAX_MLP_WIDTH
            or any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                   for t in (w1, *tensors))):
        return None
    return lib


def mlp2(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> list[float] | None:
    """sigmoid(w2 @ gelu(w1 @ x + b1) + b2) for float32 CPU tensors, in one C call (its hidden rows
    shared among the pool's threads, the same bits on any count; router_mlp.RouterMLP.rates), or
    None where the C ops are not built or do not take these."""
    lib = _mlp2_library(w1, b1, w2, b2, x)
    if lib is None:
        return None
    out = (ctypes.c_float * w2.shape[0])()
    lib.mlp2_f32(x.data_ptr(), x.shape[0], w1.data_ptr(), b1.data_ptr(), w1.shape[0], w2.data_ptr(), b2.data_ptr(),
                 w2.shape[0], out)
    return list(out)


class MLP2:
    """`mlp2` bound to one set of weights, for a call every round (RouterMLP.rates_at): the weights'
    pointers, the scalars' array and the output array are made once, and the C call reads the
    hidden state where it lies (bf16 or float32), so a call is a write of the scalars and one C
    call. In a round every Python object the call touches is cold (the target's forward has just
    evicted the caches): the generic `mlp2` checks and converts its five tensors every call, which
    cost as much as the C itself, and copying the hidden state into a float32 row with a tensor op
    cost ~20 of the ~100 us such a call took. None from `make` where the C ops are not built or do
    not take these weights."""

    def __init__(self, lib, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, hidden_size: int):
        self._weights = (w1, b1, w2, b2)   # kept alive: the C call reads them by address
        self.features, self.width, self.outputs = w1.shape[1], w1.shape[0], w2.shape[0]
        self.hidden_size = hidden_size
        self._scalars = (ctypes.c_float * (self.features - hidden_size))()
        self._out = (ctypes.c_float * self.outputs)()
        self._weight_args = (w1.data_ptr(), b1.data_ptr(), self.width, w2.data_ptr(), b2.data_ptr(), self.outputs,
                             self._out)
        self._fn = lib.mlp2_at_f32

    @classmethod
    def make(cls, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
             hidden_size: int) -> "MLP2 | None":
        lib = _mlp2_library(w1, b1, w2, b2)
        return None if lib is None else cls(lib, w1, b1, w2, b2, hidden_size)

    def __call__(self, hidden: torch.Tensor, scalars: list[float]) -> list[float]:
        """sigmoid(w2 @ gelu(w1 @ x + b1) + b2) for x = [hidden, scalars] (hidden: [hidden_size]
        on the CPU, any float dtype; bf16 and float32 contiguous rows are read in place)."""
        if hidden.shape != (self.hidden_size,):   # the C call reads hidden_size values from its address
            raise ValueError(f"hidden state of shape {tuple(hidden.shape)}, the router MLP takes ({self.hidden_size},)")
        if hidden.dtype not in (torch.bfloat16, torch.float32) or not hidden.is_contiguous():
            hidden = hidden.float().contiguous()
        self._scalars[:] = scalars   # a list of another length raises (ctypes)
        self._fn(hidden.data_ptr(), self.hidden_size, hidden.dtype is torch.bfloat16, self._scalars,
                 len(self._scalars), *self._weight_args)
        return self._out[:]


def use_for(model: torch.nn.Module) -> bool:
    """Turn these ops on in `model`'s norms, attention and MLPs (the modules with a `native_ops`
    flag); False (and nothing changed) where the kernels could not be built here."""
    if not available():
        return False
    for module in model.modules():
        if hasattr(module, "native_ops"):
            module.native_ops = True
    if hasattr(model, "layer_stack"):   # a target: its whole layer stack in one call where it can
        from .layer_stack import LayerStack
        model.layer_stack = LayerStack.build(model)
    return True
