"""Does torch.compile pay for the target forward on this machine? Eager vs compiled, one run.

    .venv/bin/python bench/compile_probe.py --formats dense,int4 --out bench/results/compile_probe.json

For each weight format: the decoder stack (`TargetModel.run_layers`, everything but the embedding
lookup and the LM head) is compiled with inductor, one static-shape graph per row count k, with
inductor's Python wrapper (`default`) or its C++ wrapper (`cpp_wrapper`, `--modes`), which takes
the per-kernel Python dispatch out of the compiled graph.
Reported per k: compile time (first call), median forward ms eager and compiled on a 300-token
cache, and the compiled logits' largest difference from eager and whether their argmax agrees.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.loading import load_target  # noqa: E402

KS = (1, 4)
TAPS = (2, 15, 27)
CTX = 300


def median_ms(model, cache, k: int, repeats: int, g: torch.Generator) -> float:
    ts = []
    for _ in range(repeats + 3):
        tokens = torch.randint(0, 49152, (k,), generator=g)
        t0 = time.perf_counter()
        model(tokens, cache, taps=TAPS)
        ts.append(time.perf_counter() - t0)
        cache.rollback(CTX)
    return statistics.median(ts[3:]) * 1000


def probe(fmt: str, repeats: int, mode: str) -> dict:
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    inductor_config.cpp_wrapper = mode == "cpp_wrapper"
    model, _ = load_target(None, "bfloat16", fmt)
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(CTX + 64)
    model(torch.randint(0, 49152, (CTX,), generator=g), cache)
    probes = {k: torch.randint(0, 49152, (k,), generator=g) for k in KS}
    eager_logits = {}
    for k in KS:
        eager_logits[k] = model(probes[k], cache, taps=TAPS).logits
        cache.rollback(CTX)
    eager = {k: median_ms(model, cache, k, repeats, g) for k in KS}
    eager_run_layers = model.run_layers
    # Every timed call runs at the same cache position, so each row count compiles once with
    # static shapes: the most favourable case for the compiler.
    model.run_layers = torch.compile(eager_run_layers)
    rows = []
    for k in KS:
        t0 = time.perf_counter()
        logits = model(probes[k], cache, taps=TAPS).logits
        cache.rollback(CTX)
        compile_s = time.perf_counter() - t0
        compiled = median_ms(model, cache, k, repeats, g)
        rows.append({"k": k, "eager_ms": round(eager[k], 3), "compiled_ms": round(compiled, 3),
                     "compile_s": round(compile_s, 1),
                     "max_logit_diff": float((logits - eager_logits[k]).abs().max()),
                     "same_argmax": bool((logits.argmax(-1) == eager_logits[k].argmax(-1)).all())})
        print(fmt, mode, rows[-1], flush=True)
    model.run_layers = eager_run_layers
    return {"format": fmt, "mode": mode, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="dense,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--modes", default="default,cpp_wrapper", help="inductor wrappers to try: default, cpp_wrapper")
    ap.add_argument("--out", default="bench/results/compile_probe.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = [probe(f, args.repeats, m) for f in args.formats.split(",") for m in args.modes.split(",")]
    out = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "machine": machine_info("bfloat16", args.threads),
           "git": git_info(), "torch": torch.__version__, "context_tokens": CTX, "results": results}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
