"""DFlash alone with Q4_1 against int8 drafter weights beside the q4_1 target, in one process.

    .venv/bin/python bench/dflash_weights_ab.py [--limit 1] [--threads 1] [--out FILE]

Two engines share nothing but the process: one loads the DFlash drafter with Q4_1 weights (the C
matmul, today's default), the other with PyTorch's int8 weight-only linears (the default before).
Spec-Bench prompts, 128 tokens, greedy; the arms alternate which goes first prompt by prompt, so
drift of the machine falls on both. Prints and writes tokens/s, acceptance and the drafter's
milliseconds a round (drafting + catch-up). Force the AVX2 kernels with ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 (the machine info records the capability).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.bench.workload import load_workload  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.drafters.dflash import DFlashDrafter  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402

FORMATS = ("q4_1", "int8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="../shared/data/bench/spec_bench.jsonl")
    ap.add_argument("--limit", type=int, default=1, help="prompts a category")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    engines = {}
    for fmt in FORMATS:   # loading.load_engine reads the class attribute when it quantizes the drafter
        DFlashDrafter.q4_1_weights = fmt
        engines[fmt] = load_engine(None, None, "bfloat16", threads=args.threads, weights="auto", measure_costs=False)
    prompts = load_workload(args.workload, limit=args.limit)
    totals = {fmt: {"seconds": 0.0, "tokens": 0, "rounds": 0, "drafter_s": 0.0} for fmt in FORMATS}
    for i, p in enumerate(prompts):
        for fmt in (FORMATS if i % 2 == 0 else FORMATS[::-1]):
            engine, t = engines[fmt], totals[fmt]
            ids = p.ids or encode_chat(engine.tokenizer, p.messages, p.tools)
            g = engine.start(GenerationRequest(ids, args.max_tokens, speculation=SpeculationConfig("dflash")))
            g.prefill()
            t0 = time.perf_counter()
            while not g.finished:
                r = g.step()
                if r is None:
                    break
                t["rounds"] += 1
                t["drafter_s"] += r.times.draft + r.times.catch_up
            t["seconds"] += time.perf_counter() - t0
            t["tokens"] += len(g.output)
    arms = {}
    for fmt, t in totals.items():
        arms[fmt] = {"tokens": t["tokens"], "tokens_per_s": round(t["tokens"] / t["seconds"], 2),
                     "acceptance_length": round(t["tokens"] / t["rounds"], 3),
                     "drafter_ms_per_round": round(1000 * t["drafter_s"] / t["rounds"], 3)}
        print(fmt, json.dumps(arms[fmt]))
    report = {"command": " ".join(["python"] + sys.argv), "git": git_info(),
              "machine": machine_info("bfloat16", args.threads), "prompts": len(prompts), "arms": arms,
              "q4_1_over_int8": round(arms["q4_1"]["tokens_per_s"] / arms["int8"]["tokens_per_s"], 3)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
