"""Two versions of a drafter against each other in one process: does a new one pay in tokens/s?

    .venv/bin/python bench/drafter_ab.py --b /tmp/cand [--a models/smollm2-135m-instruct] \
        [--name eagle3] [--methods eagle3,whiflash] [--b-format int8] --limit 2 --threads 1 --out FILE

`--b-format` loads B's drafter with other weights beside a q4_1 target than it is served with
(Drafter.q4_1_weights: "q4_1" or "int8"); with `--b` the same directory as A, it compares formats.

Acceptance alone does not say it: a wider head or a deeper drafter accepts more and drafts
slower. One engine (one target, one measured cost model) decodes every prompt with drafter
`--name` from directory A, then from B (swapped in `Engine.drafters`), A B B A, for each method
in `--methods`; reported per category: tokens per CPU-second of the decode loop (as router_ab.py),
acceptance length and the ratio B / A. A `whiflash` arm routes with the cost model timed on A
(it keeps learning from the observed rounds, across both arms), so the single-drafter method is
the clean comparison.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from router_ab import decode, totals, write_result  # noqa: E402

from whiflash_core.bench.workload import load_workload  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.loading import DRAFTER_KINDS, SHIPPED_DRAFTERS, load_engine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", default=SHIPPED_DRAFTERS, help="drafter directory A")
    p.add_argument("--b", required=True, help="drafter directory B")
    p.add_argument("--name", default="eagle3", help="the drafter kind compared")
    p.add_argument("--methods", default="eagle3", help="comma-separated methods to decode with")
    p.add_argument("--workload", default="../shared/data/bench/spec_bench.jsonl")
    p.add_argument("--limit", type=int, default=2, help="prompts per category")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--weights", default="auto")
    p.add_argument("--b-format", choices=("q4_1", "int8"), default=None,
                   help="B's drafter weights beside a q4_1 target (default: as served)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    engine = load_engine(None, args.a, "bfloat16", threads=args.threads, weights=args.weights)
    if args.b_format:   # load_engine reads the class attribute when it quantizes the drafter
        DRAFTER_KINDS[args.name].q4_1_weights = args.b_format
    other = load_engine(None, args.b, "bfloat16", threads=args.threads, weights=args.weights, measure_costs=False)
    versions = {"a": engine.drafters[args.name], "b": other.drafters[args.name]}   # each quantized as served
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    arms = [(v, m) for m in methods for v in ("a", "b")]

    def run(arm: tuple[str, str], ids: list[int]) -> dict:
        engine.drafters[args.name] = versions[arm[0]]
        return decode(engine, ids, args.max_tokens, 1.0, method=arm[1])

    prompts = load_workload(args.workload, limit=args.limit)
    first = prompts[0].ids or encode_chat(engine.tokenizer, prompts[0].messages, prompts[0].tools)
    for arm in arms:   # warm-up, not counted
        run(arm, first)
    records = []
    for i, prompt in enumerate(prompts):
        ids = prompt.ids or encode_chat(engine.tokenizer, prompt.messages, prompt.tools)
        runs = {f"{v}/{m}": run((v, m), ids) for v, m in (arms if i % 2 == 0 else arms[::-1])}
        records.append({"category": prompt.category, "prompt_tokens": len(ids), "runs": runs})
        print(f"{i + 1}/{len(prompts)} {prompt.category:15s} " + "  ".join(
            f"{k} {t['tps_cpu']:6.1f} al {t['acceptance_length']:.2f}" for k, t in
            ((k, totals([r])) for k, r in runs.items())), flush=True)

    summary = {}
    for cat in list(dict.fromkeys(r["category"] for r in records)) + ["all"]:
        group = [r for r in records if cat in ("all", r["category"])]
        s = {k: totals([r["runs"][k] for r in group]) for k in group[0]["runs"]}
        for m in methods:
            s[f"b_over_a/{m}"] = {k: s[f"b/{m}"][k] / s[f"a/{m}"][k] for k in ("acceptance_length", "tps_cpu")}
        summary[cat] = s
    print(f"\n{'category':15s} " + " ".join(f"{'A ' + m:>16s} {'B ' + m:>16s} {'B/A':>6s} {'al A':>5s} {'al B':>5s}"
                                           for m in methods))
    for cat, s in summary.items():
        print(f"{cat:15s} " + " ".join(
            f"{s[f'a/{m}']['tps_cpu']:16.1f} {s[f'b/{m}']['tps_cpu']:16.1f} {s[f'b_over_a/{m}']['tps_cpu']:6.3f} "
            f"{s[f'a/{m}']['acceptance_length']:5.2f} {s[f'b/{m}']['acceptance_length']:5.2f}" for m in methods))
    if args.out:
        write_result(args.out, "drafter_ab.py", argv, args, summary, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
