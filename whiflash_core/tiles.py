"""AMX tiles for the C kernels, where the CPU has them and they are faster here (measured at load).

Sapphire Rapids and later Xeons multiply 16 x 16 tiles in one instruction. Two kernels can use them:
- the Q4_1 matmul (kernels/q4_1.c), two ways:
  `amx_matmul`: one TDPBSUD per block of 32 for 16 rows of x by 16 outputs, where the VNNI path
  spends 8 dpbusd per row; the same integer sums and the same float32 scaling order, so the same
  bits as without tiles. Each block's sums are still scaled row by row, which is most of its cost.
  `bf16_matmul`: the weights dequantized to bf16 once per call and multiplied by x's bf16 rows
  with TDPBF16PS over whole rows of K (no per-block work): a fixed cost per call (the
  dequantization) and little per row, so it wins only from a few dozen rows (the shared step of
  many streams, an agent turn of tens of new tokens; longer prompts run in the dense twin). Its rounding differs from the integer paths' (x not rounded to int8, the weights
  rounded to bf16): closer to the exact product, but a forward of many rows no longer has a short
  forward's bits. Both pay from some number of rows, timed here per machine;
- attention with 8 or more queries a kv head (kernels/decode_ops.c, `attend_lanes_task_amx`):
  scores and values as bf16 tile products on the cache itself, instead of float32 FMAs on a
  converted copy. Products of bf16 summed in float32 in the tile unit's order and p rounded to bf16:
  a row's result differs in the last bits from the FMA path's (as any two forward shapes may).

`choose()` times both ways on random data of the model's shapes, turns the tiles on where they win
and caches the choice per machine; `WHIFLASH_TILES=0` keeps them off (A/B runs). Elsewhere (no AMX,
AVX2 builds) nothing changes.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass

import torch

from . import decode_ops, q4_1_kernel

# rows at which the Q4_1 matmul is timed each way; a way starts at the smallest count from which it
# beats every way before it by WIN_MARGIN at every larger count. The margin because the timing is of
# one linear with its weights in cache, where a forward streams them: timed so on a Xeon (2
# threads), tiles won by 8 % at 8 rows, and 8-row forwards then ran 8 % slower with them
# (bench/results/tiles_probe_xeon.json)
LINEAR_ROWS = (4, 8, 12, 16, 24, 32, 48, 64)
WIN_MARGIN = 0.9
ATTENTION_ROWS = 4        # a verify's rows (12 queries a kv head in SmolLM2: the lanes path)
ATTENTION_CONTEXT = 1024  # cached positions (an agent conversation's length)
CACHE_VERSION = 2


@dataclass(frozen=True)
class TileSettings:
    linear_from_rows: int = 0   # Q4_1 matmuls of at least this many rows use integer tiles (0: none)
    attention: bool = False     # attention in lanes uses tiles
    bf16_from_rows: int = 0     # Q4_1 matmuls of at least this many rows use bf16 tiles (0: none; before the above)


_current = TileSettings()


def current() -> TileSettings:
    return _current


def apply(settings: TileSettings) -> TileSettings:
    """Switch the kernels to `settings` (as far as this machine allows); returns what took effect."""
    global _current
    kernel = q4_1_kernel.available()
    linear = settings.linear_from_rows if kernel and q4_1_kernel.use_amx(settings.linear_from_rows) else 0
    bf16 = settings.bf16_from_rows if kernel and q4_1_kernel.use_bf16_tiles(settings.bf16_from_rows) else 0
    attention = decode_ops.available() and decode_ops.use_amx_attention(settings.attention)
    _current = TileSettings(linear, attention, bf16)
    return _current


def _best_of(*ways, reps: int = 9) -> list[float]:
    """[best seconds of each way()], the ways run in turn (drift hits them alike)."""
    for fn in ways:
        fn()
    best = [float("inf")] * len(ways)
    for _ in range(reps):
        for i, fn in enumerate(ways):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _start(timings: dict[int, list[float]], way: int) -> int:
    """The smallest timed row count from which `way` beats every way before it by WIN_MARGIN at
    every larger count (0: none)."""
    start = 0
    for rows in sorted(timings, reverse=True):
        if timings[rows][way] > WIN_MARGIN * min(timings[rows][:way]):
            break
        start = rows
    return start


def _linear_from_rows(n: int, k: int) -> tuple[int, int, dict]:
    """Where tiles win for an [n, k] Q4_1 matmul: (integer tiles from rows or 0, bf16 tiles from
    rows or 0, {rows: [plain s, integer tiles s, bf16 tiles s]}). bf16 tiles are weighed against
    the better of the other two; integer tiles only below where bf16 tiles start."""
    from .quant import quantize_q4_1

    if not q4_1_kernel.use_amx(1):   # no tiles in this build, or the OS refused them
        return 0, 0, {}
    bf16 = q4_1_kernel.use_bf16_tiles(1)
    q4_1_kernel.use_bf16_tiles(0)
    gen = torch.Generator().manual_seed(0)
    qw, dw, mw = q4_1_kernel.pack(*quantize_q4_1(torch.randn(n, k, generator=gen) * 0.05))
    timings = {}
    for rows in LINEAR_ROWS:
        x = torch.randn(rows, k, generator=gen).bfloat16()

        def way(integer: int, bf16_tiles: int):
            return lambda: (q4_1_kernel.use_amx(integer), q4_1_kernel.use_bf16_tiles(bf16_tiles),
                            q4_1_kernel.matmul(x, qw, dw, mw, torch.bfloat16))
        ways = [way(0, 0), way(1, 0)] + ([way(0, 1)] if bf16 else [])
        timings[rows] = _best_of(*ways)
    q4_1_kernel.use_amx(0)
    q4_1_kernel.use_bf16_tiles(0)
    bf16_start = _start(timings, 2) if bf16 else 0
    below = {r: t for r, t in timings.items() if not bf16_start or r < bf16_start}
    return _start(below, 1) if below else 0, bf16_start, timings


def _attention_wins(cfg) -> tuple[bool, list[float]]:
    """Whether tiles attend a verify's rows faster: (wins, [plain s, tiles s])."""
    gen = torch.Generator().manual_seed(0)
    nh, nkv, hd, t = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ATTENTION_ROWS
    cap = ATTENTION_CONTEXT + t
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=gen).bfloat16()
    cos, sin = torch.ones(t, hd).bfloat16(), torch.zeros(t, hd).bfloat16()
    k, v = torch.randn(nkv, cap, hd, generator=gen).bfloat16(), torch.randn(nkv, cap, hd, generator=gen).bfloat16()
    if not decode_ops.use_amx_attention(True):
        return False, []

    def way(on: bool):
        return lambda: (decode_ops.use_amx_attention(on),
                        decode_ops.attend_rows(qkv, cos, sin, k, v, ATTENTION_CONTEXT, nh, nkv))
    pair = _best_of(way(False), way(True))
    decode_ops.use_amx_attention(False)
    return pair[1] < pair[0], pair


def choose(cfg, use_cache: bool = True) -> tuple[TileSettings, dict]:
    """Time the kernels with and without tiles on this machine, for a target of config `cfg`, and
    apply what wins; returns (the settings in effect, the timings). Well under a second, and cached
    per machine, model shape and kernel sources as the format timings are (machine.py): a start
    that timed the threshold a row count higher than the last one would otherwise also time the
    router's verify tables again (they are cached per setting)."""
    if os.environ.get("WHIFLASH_TILES", "1") == "0" or not (q4_1_kernel.available() and decode_ops.available()):
        return apply(TileSettings()), {}
    from . import machine   # imported here: machine -> tiles would be a cycle through native

    key = {"v": CACHE_VERSION, "machine": machine.cpu_info(),
           "shape": [cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim],
           "sources": [hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in (q4_1_kernel.SOURCE, decode_ops.SOURCE)]}
    path = machine._cache_path(key, "tiles")
    saved = machine._cached(path, use_cache)
    if saved is not None:
        settings = apply(TileSettings(saved["linear_from_rows"], saved["attention"], saved["bf16_from_rows"]))
        return settings, {**saved, **asdict(settings)}
    linear, bf16, linear_times = _linear_from_rows(2 * cfg.intermediate_size, cfg.hidden_size)   # gate_up
    attention, attention_times = _attention_wins(cfg) if cfg.head_dim == 64 else (False, [])
    settings = apply(TileSettings(linear, attention, bf16))
    timings = {"linear_gate_up_ms": {str(r): [round(s * 1e3, 4) for s in p] for r, p in linear_times.items()},
               "attention_ms": [round(s * 1e3, 4) for s in attention_times], **asdict(settings)}
    machine._write_json(path, timings)
    return settings, timings
