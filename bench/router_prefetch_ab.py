"""Does the commit's prefetch of the next round's router inputs (Router.prefetch) pay, in one process?

    .venv/bin/python bench/router_prefetch_ab.py [THREADS] [REPS] [--out FILE]

whiflash (`learned`) over Spec-Bench (one prompt a category, 128 tokens), each prompt decoded with
the prefetch on and off, in turns (the order alternates per repetition), so both sides run the same
rounds on the same machine minute. The prefetch is issued in the commit, which the bench charges to
the verify phase: what counts is the round's wall time, and the router phase beside it.
"""
import argparse
import json
import sys
import time

sys.path.insert(0, ".")
from whiflash_core import router  # noqa: E402
from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.bench.workload import load_workload  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("threads", type=int, nargs="?", default=2)
ap.add_argument("reps", type=int, nargs="?", default=4)
ap.add_argument("--out", default=None)
args = ap.parse_args()

engine = load_engine(None, None, "bfloat16", threads=args.threads, weights="auto")
prompts = load_workload("../shared/data/bench/spec_bench.jsonl", limit=1)
sides = {"prefetch": router.Router.prefetch, "none": lambda self, logits: None}
totals = {side: {"rounds": 0, "router_s": 0.0, "wall_s": 0.0, "tokens": 0} for side in sides}
for rep in range(args.reps):
    for p in prompts:
        ids = p.ids or encode_chat(engine.tokenizer, p.messages, p.tools)
        outputs = []
        for side in (list(sides) if rep % 2 == 0 else list(sides)[::-1]):
            router.Router.prefetch = sides[side]
            g = engine.start(GenerationRequest(ids, 128, speculation=SpeculationConfig("whiflash", policy="learned")))
            g.prefill()
            t, t0 = totals[side], time.perf_counter()
            while not g.finished:
                r = g.step()
                t["rounds"] += 1
                t["router_s"] += r.times.router
            t["wall_s"] += time.perf_counter() - t0
            t["tokens"] += len(g.output)
            outputs.append(list(g.output))
        assert outputs[0] == outputs[1]   # the same rounds, so the same tokens
router.Router.prefetch = sides["prefetch"]
summary = {side: {"rounds": t["rounds"], "router_us_per_round": round(1e6 * t["router_s"] / t["rounds"], 1),
                  "wall_ms_per_round": round(1e3 * t["wall_s"] / t["rounds"], 4),
                  "tokens_per_s": round(t["tokens"] / t["wall_s"], 1)} for side, t in totals.items()}
for side, s in summary.items():
    print(side, s)
if args.out:
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "git": git_info(), "machine": machine_info("bfloat16", args.threads),
                   "summary": summary}, f, indent=1)
