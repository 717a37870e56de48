"""What AMX tiles change in a target forward (whiflash_core/tiles.py): time and agreement.

    .venv/bin/python bench/tiles_probe.py --threads 2 --out bench/results/tiles_probe_bf16_xeon.json

Times the embedded target's forward (logits for every row, as a verify or a shared step runs it)
of 1..64 new rows after 256 and 1,024 cached positions, with the tiles off, with the settings
`tiles.choose` picks on this machine, and with those but the bf16 matmul tiles off ("integer"),
interleaved rep by rep in one process (the median of each).
Then a cold prompt's prefill each way (best of --prefill-reps), and the agreement: the same real
text's forwards with the tiles off and as chosen, per row whether the argmax
is the same and how far the logits moved. Tiles change the attention's rounding (bf16 products
summed in the tile unit's order) and, from bf16_from_rows, the linears' (bf16 weights and x instead
of int8 x), so a near tie can go the other way: reported, not asserted.
On a CPU without AMX the three are the same path (and the file says tiles: off).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core import tiles  # noqa: E402
from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402

TEXT = ("An agent loop sends the whole conversation again on every turn: the system prompt, the tool "
        "schemas, every earlier turn and tool result, then asks for a few dozen tokens. ") * 40


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 48, 64])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--prefill", type=int, default=0,
                    help="also time a cold prefill of this many tokens each way (0: not); from the format "
                         "timing's prefill_from_rows on (128 on an AMX Xeon) a prompt runs in the dense twin, "
                         "where the Q4_1 tiles do not apply: a control")
    ap.add_argument("--prefill-reps", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    engine = load_engine(None, None, "bfloat16", threads=args.threads, weights="auto", measure_costs=False)
    torch.set_num_threads(args.threads)
    target, chosen = engine.target, tiles.current()
    off = tiles.TileSettings()
    integer = dataclasses.replace(chosen, bf16_from_rows=0)
    ways = (("off", off), ("integer", integer), ("tiles", chosen))
    print("tiles chosen:", chosen, flush=True)
    gen = torch.Generator().manual_seed(0)

    timings = []
    for context in args.contexts:
        cache = target.new_cache(context + max(args.rows) + 1)
        target(torch.randint(100, 20000, (context,), generator=gen), cache)
        for rows in args.rows:
            x = torch.randint(100, 20000, (rows,), generator=gen)
            times = {name: [] for name, _ in ways}
            for _ in range(args.reps):
                for name, settings in ways:
                    tiles.apply(settings)
                    t0 = time.perf_counter()
                    target(x, cache)
                    times[name].append(time.perf_counter() - t0)
                    cache.rollback(context)
            row = {"context": context, "rows": rows,
                   **{f"{k}_ms": round(1e3 * statistics.median(v), 3) for k, v in times.items()}}
            row["speedup"] = round(row["off_ms"] / row["tiles_ms"], 3)
            row["speedup_over_integer"] = round(row["integer_ms"] / row["tiles_ms"], 3)
            timings.append(row)
            print(json.dumps(row), flush=True)

    # a cold prompt's prefill (time to first token of a new conversation): 64-row stack calls
    prefill = []
    if args.prefill:
        ids = torch.randint(100, 20000, (args.prefill,), generator=gen)
        times = {name: [] for name, _ in ways}
        for _ in range(args.prefill_reps):
            for name, settings in ways:
                tiles.apply(settings)
                cache = target.new_cache(args.prefill + 1)
                t0 = time.perf_counter()
                target(ids, cache, logits_from=args.prefill - 1)
                times[name].append(time.perf_counter() - t0)
        prefill.append({"tokens": args.prefill, **{f"{k}_s": round(min(v), 3) for k, v in times.items()},
                        "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()}})
        print(json.dumps(prefill[-1]), flush=True)

    # agreement: a real text's positions, verified in chunks of `rows` after a cached prefix
    ids = torch.tensor(engine.tokenizer(TEXT)["input_ids"][:1100])
    agreement = []
    for rows in args.rows:
        same = total = 0
        max_diff = 0.0
        for start in range(64, len(ids) - rows, 97):
            outs = []
            for settings in (off, chosen):
                tiles.apply(settings)
                cache = target.new_cache(start + rows)
                target(ids[:start], cache)
                outs.append(target(ids[start:start + rows], cache).logits)
            same += int((outs[0].argmax(-1) == outs[1].argmax(-1)).sum())
            total += rows
            max_diff = max(max_diff, float((outs[0] - outs[1]).abs().max()))
        agreement.append({"rows": rows, "positions": total, "argmax_agreement": round(same / total, 4),
                          "max_abs_logit_diff": round(max_diff, 3)})
        print(json.dumps(agreement[-1]), flush=True)
    tiles.apply(chosen)

    report = {"command": " ".join(["python"] + sys.argv), "git": git_info(),
              "machine": machine_info("bfloat16", args.threads), "formats": str(target.formats),
              "tiles": {"chosen": chosen.__dict__, "timings_at_load": getattr(target, "tile_timings", None)},
              "reps": args.reps, "forward_ms": timings, "prefill_best_of": args.prefill_reps, "prefill": prefill,
              "agreement": agreement}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
