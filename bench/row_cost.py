"""What a target forward costs by rows, requests and context: the bound on sharing verify forwards.

    .venv/bin/python bench/row_cost.py --threads 1 --contexts 64 1024 --out bench/results/row_cost_native.json

Sharing one forward between N requests (Engine.step_many) saves what their rows have in common,
reading the weights once; what every row adds (its share of the int4 matmuls, the LM head, its
attention over its own cache) is paid N times. This times, in CPU time of this thread (other
processes on the machine do not count), the embedded target's forward for:
    one request of 1, 2, 4, 8 rows            (a decode step; verifies of k = 1, 3, 7)
    2, 4, 8 requests of 1 row each             (N plain streams sharing a forward)
    8 requests of 2 rows each                  (N streams each verifying one drafted token)
at each cached context length, in the format `auto` picks on this machine. From these, the ideal
gain of N plain streams sharing a forward over one plain stream is N * T(1 row) / T(N requests),
and `bench/shared_step.py` compares them against one speculating stream.
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
from whiflash_core.loading import load_engine  # noqa: E402


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return round(1000 * statistics.median(times), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 1024], help="cached positions per request")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    engine = load_engine(None, None, "bfloat16", threads=args.threads, weights=args.weights, measure_costs=False)
    torch.set_num_threads(args.threads)
    target = engine.target
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> torch.Tensor:   # arbitrary ids: the cost does not depend on them
        return torch.randint(100, 1000, (n,), generator=gen)

    results = []
    for context in args.contexts:
        caches = []
        for _ in range(8):
            cache = target.new_cache(context + 16)
            target(tokens(context), cache)
            caches.append(cache)

        def alone(rows: int):
            x = tokens(rows)

            def step():
                target(x, caches[0])
                caches[0].rollback(context)
            return step

        def shared(requests: int, rows: int):
            xs = [tokens(rows) for _ in range(requests)]

            def step():
                target.forward_many(xs, caches[:requests])
                for cache in caches[:requests]:
                    cache.rollback(context)
            return step

        alone(1)()   # warm-up
        row = {"context": context,
               "one_request_ms_by_rows": {r: median_ms(alone(r), args.reps) for r in (1, 2, 4, 8)},
               "requests_of_1_row_ms": {n: median_ms(shared(n, 1), args.reps) for n in (2, 4, 8)},
               "requests_of_2_rows_ms": {8: median_ms(shared(8, 2), args.reps)}}
        one = row["one_request_ms_by_rows"][1]
        row["ideal_plain_gain_8_streams"] = round(8 * one / row["requests_of_1_row_ms"][8], 3)
        results.append(row)
        print(json.dumps(row), flush=True)

    report = {"command": " ".join(["python"] + sys.argv), "git": git_info(),
              "machine": machine_info("bfloat16", args.threads), "formats": str(target.formats),
              "reps": args.reps, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
