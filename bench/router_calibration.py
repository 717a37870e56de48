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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    engine = load_engine(None, None, "bfloat16", threads=args.threads, weights=args.weights)
    rows: list[tuple[str, int, float, float, int, float]] = []
    observe = router.Router.observe

    def logged(self, route, r):   # every round: (drafter, k, predicted g, t, actual tokens, seconds)
        rows.append((route.drafter or "plain", r.draft_len, route.expected_tokens or 1.0, route.expected_s or 0.0,
                     r.accepted + 1, r.times.total))
        return observe(self, route, r)

    router.Router.observe = logged
    for p in load_workload(args.workload, limit=args.limit):
        ids = p.ids or encode_chat(engine.tokenizer, p.messages, p.tools)
        g = engine.start(GenerationRequest(ids, args.max_tokens,
                                           speculation=SpeculationConfig("whiflash", policy=args.policy)))
        g.prefill()
        while not g.finished and g.step() is not None:
            pass

    sums: dict[tuple[str, int], list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for drafter, k, g_pred, t_pred, g_act, t_act in rows:
        s = sums[(drafter, k)]
        s[0] += 1
        s[1], s[2], s[3], s[4] = s[1] + g_pred, s[2] + g_act, s[3] + t_pred, s[4] + t_act
    table = []
    for (drafter, k), (n, gp, ga, tp, ta) in sorted(sums.items()):
        table.append({"drafter": drafter, "k": k, "rounds": int(n), "predicted_tokens": round(gp / n, 3),
                      "tokens": round(ga / n, 3), "predicted_ms": round(1e3 * tp / n, 3), "ms": round(1e3 * ta / n, 3),
                      "time_ratio": round(ta / tp, 3) if tp > 0 else None})
    print(f"{'route':12s} {'rounds':>6s} {'g pred':>7s} {'g':>6s} {'t pred':>7s} {'t':>7s} {'t/pred':>7s}")
    for row in table:
        print(f"{row['drafter'] + ' k=' + str(row['k']):12s} {row['rounds']:6d} {row['predicted_tokens']:7.2f} "
              f"{row['tokens']:6.2f} {row['predicted_ms']:7.2f} {row['ms']:7.2f} {row['time_ratio'] or 0:7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["python"] + sys.argv), "git": git_info(),
                       "machine": machine_info("bfloat16", args.threads), "formats": str(engine.target.formats),
                       "policy": args.policy, "rounds": len(rows), "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
