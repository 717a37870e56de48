"""The EAGLE-3 chain in one C call (layer_stack.EagleChain) against the step-by-step chain, in one process.

    .venv/bin/python bench/eagle_chain_ab.py --workload ../shared/data/bench/spec_bench.jsonl \
        --limit 3 --threads 1 --out bench/results/eagle_chain_ab_xeon.json

One engine (one target, one set of drafters, one start-up cost model) serves every prompt with each
arm: `none`, then `eagle3` and `whiflash` each with the chain in C ("c") and with it switched off
("py": Eagle3Drafter.propose_many's step-by-step path, PyTorch modules around the same C kernels),
in the order of the arms for even prompts and reversed for odd ones, so that a drift of the
machine's speed falls on all arms alike. Both chains give the same draft tokens (bit for bit,
tests/test_layer_stack.py), so each method emits the same tokens in both arms; the difference is
time. Greedy, 128 tokens, decode tokens/s (prefill excluded) per arm and category, ratios to `none`.
With `--compare catch-up` the "py" arms keep the chain in C and only move the KV-only catch-up of
verified pairs back to the module path (what `eagle_catch_up_bf16` alone gains).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.bench.workload import load_workload  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402

ARMS = [("none", "none", True), ("eagle3 py", "eagle3", False), ("eagle3 c", "eagle3", True),
        ("whiflash py", "whiflash", False), ("whiflash c", "whiflash", True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--limit", type=int, default=3, help="prompts per category")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--compare", choices=["chain", "catch-up"], default="chain",
                    help="what the py arms run step by step: the whole drafter call, or only its catch-up")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    engine = load_engine(None, None, "bfloat16", threads=args.threads, weights="auto")
    eagle = engine.drafters["eagle3"]
    chain = eagle._chain()
    if chain is None:
        sys.exit("the EAGLE-3 chain does not run in C here (not the q4_1 format, or no C compiler)")
    catch_up_rows = chain.catch_up_rows
    prompts = load_workload(args.workload, limit=args.limit)
    totals = collections.defaultdict(lambda: [0, 0.0, 0])          # arm -> tokens, seconds, rounds
    by_category = collections.defaultdict(lambda: [0, 0.0])         # (category, arm) -> tokens, seconds
    outputs: dict[str, list[list[int]]] = collections.defaultdict(list)
    for i, p in enumerate(prompts):
        ids = p.ids or encode_chat(engine.tokenizer, p.messages, p.tools)
        for name, method, in_c in (ARMS if i % 2 == 0 else ARMS[::-1]):
            eagle.__dict__["_chain_c"] = chain if in_c or args.compare == "catch-up" else None
            chain.catch_up_rows = catch_up_rows if in_c or args.compare == "chain" else 0
            g = engine.start(GenerationRequest(ids, args.max_tokens, speculation=SpeculationConfig(method)))
            g.prefill()
            t0 = time.perf_counter()
            while not g.finished and g.step() is not None:
                pass
            seconds = time.perf_counter() - t0
            t = totals[name]
            t[0], t[1], t[2] = t[0] + len(g.output), t[1] + seconds, t[2] + g.rounds
            c = by_category[(p.category, name)]
            c[0], c[1] = c[0] + len(g.output), c[1] + seconds
            outputs[name].append(list(g.output))
    eagle.__dict__["_chain_c"], chain.catch_up_rows = chain, catch_up_rows
    base = totals["none"][0] / totals["none"][1]
    summary = {name: {"tokens": n, "decode_s": round(s, 3), "tokens_per_s": round(n / s, 2),
                      "ratio_to_none": round(n / s / base, 3), "acceptance_length": round(n / r, 3)}
               for name, (n, s, r) in totals.items()}
    same = {m: sum(a == b for a, b in zip(outputs[f"{m} py"], outputs[f"{m} c"])) for m in ("eagle3", "whiflash")}
    for name, row in summary.items():
        print(f"{name:12s} {row['tokens_per_s']:7.1f} tok/s {row['ratio_to_none']:.3f}x  acc {row['acceptance_length']:.2f}")
    print("identical outputs py vs c:", {m: f"{k}/{len(prompts)}" for m, k in same.items()})
    categories = sorted({c for c, _ in by_category})
    table = {c: {name: round(by_category[(c, name)][0] / by_category[(c, name)][1], 1) for name, _, _ in ARMS}
             for c in categories}
    for c, row in table.items():
        print(f"  {c:16s}", row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python"] + sys.argv), "git": git_info(),
                       "machine": machine_info("bfloat16", args.threads), "formats": str(engine.target.formats),
                       "compare": args.compare, "prompts": len(prompts), "summary": summary, "identical_outputs": same,
                       "tokens_per_s_by_category": table}, f, indent=1)


if __name__ == "__main__":
    main()
