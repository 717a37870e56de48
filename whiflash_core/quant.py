"""Lighter target weights for CPU decode: the GGUF's own Q4_1 blocks (int4) and per-row int8.

The embedded model ships as Q4_1: blocks of 32 weights along the input dimension, each
w = d * q + m with q in 0..15 and fp16 d, m. PyTorch's CPU int4 matmul (the tinygemm layout that
gpt-fast and torchao use) computes w = (q - 8) * scale + zero per group, so the same weights are
scale = d, zero = m + 8 d. Only d and m are rounded (to bf16, the kernel's scale dtype), so this
target is numerically close to, but not the same function as, the dequantised bf16 one: it is a
flag (`--weights int4`), and the float32 reference path stays.

`--weights q4_1` runs the same blocks, exact, through the Q4_1 x Q8 kernel built on this machine
(q4_1_kernel: activations quantized to int8 per block of 32 and integer dot products, as llama.cpp
does): faster than PyTorch's int4 kernel per linear and on a whole forward, by how much depends on
the CPU (bench/q4_1_probe.py; the README quotes its results). `machine` times it with the others
and picks it where it wins.

Decode is bound by reading weights (about 270 MB per token in bf16); int4 reads a quarter of that.
For many rows (long prefill, big verify) the dense bf16 GEMM is faster, so `Int4Linear` keeps an
optional dense copy and uses it above `dense_from_rows` rows.

The tied 49k-row LM head is not Q4_1 in the GGUF; in bf16 it alone costs ~2 ms of a ~12 ms int4
decode step. `Int8Linear` (one symmetric scale per output row, `_weight_int8pack_mm`) reads half
the bytes. Its logits are coarser, but the target recomputes its top-8 logits in float32 from the
dense weights (`TargetModel.logits`), so a greedy choice only changes if the true argmax falls out
of the int8 top 8. `--weights int8` applies it to every linear of any Llama/Qwen3 target. Since the
head only ranks candidates, it may also run 4-bit weights (`Int4Linear.from_dense`: half the bytes
again) or PyTorch's dynamic int8 GEMM (`DynInt8Linear`: activations quantized too, integer dot
products), whichever `machine` measures fastest.
"""
from __future__ import annotations

from typing import Literal, get_args

import numpy as np
import torch
from torch import nn

from . import decode_ops, q4_1_kernel
from .target import STACKED, TargetModel

WeightFormat = Literal["auto", "dense", "int8", "int4", "q4_1"]  # auto: whiflash_core.machine picks
WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)
# The light formats win while few rows are multiplied (decode, verify); the dense bf16 GEMM wins
# for long prefills (measured: bench/verify_curve.py), so keep both and switch at DENSE_FROM_ROWS.
DENSE_FROM_ROWS = 24

GROUP = 32
Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles


def decode_q4_1(raw: np.ndarray, n_cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw uint8 [rows, n_cols/32*20] -> (q uint8 [rows, n_cols], d f32 [rows, G], m f32 [rows, G])."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, n_cols // GROUP, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    # ggml order: low nibbles are elements 0..15 of the block, high nibbles 16..31
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(rows, n_cols)
    return q, d, m


def _reverse_permute(x: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for rotary (as transformers does on load)."""
    dim = x.shape[0] // n_head // 2
    return x.reshape(n_head, dim, 2, *x.shape[1:]).swapaxes(2, 1).reshape(x.shape)


GGUF_TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}


def read_q4_1_linears(gguf_path: str, num_heads: int, num_kv_heads: int) -> dict[str, tuple]:
    """{'layers.{i}.{module}': (q, d, m)} for every Q4_1 linear in the file, in HF orientation."""
    from .gguf_index import read_tensors

    out = {}
    for t in read_tensors(gguf_path):
        if t.type.name != "Q4_1" or not t.name.startswith("blk."):
            continue
        _, layer, kind, _ = t.name.split(".")
        n_cols = int(t.shape[0])  # gguf shapes are [in, out]
        q, d, m = decode_q4_1(np.asarray(t.data), n_cols)
        if kind in ("attn_q", "attn_k"):
            heads = num_heads if kind == "attn_q" else num_kv_heads
            q, d, m = (_reverse_permute(a, heads) for a in (q, d, m))
        out[f"layers.{layer}.{GGUF_TO_HF[kind]}"] = (q, d, m)
    return out


# PyTorch's CPU weight-only kernels (int4 and int8 below) are fast with bf16 activations and 3-6x
# slower with float32 ones (measured on AVX2 and AVX-512 machines alike), so they always run in bf16;
# a float32 model casts its activations around them (what an AVX2 CPU, which emulates bf16
# element-wise work, may prefer for everything else: `machine` times both).
KERNEL_DTYPE = torch.bfloat16


class _WeightOnlyLinear(nn.Module):
    """What the light linears share: y = x @ W.T for x [..., in] by `kernel` over the rows flattened,
    or through the dense copy `weight` (when kept) from `dense_from_rows` rows on."""
    out_features: int
    weight: torch.Tensor | None
    dense_from_rows: int

    def kernel(self, x2: torch.Tensor) -> torch.Tensor:   # [rows, in] -> [rows, out], in x2's dtype
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.weight is not None and x2.shape[0] >= self.dense_from_rows:
            y = nn.functional.linear(x2, self.weight)
        else:
            y = self.kernel(x2)
        return y.reshape(*shape[:-1], self.out_features)


def quantize_q4_1(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A dense weight [n, k] in Q4_1's scheme: 4 bits per value, asymmetric per group of 32
    (w = d * q + m, q in 0..15) -> (q uint8 [n, k], d, m float32 [n, k/32])."""
    w = weight.detach().float()
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    d = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((groups - lo[..., None]) / d[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    return q.numpy(), d.numpy(), lo.numpy()


class Int4Linear(_WeightOnlyLinear):
    """y = x @ W.T with W held as packed int4 + per-group (scale, zero); bias-free.

    The kernel runs in bf16 (KERNEL_DTYPE); x and y are in x's dtype, the model's activation dtype.
    `weight` is the optional dense copy used from `dense_from_rows` rows on (None if not kept).
    """

    def __init__(self, q: np.ndarray, d: np.ndarray, m: np.ndarray, dense: torch.Tensor | None = None,
                 dense_from_rows: int = 10**9):
        super().__init__()
        n, k = q.shape
        self.in_features, self.out_features = k, n
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
        scale = torch.from_numpy(d)
        zero = torch.from_numpy(m) + 8 * scale
        self.scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
        self.weight = dense
        self.dense_from_rows = dense_from_rows

    @classmethod
    def from_dense(cls, weight: torch.Tensor, dense_from_rows: int = 10**9) -> "Int4Linear":
        """`weight` in Q4_1 blocks (quantize_q4_1), kept (shared, not copied) as the dense copy.
        For the LM head, whose candidates the target refines in float32 (TargetModel.logits)."""
        return cls(*quantize_q4_1(weight), weight, dense_from_rows)

    def kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(KERNEL_DTYPE).contiguous(), self.packed,
                                                         GROUP, self.scales_and_zeros).to(x2.dtype)


class Q41Linear(_WeightOnlyLinear):
    """y = x @ W.T with W in the GGUF's own Q4_1 blocks (exact fp16 d and m), multiplied as llama.cpp
    does: each row of x quantized to int8 per block of 32, integer dot products (q4_1_kernel; built
    on this machine at first use). Bias-free. x may be bf16 or float32, y comes back in x's dtype.

    A different function from Int4Linear's (which dequantises to bf16 and multiplies in floating
    point): the int8 activations round once more. Like every format it is only ever compared with
    itself: each emitted token is the argmax of the forward that verified it.
    """

    def __init__(self, q: np.ndarray, d: np.ndarray, m: np.ndarray, dense: torch.Tensor | None = None,
                 dense_from_rows: int = 10**9):
        super().__init__()
        n, k = q.shape
        self.in_features, self.out_features = k, n
        self.qw, self.dw, self.mw = q4_1_kernel.pack(q, d, m)
        self.weight = dense
        self.dense_from_rows = dense_from_rows

    @classmethod
    def from_dense(cls, weight: torch.Tensor, dense_from_rows: int = 10**9) -> "Q41Linear":
        """`weight` in Q4_1 blocks (quantize_q4_1), kept (shared, not copied) as the dense copy."""
        return cls(*quantize_q4_1(weight), weight, dense_from_rows)

    def kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return q4_1_kernel.matmul(x2, self.qw, self.dw, self.mw, out_dtype=x2.dtype)  # y in x's dtype


class Int8Linear(_WeightOnlyLinear):
    """y = x @ W.T with W as int8 and one scale per output row; bias-free. The kernel runs in bf16
    (KERNEL_DTYPE); x and y are in the dense weight's dtype.

    `weight` stays the dense tensor (shared, e.g. the tied embedding: no copy), for long inputs and
    for readers of `.weight` such as the float32 top-k refinement.
    """

    def __init__(self, weight: torch.Tensor, dense_from_rows: int = 10**9):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scales = scale.to(KERNEL_DTYPE)
        self.weight = weight
        self.dense_from_rows = dense_from_rows

    def kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x2.to(KERNEL_DTYPE).contiguous(), self.q, self.scales).to(x2.dtype)


def quantize_linears_q4_1(module: nn.Module, dense_from_rows: int = 10**9) -> int:
    """Swap bias-free linears of `module` whose input width is a whole number of Q4_1 blocks for
    Q41Linear (quantize_q4_1 of their weights, the dense weights kept for `dense_from_rows` rows
    on) in place; returns the count. For drafters beside a q4_1 target (Drafter.q4_1_weights)."""
    names = [n for n, m in module.named_modules()
             if type(m) is nn.Linear and m.bias is None and m.in_features % GROUP == 0]
    return _swap_linears(module, names, lambda weight: Q41Linear.from_dense(weight, dense_from_rows))


def stack_linears(linears: list[nn.Module]) -> nn.Module:
    """One bias-free linear whose output rows are those of `linears` in order (q/k/v, gate/up),
    of the same kind: an Int8Linear re-quantizes the stacked dense weights (each row keeps its own
    scale, so the same int8 values), an nn.Linear stacks its weights. One matmul call instead of
    several, where call overhead is most of a small drafter step's cost."""
    first = linears[0]
    if isinstance(first, Q41Linear):   # Q4_1 blocks are per row: stacking rows is concatenating them
        out = Q41Linear.__new__(Q41Linear)
        nn.Module.__init__(out)
        out.in_features, out.out_features = first.in_features, sum(m.out_features for m in linears)
        if len({q4_1_kernel.outputs_in_lanes(m.out_features) for m in linears + [out]}) > 1:
            raise ValueError("these Q4_1 linears are packed in different layouts: they cannot be stacked")
        out.qw, out.dw, out.mw = (torch.cat([getattr(m, a) for m in linears]) for a in ("qw", "dw", "mw"))
        dense = [m.weight for m in linears]
        out.weight = torch.cat([w.detach() for w in dense]) if all(w is not None for w in dense) else None
        out.dense_from_rows = first.dense_from_rows if out.weight is not None else 10**9
        return out
    weight = torch.cat([m.weight.detach() for m in linears])
    if isinstance(first, Int8Linear):
        return Int8Linear(weight, first.dense_from_rows)
    if type(first) is nn.Linear and all(m.bias is None for m in linears):
        out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        out.weight.data = weight
        return out
    raise TypeError(f"cannot stack {type(first).__name__} linears")


def dynamic_int8_available() -> bool:
    """Whether this PyTorch build has a dynamic int8 GEMM for the CPU (fbgemm / x86 / qnnpack)."""
    return any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm", "qnnpack"))


class DynInt8Linear(_WeightOnlyLinear):
    """y = x @ W.T through PyTorch's dynamic int8 GEMM (fbgemm on x86: VNNI/AVX2 integer dot
    products): W int8 per output row, x quantized to uint8 per call (one scale per tensor).

    For the LM head only. Quantizing the activations makes its logits coarser than weight-only
    int8, which is harmless there: the target recomputes its top-8 logits in float32 from the dense
    `weight` (TargetModel.logits), so only the candidates come from this kernel. (Used for the
    decoder layers, per-tensor activation scales cost too much: teacher-forced greedy agreement with
    the float32 model fell from 99.1 % (int4 layers) to 88 % on distilled answers.) bias-free.
    """

    def __init__(self, weight: torch.Tensor, dense_from_rows: int = 10**9):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
        engine = next(e for e in ("x86", "fbgemm", "qnnpack") if e in torch.backends.quantized.supported_engines)
        torch.backends.quantized.engine = engine  # prepacking picks the kernel family
        qw = torch.quantize_per_channel(w, scale, torch.zeros(len(scale), dtype=torch.long), 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.weight = weight
        self.dense_from_rows = dense_from_rows

    def kernel(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x2.float().contiguous(), self.packed, False).to(x2.dtype)


HEAD_KINDS = {"int8": Int8Linear, "dynint8": DynInt8Linear, "int4": Int4Linear.from_dense,
              "q4_1": Q41Linear.from_dense}


def quantize_head(model: nn.Module, kind: str, dense_from_rows: int = 10**9) -> None:
    """The target's LM head in a light kind (HEAD_KINDS), its dense weight kept for the refinement."""
    if kind not in HEAD_KINDS:
        raise ValueError(f"unknown head kind {kind!r} (one of {', '.join(HEAD_KINDS)})")
    model.lm_head = HEAD_KINDS[kind](model.lm_head.weight, dense_from_rows)


def quantize_int8(module: nn.Module, dense_from_rows: int = 10**9, names: list[str] | None = None) -> int:
    """Swap bias-free linears of `module` (all of them, or those named) for Int8Linear in place;
    returns the count. Linears with a bias stay dense (Int8Linear has none).

    Used for `--weights int8` targets, the LM head of `--weights int4`, and the drafters of a light
    target: a drafter step is bound by reading its weights (EAGLE-3: ~18 MB of bf16 per chain step,
    half of it the draft-vocabulary head). Drafter numerics never touch losslessness (the target
    verifies every draft token); they can only cost acceptance. int8 rather than int4 drafters: on a
    real context they proposed the dense drafters' tokens 96-99 % of the time, int4 (blocks of 32)
    83-92 %, for a 0.2 ms shorter EAGLE-3 round.
    """
    if names is None:
        names = [n for n, m in module.named_modules() if isinstance(m, nn.Linear) and m.bias is None]
    return _swap_linears(module, names, lambda weight: Int8Linear(weight, dense_from_rows))


def _swap_linears(module: nn.Module, names: list[str], make) -> int:
    """Replace each linear `names` of `module` by make(its weight) in place; returns the count."""
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, make(getattr(parent, attr).weight))
    return len(names)


def quantize_target_int4(model: TargetModel, gguf_path: str, dense_from_rows: int = 10**9,
                         kind: type = Int4Linear) -> int:
    """Swap the target's Q4_1 linears for `kind` (Int4Linear or Q41Linear) in place; returns how
    many were swapped.

    The GGUF's q/k/v and gate/up tensors are stacked by rows as the target stacks them (STACKED).
    Checks on the way that d*q + m reproduces the dequantised weights the model was loaded with,
    i.e. that the packed weights are the GGUF's own.
    """
    cfg = model.cfg
    found = read_q4_1_linears(gguf_path, cfg.num_heads, cfg.num_kv_heads)
    for i in range(cfg.num_layers):
        for stacked, parts in STACKED.items():
            names = [f"layers.{i}.{p}" for p in parts]
            if all(n in found for n in names):
                blocks = [found.pop(n) for n in names]
                found[f"layers.{i}.{stacked}"] = tuple(np.concatenate(arrays) for arrays in zip(*blocks))
    swapped = 0
    for name, (q, d, m) in found.items():
        parent_name, attr = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, attr)
        w = linear.weight.detach()
        deq = torch.from_numpy(q.astype(np.float32).reshape(q.shape[0], -1, GROUP) * d[..., None] + m[..., None])
        deq = deq.reshape(q.shape)
        if not torch.allclose(deq.to(w.dtype).float(), w.float(), rtol=0, atol=1e-2 * float(w.abs().max())):
            raise ValueError(f"{name}: GGUF Q4_1 blocks do not match the loaded weights")
        dense = w if dense_from_rows < 10**9 else None
        setattr(parent, attr, kind(q, d, m, dense, dense_from_rows))
        swapped += 1
    return swapped


def apply_weight_format(model: TargetModel, weights: str, gguf_path: str | None = None,
                        dense_from_rows: int = DENSE_FROM_ROWS, head: str = "int8") -> None:
    """Put a loaded bf16 (or float32) target into weight format `weights` in place; from
    `dense_from_rows` rows on its linears use the dense weights.

    int4 runs the GGUF's own Q4_1 blocks (`gguf_path`) through PyTorch's CPU int4 matmul, q4_1 the
    same blocks through the Q4_1 x Q8 kernel built here (q4_1_kernel); int8 quantises every linear
    per output row (any target). Either way the LM head (not Q4_1 in the GGUF) is
    `head` (HEAD_KINDS), whichever `machine` measured faster.
    """
    if weights not in WEIGHT_FORMATS or weights == "auto":
        raise ValueError(f"unknown weight format {weights!r} (one of {', '.join(WEIGHT_FORMATS)})")
    if weights != "dense" and model.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{weights} weights run with bfloat16 or float32 activations")
    if weights in ("int4", "q4_1"):
        if gguf_path is None:
            raise ValueError(f"{weights} weights need a GGUF with Q4_1 blocks (the embedded default or a .gguf path)")
        if weights == "q4_1" and not q4_1_kernel.available():
            raise ValueError("q4_1 weights need the Q4_1 kernel, which could not be built here "
                             "(a C compiler and an x86-64 CPU with AVX2); use int4")
        quantize_target_int4(model, gguf_path, dense_from_rows=dense_from_rows,
                             kind=Q41Linear if weights == "q4_1" else Int4Linear)
        if weights == "q4_1":  # the rest of the layer in C too: part of the format machine.py times
            decode_ops.use_for(model)
    elif weights == "int8":
        quantize_int8(model, dense_from_rows, names=[n for n, m in model.named_modules()
                                                      if isinstance(m, nn.Linear) and m.bias is None and n != "lm_head"])
    if weights != "dense":
        quantize_head(model, head, dense_from_rows)
