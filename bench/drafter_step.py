"""Drafter cost per proposal, measured through the drafters' own `propose` (what the engine calls).

    .venv/bin/python bench/drafter_step.py --threads 2 [--weights int4] [--drafters DIR] [--out FILE]

EAGLE-3: a chain of k drafts is one full-layer step on the newest verified pair plus k-1 chain
steps, each with a head evaluation; the per-step cost is the slope of time over k. DFlash: one
block forward whatever the block size. Both read a 300-token context's taps from a real target
forward, so shapes and cache lengths are those of serving.
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
from whiflash_core.drafters.base import Context, DraftSampling  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402


def time_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1000 * statistics.median(samples)


def drafter_costs(engine, context: int, repeats: int) -> dict:
    """Propose timings of the engine's drafters on a `context`-token context."""
    target = engine.target
    ids = torch.randint(100, 20000, (context + 1,), generator=torch.Generator().manual_seed(0))
    taps = sorted({t for d in engine.drafters.values() for t in d.tap_layers})
    with torch.inference_mode():
        out = target(ids[:-1], target.new_cache(context + 64), taps=tuple(taps))
    ctx = Context(ids, context, out.taps, tuple(taps))
    greedy = DraftSampling()
    results: dict = {}

    eagle = engine.drafters.get("eagle3")
    if eagle is not None:
        state = eagle.new_state(context + 64)
        eagle.propose(state, ctx, 1, greedy)  # full catch-up once; each timed call then redoes one pair
        per_k = {}
        for k in (1, 2, 4, 6, 8):
            def run(k=k):
                state.n_seen = state.cache.length = context - 1
                eagle.propose(state, ctx, k, greedy)
            per_k[k] = time_ms(run, repeats)
        slope = (per_k[8] - per_k[2]) / 6
        results["eagle3"] = {"propose_ms_by_k": {str(k): round(v, 3) for k, v in per_k.items()},
                             "chain_step_ms": round(slope, 3), "first_step_ms": round(per_k[1], 3)}

    dflash = engine.drafters.get("dflash")
    if dflash is not None:
        state = dflash.new_state(context + 64)
        dflash.propose(state, ctx, dflash.max_draft_tokens, greedy)

        def run_block():
            state.n_seen = context - 1
            dflash.propose(state, ctx, dflash.max_draft_tokens, greedy)
        results["dflash"] = {"block_size": dflash.cfg.block_size, "propose_ms": round(time_ms(run_block, repeats), 3)}

    return results


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--drafters", default=None, help="drafter directory (default: the shipped drafters)")
    p.add_argument("--weights", default="dense,int4", help="target formats to measure (light targets get int8 drafters)")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    results: dict = {}
    for weights in args.weights.split(","):
        engine = load_engine(drafters=args.drafters, dtype="bfloat16", threads=args.threads, weights=weights)
        results[weights] = drafter_costs(engine, args.context, args.repeats)
        print(weights, json.dumps(results[weights]), flush=True)

    report = {"command": "python bench/drafter_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine_info("bfloat16", args.threads), "git": git_info(),
              "context": args.context, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
