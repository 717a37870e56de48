"""What the router expected of each kind of round and what it got, in-run.

    .venv/bin/python bench/round_value.py [--limit 2] [--alphas 1,0.75] [--policy learned] [--threads 2] [--out FILE]

whiflash over Spec-Bench (`--limit` prompts a category, 128 tokens) at each alpha, in one process,
each prompt at every alpha in turn (the order alternating), as `whiflash bench --alpha-sweep` runs.
Per (drafter, k) chosen: rounds, the emitted tokens a round against the router's expected g, the
round's wall time against its expected t, and tokens per millisecond. The router picks by g / t **
alpha, so where g or t is off for some kind of round the pick is off too: a kind whose realised
tokens exceed its expected g is drafted too rarely, one whose g is expected too high (the kind
picked when its prediction was the highest of the round: the winner's curse) too often.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.bench.workload import load_workload  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402


def decode(engine, ids, policy: str, alpha: float, kinds: dict) -> None:
    """One whiflash decode of `ids` at `alpha`, its rounds added to `kinds` by (drafter, k)."""
    g = engine.start(GenerationRequest(ids, 128, speculation=SpeculationConfig("whiflash", policy=policy, alpha=alpha)))
    g.prefill()
    routes = []
    take = g.router.take
    g.router.take = lambda c, states, ctx: routes.append(take(c, states, ctx)) or routes[-1]
    while not g.finished:
        r = g.step()
        route, kind = routes[-1], kinds[f"{r.drafter or 'plain'} k={r.draft_len}"]
        kind["rounds"] += 1
        kind["tokens"] += r.accepted + 1
        kind["seconds"] += r.times.total
        kind["g"] += route.expected_tokens or 1.0
        kind["t"] += route.expected_s or 0.0


def summary(alpha: float, kinds: dict) -> dict:
    out = {}
    for name, k in sorted(kinds.items(), key=lambda kv: -kv[1]["rounds"]):
        n = k["rounds"]
        out[name] = {"rounds": n, "tokens_per_round": round(k["tokens"] / n, 3), "expected_g": round(k["g"] / n, 3),
                     "ms_per_round": round(1e3 * k["seconds"] / n, 3), "expected_ms": round(1e3 * k["t"] / n, 3),
                     "tokens_per_ms": round(k["tokens"] / k["seconds"] / 1e3, 4)}
    tokens, seconds = sum(k["tokens"] for k in kinds.values()), sum(k["seconds"] for k in kinds.values())
    return {"alpha": alpha, "tokens_per_s": round(tokens / seconds, 1), "kinds": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--alphas", default="1,0.75")
    ap.add_argument("--policy", default="learned")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = load_engine(None, None, "bfloat16", threads=args.threads, weights="auto")
    prompts = load_workload("../shared/data/bench/spec_bench.jsonl", limit=args.limit)
    alphas = [float(a) for a in args.alphas.split(",")]
    kinds = {a: collections.defaultdict(lambda: {"rounds": 0, "tokens": 0, "seconds": 0.0, "g": 0.0, "t": 0.0})
             for a in alphas}
    for i, p in enumerate(prompts):   # each prompt at every alpha in turn, the order alternating
        ids = p.ids or encode_chat(engine.tokenizer, p.messages, p.tools)
        for a in (alphas if i % 2 == 0 else alphas[::-1]):
            decode(engine, ids, args.policy, a, kinds[a])
    runs = [summary(a, kinds[a]) for a in alphas]
    for r in runs:
        print(f"alpha {r['alpha']}: {r['tokens_per_s']} tokens/s over the rounds")
        for name, k in r["kinds"].items():
            print(f"  {name:10s} rounds {k['rounds']:5d}  tokens {k['tokens_per_round']:.2f} (expected "
                  f"{k['expected_g']:.2f})  ms {k['ms_per_round']:.3f} (expected {k['expected_ms']:.3f})  "
                  f"tokens/ms {k['tokens_per_ms']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "git": git_info(),
                       "machine": machine_info("bfloat16", args.threads), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
