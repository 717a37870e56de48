"""The embedded target's forward on this tree's Q4_1 kernel against another kernel source, in one
process, arms alternating: what a kernel change does to a decode step and a verify, with the
weights coming from memory and every other op of the forward around it.

    git show 7376fb5:whiflash_core/kernels/q4_1.c > /tmp/base_q4_1.c
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python bench/q4_1_forward_ab.py --other /tmp/base_q4_1.c --threads 2 --out FILE

bench/q4_1_kernel_ab.sh times the kernel alone in separate processes; between processes this VM
drifts by more than a kernel change is worth, so here both builds live in one process: the target
is loaded twice, once packed for (and multiplying with) each build, and before each arm's forwards
the layer stack (kernels/layers.c) is pointed at that arm's q4_1_matmul. Weights: q4_1 with a q4_1
LM head (the format `auto` picks on both classes here), activations bf16. Per rows count, each
round times `--reps` forwards of each arm over `--context` cached positions (wall clock), order
alternating between rounds; the median round per arm is reported, and the ratio other / this.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core import decode_ops, layer_stack, q4_1_kernel  # noqa: E402
from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402


def load_with(source: Path, threads: int):
    """(target, kernel library, layer-stack library) with q4_1 weights packed for `source`'s build."""
    q4_1_kernel.SOURCE = source
    q4_1_kernel._library.cache_clear()
    layer_stack._library.cache_clear()
    engine = load_engine(None, None, "bfloat16", threads=threads, weights="q4_1", measure_costs=False)
    return engine.target, q4_1_kernel._library(), layer_stack._library()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="the other kernels/q4_1.c")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=50, help="forwards per arm per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    this_source = q4_1_kernel.SOURCE
    arms = {"other": load_with(Path(args.other).resolve(), args.threads), "this": load_with(this_source, args.threads)}
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 1000, (args.context,), generator=gen)

    def use(arm: str):
        target, kernels, stack = arms[arm]
        q4_1_kernel._library = lambda: kernels   # the Python-side calls (the LM head, lone linears)
        layer_stack.bind(stack, kernels, decode_ops._library())
        return target

    caches = {}
    for arm in arms:
        target = use(arm)
        caches[arm] = target.new_cache(args.context + max(args.rows) + 1)
        target(prompt, caches[arm])

    results = {}
    for rows in args.rows:
        x = torch.randint(100, 1000, (rows,), generator=gen)
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        outputs = {}
        for r in range(args.rounds + 1):   # round 0 warms up, not counted
            for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                target, cache = use(arm), caches[arm]
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    out = target(x, cache)
                    cache.rollback(args.context)
                if r:
                    times[arm].append((time.perf_counter() - t0) / args.reps * 1e3)
                outputs[arm] = out.logits.float().argmax(-1).tolist()
        row = {arm: round(statistics.median(t), 3) for arm, t in times.items()}
        row["other_over_this"] = round(row["other"] / row["this"], 3)
        row["same_argmax"] = outputs["other"] == outputs["this"]
        results[rows] = row
        print(f"{rows} rows: other {row['other']:.3f} ms, this {row['this']:.3f} ms "
              f"({row['other_over_this']:.3f}x), argmax {'same' if row['same_argmax'] else 'differs'}", flush=True)

    if args.out:
        report = {"command": " ".join(["python"] + sys.argv), "git": git_info(),
                  "machine": machine_info("bfloat16", args.threads), "other": args.other,
                  "context": args.context, "reps": args.reps, "rounds": args.rounds, "ms_per_forward": results}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
