"""The Q4_1 x Q8 kernel against PyTorch's int4 kernel: each linear alone, then a whole forward.

    .venv/bin/python bench/q4_1_probe.py --out bench/results/q4_1_probe_native.json [--threads 2]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python bench/q4_1_probe.py --out bench/results/q4_1_probe_avx2.json

1. Kernel alone: the embedded model's linear shapes (q/k/v, o, gate/up, down, the LM head) with
   random Q4_1 blocks, 1 and 4 rows of bf16 activations, best of 50 calls each. The same weights
   are called again and again, so they sit in cache: this is the kernels' arithmetic.
2. Whole forward: the embedded target with `--weights int4` and `--weights q4_1` (bf16
   activations, LM head of the same kind; q4_1 also runs the rest of each layer through
   kernels/decode_ops.c, and all its layers in one C call, kernels/layers.c, which is also timed
   off: "q4_1_modules"), 1, 4, 5 and 8 new rows after 300 cached positions, best of 15, the
   three interleaved over 3 rounds. Here each layer's weights come from memory again.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core import q4_1_kernel  # noqa: E402
from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.quant import Int4Linear, Q41Linear  # noqa: E402

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}
ROWS = (1, 4, 5, 8)
CONTEXT = 300


def best_us(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def kernels_alone() -> dict:
    rng = np.random.default_rng(0)
    out = {}
    for name, (n, k) in SHAPES.items():
        q = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
        d = rng.uniform(0.001, 0.02, size=(n, k // 32)).astype(np.float16).astype(np.float32)
        m = (-8 * d).astype(np.float32)
        lins = {"int4": Int4Linear(q, d, m), "q4_1": Q41Linear(q, d, m)}
        for r in ROWS:
            x = torch.randn(r, k).bfloat16()
            t = {kind: best_us(lambda: lin(x), 50) for kind, lin in lins.items()}
            out[f"{name} {n}x{k} rows={r}"] = {"int4_us": round(t["int4"], 1), "q4_1_us": round(t["q4_1"], 1),
                                               "speedup": round(t["int4"] / t["q4_1"], 2)}
            print(f"{name:>12} {n}x{k} rows={r}: int4 {t['int4']:.0f} us, q4_1 {t['q4_1']:.0f} us "
                  f"({t['int4'] / t['q4_1']:.2f}x)", flush=True)
    return out


def whole_forward() -> dict:
    from whiflash_core.loading import load_target
    from whiflash_core.machine import Formats

    models = {w: load_target(None, "bfloat16", formats=Formats("bfloat16", w, "bfloat16", 24, w))[0]
              for w in ("int4", "q4_1")}
    stack = models["q4_1"].layer_stack
    # q4_1 three ways: int4 (PyTorch's kernel and ops), q4_1 layer by layer (module calls between
    # the C kernels: the layer stack off), q4_1 as it runs (all layers in one C call, layer_stack.py)
    runs = {"int4": (models["int4"], None), "q4_1_modules": (models["q4_1"], None), "q4_1": (models["q4_1"], stack)}
    ids = torch.randint(0, 49152, (CONTEXT + max(ROWS),), generator=torch.Generator().manual_seed(0))
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for _ in range(3):
            for w, (model, layers) in runs.items():
                model.layer_stack = layers
                cache = model.new_cache(CONTEXT + max(ROWS))
                model(ids[:CONTEXT], cache, logits_from=CONTEXT - 1)
                for r in ROWS:
                    def step():
                        model(ids[CONTEXT:CONTEXT + r], cache)
                        cache.rollback(CONTEXT)
                    best[(w, r)] = min(best.get((w, r), float("inf")), best_us(step, 15))
    models["q4_1"].layer_stack = stack
    out = {}
    for r in ROWS:
        a, m, b = (best[(w, r)] / 1e3 for w in ("int4", "q4_1_modules", "q4_1"))
        out[f"rows={r}"] = {"int4_ms": round(a, 2), "q4_1_modules_ms": round(m, 2), "q4_1_ms": round(b, 2),
                            "speedup": round(a / b, 2)}
        print(f"forward rows={r}: int4 {a:.2f} ms, q4_1 layer by layer {m:.2f} ms, q4_1 {b:.2f} ms "
              f"({a / b:.2f}x int4)", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not q4_1_kernel.available():
        raise SystemExit("the Q4_1 kernel could not be built here (a C compiler and an x86-64 CPU with AVX2)")
    result = {"command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
              "machine": machine_info("bfloat16", args.threads), "git": git_info(),
              "kernel_isa": q4_1_kernel.isa(), "context": CONTEXT,
              "kernels_alone": kernels_alone(), "whole_forward": whole_forward()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
