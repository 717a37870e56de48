"""Does the router's model of a round match the round? Predicted against actual, per (drafter, k).

    .venv/bin/python bench/router_calibration.py --workload ../shared/data/bench/spec_bench.jsonl \
        --limit 3 --threads 1 --out bench/results/router_calibration_xeon.json

The cost and learned policies pick argmax g / t ** alpha over (drafter, k) (router.py). Each
chosen route carries the g and t it was picked for (Route.expected_tokens, .expected_s); this runs
`whiflash` over the workload (greedy, 128 tokens, one engine and its start-up cost model) and
sets them beside what the round then did: tokens it decided (accepted + 1) and its time
(RoundTimes.total: router, catch-up, draft, verify). Per (drafter, k): rounds, mean predicted and
actual tokens and milliseconds, and actual / predicted time. A router whose costs are right has
the same time ratio for every route (a machine slower or faster than at start-up moves them all
alike); a route whose ratio is above the plain step's costs more, relative to a plain step, than
the router believes, and is picked more often than it pays.

`--alphas 1,0.75`: each prompt at every alpha in turn (the order alternating, as `whiflash bench
--alpha-sweep` runs them), a table per alpha and its tokens per second of round time.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core import router  # noqa: E402
from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.bench.workload import load_workload  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--limit", type=int, default=3, help="prompts per category")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--policy", default="learned")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--alphas", default="1", help="comma-separated alphas, each prompt at every one in turn")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    engine = load_engine(None, None, "bfloat16", threads=args.threads, weights=args.weights)
    alphas = [float(a) for a in args.alphas.split(",")]
    rows: dict[float, list[tuple[str, int, float, float, int, float]]] = {a: [] for a in alphas}
    observe = router.Router.observe

    def logged(self, route, r):   # every round: (drafter, k, predicted g, t, actual tokens, seconds)
        rows[self.alpha].append((route.drafter or "plain", r.draft_len, route.expected_tokens or 1.0,
                            route.expected_s or 0.0, r.accepted + 1, r.times.total))
        return observe(self, route, r)

    router.Router.observe = logged
    for i, p in enumerate(load_workload(args.workload, limit=args.limit)):
        ids = p.ids or encode_chat(engine.tokenizer, p.messages, p.tools)
        for alpha in (alphas if i % 2 == 0 else alphas[::-1]):
            g = engine.start(GenerationRequest(ids, args.max_tokens, speculation=SpeculationConfig(
                "whiflash", policy=args.policy, alpha=alpha)))
            g.prefill()
            while not g.finished and g.step() is not None:
                pass

    runs = [{"alpha": a, "rounds": len(rows[a]), "table": table_of(rows[a]),
             "tokens_per_s": round(sum(r[4] for r in rows[a]) / sum(r[5] for r in rows[a]), 1)} for a in alphas]
    for run in runs:
        print(f"alpha {run['alpha']}: {run['tokens_per_s']} tokens/s of round time")
        print(f"{'route':12s} {'rounds':>6s} {'g pred':>7s} {'g':>6s} {'t pred':>7s} {'t':>7s} {'t/pred':>7s}")
        for row in run["table"]:
            print(f"{row['drafter'] + ' k=' + str(row['k']):12s} {row['rounds']:6d} {row['predicted_tokens']:7.2f} "
                  f"{row['tokens']:6.2f} {row['predicted_ms']:7.2f} {row['ms']:7.2f} {row['time_ratio'] or 0:7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python"] + sys.argv), "git": git_info(),
                       "machine": machine_info("bfloat16", args.threads), "formats": str(engine.target.formats),
                       "policy": args.policy, "runs": runs}, f, indent=1)


def table_of(rows: list[tuple[str, int, float, float, int, float]]) -> list[dict]:
    """Per (drafter, k): rounds, mean predicted and actual tokens and milliseconds, their time ratio."""
    sums: dict[tuple[str, int], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for drafter, k, g_pred, t_pred, g_act, t_act in rows:
        s = sums[(drafter, k)]
        s[0] += 1
        s[1], s[2], s[3], s[4] = s[1] + g_pred, s[2] + g_act, s[3] + t_pred, s[4] + t_act
    return [{"drafter": drafter, "k": k, "rounds": int(n), "predicted_tokens": round(gp / n, 3),
             "tokens": round(ga / n, 3), "predicted_ms": round(1e3 * tp / n, 3), "ms": round(1e3 * ta / n, 3),
             "time_ratio": round(ta / tp, 3) if tp > 0 else None}
            for (drafter, k), (n, gp, ga, tp, ta) in sorted(sums.items())]

if __name__ == "__main__":
    main()
