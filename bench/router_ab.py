"""Two router MLPs against each other in one process: `whiflash` with router A, then B, per prompt;
and, with `--fixed`, single methods beside them (is the router's split of the rounds right?).

    .venv/bin/python bench/router_ab.py --b runs/router3 [--a models/smollm2-135m-instruct] \
        [--fixed none,eagle3,ngram] --workload ../shared/data/bench/spec_bench.jsonl --limit 3 \
        --threads 1 --out FILE

Why one process: two `whiflash bench` runs each time their own cost model at start-up, and a cost
table timed beside other work routes differently, so two runs differ by more than their routers.
Here one engine (one target, one set of drafters, one measured cost model) serves every prompt
twice, the learned policy reading router A's MLP, then B's (`Engine.router_mlp`, read when a
request starts), in the order A B B A for every second prompt so that a drift of the machine's
speed falls on both arms alike (after one untimed generation per arm: a process's first runs cold).
Without `--b` only router A runs. With `--b-retimed` arm B is router A's MLP with the cost model
timed again now (`costs.measure(use_cache=False)`; the cached verify and context tables are
rewritten): does the cached model route worse than a fresh one? With `--b-router-ms X` arm B is
router A's MLP with the router phase priced at X ms a round (the start-up model leaves it out:
CostModel.router stays 0 unless the model is adaptive): would pricing it route better? With
`--b-catch-up-share F`, arm B charges F of a drafter's pending catch-up to the round that picks
it instead of costs.CATCH_UP_SHARE (1: all of it, as before that share). Each
`--fixed` method is one more arm (that method every round, its full draft length; `eagle3:1`: a
draft length of 1), in the same rotation.

Reported per category and overall, per arm: tokens, acceptance length (tokens per round), rounds
by drafter, and tokens per second of the decode loop (prefill excluded) in wall time and in CPU
time of this thread (`time.thread_time`, torch on --threads threads: with one thread the CPU time
does not count what other processes on the machine take). The ratio B / A of each. Greedy; in
bf16 the two arms may decode different tokens (a different route is a different forward shape),
which the JSON counts as `identical` prompts.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core import costs  # noqa: E402
from whiflash_core.bench.cli import dump_json  # noqa: E402
from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.bench.runners import drafter_rounds  # noqa: E402
from whiflash_core.bench.workload import load_workload  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import SHIPPED_DRAFTERS, load_engine, load_router_mlp  # noqa: E402


def decode(engine, ids: list[int], max_tokens: int, alpha: float, method: str = "whiflash") -> dict:
    """One greedy generation (`whiflash` with the learned policy, or a fixed `method`, "METHOD:K"
    for a draft length K other than its default); the decode loop timed (wall and this thread's CPU)."""
    method, _, k = method.partition(":")
    spec = SpeculationConfig(method, alpha=alpha, policy="learned", num_draft_tokens=int(k) if k else None)
    g = engine.start(GenerationRequest(ids, max_tokens, speculation=spec))
    g.prefill()
    wall, cpu = time.perf_counter(), time.thread_time()
    while not g.finished and g.step() is not None:
        pass
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return {"tokens": list(g.output), "rounds": drafter_rounds(g.stats()), "wall_s": wall, "cpu_s": cpu}


def totals(runs: list[dict]) -> dict:
    tokens = sum(len(r["tokens"]) for r in runs)
    rounds: Counter = Counter()
    for r in runs:
        rounds.update(r["rounds"])
    n = sum(rounds.values())
    wall, cpu = sum(r["wall_s"] for r in runs), sum(r["cpu_s"] for r in runs)
    return {"tokens": tokens, "rounds": n, "acceptance_length": tokens / n if n else None,
            "tps_wall": tokens / wall if wall else None, "tps_cpu": tokens / cpu if cpu else None,
            "round_share": {k: v / n for k, v in sorted(rounds.items()) if v} if n else {}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", default=SHIPPED_DRAFTERS, help="directory of router A's router_mlp.safetensors")
    p.add_argument("--b", default=None, help="directory of router B's router_mlp.safetensors (none: A alone)")
    p.add_argument("--b-retimed", action="store_true",
                   help="arm b: router A's MLP with the cost model timed again now instead of the cached one")
    p.add_argument("--b-router-ms", type=float, default=None,
                   help="arm b: router A, the router phase priced at this many ms a round (0: left out)")
    p.add_argument("--b-catch-up-share", type=float, default=None,
                   help="arm b: router A, this share of a drafter's pending catch-up charged to its round")
    p.add_argument("--fixed", default="",
                   help="comma-separated single methods run beside (none, eagle3, ngram...; METHOD:K drafts K tokens)")
    p.add_argument("--drafters", default=None, help="drafter directory (default: the shipped drafters)")
    p.add_argument("--workload", default="../shared/data/bench/spec_bench.jsonl")
    p.add_argument("--limit", type=int, default=3, help="prompts per category")
    p.add_argument("--categories", help="comma-separated categories of the workload (default: all)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--alpha", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--weights", default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    engine = load_engine(None, args.drafters, "bfloat16", threads=args.threads, weights=args.weights)
    uses_of_b = [args.b is not None, args.b_retimed, args.b_router_ms is not None, args.b_catch_up_share is not None]
    if sum(uses_of_b) > 1:
        raise SystemExit("--b, --b-retimed, --b-router-ms and --b-catch-up-share are uses of arm b: give one")
    routers = {"a": args.a, **({"b": args.b or args.a} if any(uses_of_b) else {})}
    mlps = {arm: load_router_mlp(d, engine.target, engine.drafters) for arm, d in routers.items()}
    cost_models = {arm: engine.costs for arm in mlps}
    if args.b_retimed:
        cost_models["b"] = costs.measure(engine, use_cache=False)
        for arm, model in cost_models.items():
            print(f"arm {arm} verify table (ms):", {r: round(t * 1e3, 2) for r, t in model.verify.table.items()})
    if args.b_router_ms is not None:
        cost_models["b"] = dataclasses.replace(engine.costs, router=costs.RunningMean(args.b_router_ms * 1e-3, count=1))
        print(f"router phase priced at {engine.costs.router.value * 1e3:.3f} ms (a), {args.b_router_ms:.3f} ms (b)")
    if args.b_catch_up_share is not None:
        cost_models["b"] = dataclasses.replace(engine.costs, catch_up_share=args.b_catch_up_share)
        print(f"catch-up charged at {engine.costs.catch_up_share:g} (a), {args.b_catch_up_share:g} (b) of its time")
    for arm, mlp in mlps.items():
        if mlp is None:
            raise SystemExit(f"no router MLP for this target in {routers[arm]}")
    fixed = [m.strip() for m in args.fixed.split(",") if m.strip()]
    arms = [*mlps, *fixed]

    def run(arm: str, ids: list[int]) -> dict:
        if arm in mlps:
            engine.router_mlp, engine.costs = mlps[arm], cost_models[arm]
            return decode(engine, ids, args.max_tokens, args.alpha)
        return decode(engine, ids, args.max_tokens, args.alpha, method=arm)

    prompts = load_workload(args.workload, args.categories.split(",") if args.categories else None, args.limit)
    first = prompts[0].ids or encode_chat(engine.tokenizer, prompts[0].messages, prompts[0].tools)
    for arm in arms:   # warm-up, not counted: the first generation of a process runs cold
        run(arm, first)
    records = []
    for i, prompt in enumerate(prompts):
        ids = prompt.ids or encode_chat(engine.tokenizer, prompt.messages, prompt.tools)
        runs = {arm: run(arm, ids) for arm in (arms if i % 2 == 0 else arms[::-1])}   # A B B A: drift on all
        records.append({"category": prompt.category, "prompt_tokens": len(ids), "runs": runs})
        print(f"{i + 1}/{len(prompts)} {prompt.category:15s} " + "  ".join(
            f"{arm} {t['tps_cpu']:6.1f} al {t['acceptance_length']:.2f}"
            for arm, t in ((arm, totals([runs[arm]])) for arm in arms)), flush=True)

    summary = {}
    categories = list(dict.fromkeys(r["category"] for r in records))
    for cat in categories + ["all"]:
        group = [r for r in records if cat in ("all", r["category"])]
        s = {arm: totals([r["runs"][arm] for r in group]) for arm in arms}
        for arm in arms[1:]:   # every arm against router A
            s[f"{arm}_over_a"] = {k: s[arm][k] / s["a"][k] for k in ("acceptance_length", "tps_wall", "tps_cpu")
                                  if s["a"][k] and s[arm][k]}
        if "b" in s:
            s["identical"] = sum(r["runs"]["a"]["tokens"] == r["runs"]["b"]["tokens"] for r in group)
        s["prompts"] = len(group)
        summary[cat] = s

    print(f"\n{'category':15s} " + " ".join(f"{arm + ' tok/CPU-s':>16s} {'x A':>6s}" for arm in arms))
    for cat, s in summary.items():
        print(f"{cat:15s} " + " ".join(f"{s[arm]['tps_cpu']:16.1f} {s[arm]['tps_cpu'] / s['a']['tps_cpu']:6.3f}"
                                       for arm in arms))
    print(f"{'acc. length':15s} " + " ".join(f"{summary['all'][arm]['acceptance_length']:16.2f} {'':6s}" for arm in arms))
    for arm in arms:
        print(f"rounds {arm}:", {k: round(v, 3) for k, v in summary["all"][arm]["round_share"].items()})
    if args.out:
        write_result(args.out, "router_ab.py", argv, args, summary, records)
    return 0


def write_result(path: str, script: str, argv: list[str] | None, args: argparse.Namespace, summary: dict,
                 records: list[dict]) -> None:
    """The A/B run as JSON: its command line, time, commit, machine (lscpu flags), settings,
    per-category summary and every prompt's runs (also drafter_ab.py's)."""
    result = {"command": f"python bench/{script} " + " ".join(sys.argv[1:] if argv is None else argv),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_info(),
              "machine": machine_info("bfloat16", torch.get_num_threads()), "settings": vars(args),
              "summary": summary, "prompts": records}
    with open(path, "w") as f:
        f.write(dump_json(result))


if __name__ == "__main__":
    raise SystemExit(main())
