"""The Q4_1 x Q8 matmul of kernels/q4_1.c: built here with the system C compiler, called with ctypes.

PyTorch's CPU int4 kernel (quant.Int4Linear) dequantises its weights to bf16 and multiplies in
floating point; llama.cpp instead quantizes each activation row to int8 per block of 32 and runs
integer dot products (VNNI dpbusd, or AVX2 maddubs), which at 1-4 rows is what a decode step and a
short verify need. The C file is small and plain (no PyTorch headers), so it builds in about a
second at first use (whiflash_core/native.py: for this CPU, or for the AVX2 class when PyTorch
is forced to its AVX2 kernels) and cached. Where there is no C compiler, no x86-64 with AVX2 or
the build fails, `available()` is False and the engine keeps PyTorch's kernels
(machine.light_formats): the format is then simply not among the candidates.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import native

SOURCE = Path(__file__).parent / "kernels" / "q4_1.c"
GROUP = 32


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.build(SOURCE)
    if lib is None:
        return None
    fn = lib.q4_1_matmul
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, ctypes.c_int, i64, i64, p, p, p, i64, p, ctypes.c_int]
    fn.restype = ctypes.c_int  # 0, or -1 when its work memory could not be allocated
    lib.q4_1_layout.argtypes = [i64]
    lib.q4_1_layout.restype = ctypes.c_int
    lib.q4_1_amx_enable.argtypes = [i64]
    lib.q4_1_amx_enable.restype = ctypes.c_int
    lib.q4_1_amx_calls.argtypes = []
    lib.q4_1_amx_calls.restype = i64
    lib.q4_1_bf16_enable.argtypes = [i64]
    lib.q4_1_bf16_enable.restype = ctypes.c_int
    lib.q4_1_bf16_calls.argtypes = []
    lib.q4_1_bf16_calls.restype = i64
    return lib


def use_amx(from_rows: int) -> bool:
    """Multiply calls of at least `from_rows` rows (0: none) with AMX tiles where this machine's
    kernel has them and the OS grants them (kernels/q4_1.c: the same results as without); returns
    whether it does."""
    lib = _library()
    return lib is not None and bool(lib.q4_1_amx_enable(from_rows)) and from_rows > 0


def amx_calls() -> int:
    """How many matmuls took the tile path in this process (they return what the VNNI path would)."""
    lib = _library()
    return int(lib.q4_1_amx_calls()) if lib is not None else 0


def use_bf16_tiles(from_rows: int) -> bool:
    """Multiply calls of at least `from_rows` rows (0: none) with AMX-BF16 tiles on weights
    dequantized once per call, where this machine's kernel has them and the OS grants them
    (kernels/q4_1.c bf16_matmul: x kept in bf16, the weights rounded to bf16, so the results differ
    in rounding from the integer paths, and are closer to the exact product); returns whether it
    does. Checked before `use_amx`'s threshold."""
    lib = _library()
    return lib is not None and bool(lib.q4_1_bf16_enable(from_rows)) and from_rows > 0


def bf16_calls() -> int:
    """How many matmuls took the bf16 tile path in this process."""
    lib = _library()
    return int(lib.q4_1_bf16_calls()) if lib is not None else 0


def outputs_in_lanes(n: int) -> bool:
    """Whether this machine's kernel takes N = n output rows packed with outputs in lanes (n % 16 ==
    0, on every class the kernel builds for: kernels/q4_1.c) rather than blocks in lanes."""
    lib = _library()
    return lib is not None and bool(lib.q4_1_layout(n))


isa = native.isa


def available() -> bool:
    """Whether the kernel built (or was built before) and loaded on this machine."""
    return _library() is not None


def padded_blocks(k: int) -> int:
    """Blocks of 32 per row after the kernel's padding: an even count (kernels/q4_1.c)."""
    return -(-(k // GROUP) // 2) * 2


def groups(np_: int) -> list[tuple[int, int]]:
    """(first block, width) of the kernel's groups of blocks in a row of np_ (padded) blocks:
    8 at a time, then one of 4 and one of 2 as np_ needs."""
    full = np_ // 8 * 8
    out = [(g, 8) for g in range(0, full, 8)]
    if np_ % 8 >= 4:
        out.append((full, 4))
    if np_ % 4 == 2:
        out.append((np_ - 2, 2))
    return out


def pack(q, d, m) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 blocks (q uint8 [N, K] with values 0..15, d and m [N, K/32]; numpy or torch) -> the
    kernel's (qw, dw, mw), in the layout this machine's kernel takes for N rows (kernels/q4_1.c):
    outputs in lanes (`outputs_in_lanes`), else blocks in lanes. Either way row-major in N (the
    rows of several linears stack by concatenation, quant.stack_linears, where each keeps the layout
    of the whole) and d and m fp16 (the GGUF's own precision)."""
    q = torch.as_tensor(q, dtype=torch.uint8)
    n, k = q.shape
    if outputs_in_lanes(n):
        return _pack_outputs_in_lanes(q, d, m)
    return _pack_blocks_in_lanes(q, d, m)


def _pack_outputs_in_lanes(q: torch.Tensor, d, m) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group o of 16 output rows and block b: 4 vectors of 16 lanes x 4 bytes, vector j's lane l
    holding w[16o + l][32b + 4j + c] (low nibbles) and w[16o + l][32b + 16 + 4j + c] (high), c < 4;
    d and m as [group, block, lane]."""
    n, k = q.shape
    nb = k // GROUP
    blocks = q.reshape(n // 16, 16, nb, 2, 4, 4)                    # [o, l, b, half, j, c]
    qw = (blocks[:, :, :, 0] | (blocks[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)   # [o, b, j, l, c]

    def scales(a) -> torch.Tensor:
        return torch.as_tensor(a).to(torch.float16).reshape(n // 16, 16, nb).transpose(1, 2).reshape(n, nb)

    return qw.reshape(n, nb * 16).contiguous(), scales(d).contiguous(), scales(m).contiguous()


def _pack_blocks_in_lanes(q: torch.Tensor, d, m) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In each group of 8 blocks (the last ones maybe 4 and 2: `groups`), vector v holds elements
    4v..4v+3 of block j in lane j, vectors 2i and 2i + 1 sharing bytes as low and high nibbles;
    zero-padded to an even number of blocks."""
    n, k = q.shape
    nb, np_ = k // GROUP, padded_blocks(k)
    blocks = torch.zeros(n, np_, GROUP, dtype=torch.uint8)
    blocks[:, :nb] = q.reshape(n, nb, GROUP)
    parts = []
    for start, width in groups(np_):
        # [n, lane j, vector v, 4 bytes] -> [n, v, j, 4]
        vectors = blocks[:, start:start + width].reshape(n, width, 8, 4).transpose(1, 2)
        parts.append((vectors[:, 0::2] | (vectors[:, 1::2] << 4)).reshape(n, width * 16))
    qw = torch.cat(parts, dim=1).contiguous()

    def scales(a) -> torch.Tensor:
        out = torch.zeros(n, np_, dtype=torch.float16)
        out[:, :nb] = torch.as_tensor(a).to(torch.float16)
        return out

    return qw, scales(d), scales(m)


def matmul(x2: torch.Tensor, qw: torch.Tensor, dw: torch.Tensor, mw: torch.Tensor,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x2 [M, K] float32 or bf16 @ W.T -> [M, N] in out_dtype, W the Q4_1 blocks as `pack` lays
    them out. The kernel sums in float32 and writes float32 or bf16 (rounded as .to(bfloat16)
    rounds); another out_dtype is a cast of the float32 result."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the Q4_1 kernel is not available on this machine (see q4_1_kernel.available)")
    if x2.dtype not in (torch.float32, torch.bfloat16):
        x2 = x2.float()
    x2 = x2.contiguous()
    m, k = x2.shape
    n = qw.shape[0]
    stored = out_dtype if out_dtype in (torch.float32, torch.bfloat16) else torch.float32
    y = torch.empty(m, n, dtype=stored)
    if lib.q4_1_matmul(x2.data_ptr(), int(x2.dtype == torch.bfloat16), m, k, qw.data_ptr(), dw.data_ptr(),
                       mw.data_ptr(), n, y.data_ptr(), int(stored == torch.bfloat16)) != 0:
        raise MemoryError(f"the Q4_1 kernel could not allocate its work memory for {m} rows of {k}")
    return y.to(out_dtype)


def reference(x2: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The same function in float64 PyTorch, for tests: x quantized per block of 32 to int8 (round
    half to even), then sum_b (d dx) (q . qx) + m sx. q uint8 [N, K], d and m [N, K/32]."""
    x = x2.double()
    rows, k = x.shape
    xb = x.reshape(rows, k // GROUP, GROUP)
    dx = (xb.abs().amax(-1) / 127.0).float().double()           # the kernel's scale is a float32
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx)).float().double()
    qx = torch.round((xb.float() * inv.float()[..., None]).double()).clamp(-127, 127)
    sx = (dx * qx.sum(-1)).float().double()
    qb = q.double().reshape(q.shape[0], k // GROUP, GROUP)
    dots = torch.einsum("rbi,nbi->rnb", qx, qb)                  # exact integers
    return (dots * (d.double()[None] * dx[:, None]) ).sum(-1) + sx @ m.double().T
