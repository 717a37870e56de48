"""Shared rounds offline: tokens per CPU-second of N generations stepped together (Engine.step_many).

    .venv/bin/python bench/shared_step.py --streams 1 8 --reps 3 [--breakdown] [--out FILE]

What `bench/load.py` measures through HTTP, without the HTTP and without the noise of a busy
machine: N agent conversations (the load test's system prompt, tools and turns, tool results
included, greedy, 32 tokens per answer, the lazy tool grammar that a request with tools gets from
the server) are kept active, one step_many call per pass as the server's worker does, and a
finished one is replaced at once by the next prompt of a fixed pool. Only the step_many calls are
timed, in CPU time of this thread (`time.thread_time`, torch on one thread), so other processes on
the machine do not count; prefills are not timed (the prefix cache is on, as in the server).

Reported per stream count and repetition: rounds, tokens, CPU seconds, tokens per CPU-second, and
the ratio of N streams to one stream (the load test's "8 streams vs 1" without HTTP and prefill).
`--breakdown` also splits the CPU time by phase (router, drafting, grammar masks, target forward,
accept/commit) by wrapping those functions; `--profile FILE` writes a torch.profiler table of one
extra N-stream run.

The repetitions interleave the stream counts (1, 8, 1, 8, ...); take min or median over them.
`--ab-prefix-reads` runs each count twice a repetition, with requests that share a cached prefix
reading it once for all (the engine's way) and each from its own cache, and reports the ratio.
`--ab-context` likewise with shared steps priced by each request's context (costs.py: a verify
row's attention by the request's cached positions, CostModel.per_position) and without (the
shared-forward table as timed, over 256 cached positions a request).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.agent_replay import SYSTEM, TOOLS  # noqa: E402
from bench.load import CITIES, FOLLOW_UPS, tool_result  # noqa: E402
from whiflash_core import layer_stack  # noqa: E402
from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402
from whiflash_core.prefix_cache import PrefixCache  # noqa: E402


def conversations(tokenizer, count: int) -> list[list[int]]:
    """`count` prompts as the load test's streams send them: turn 1 (system, tools, a user task), turn
    2 (+ a tool call and its result) or turn 3 (+ an answer and a follow-up question)."""
    prompts = []
    for i in range(count):
        rng = random.Random(i)
        a, b = rng.sample(CITIES, 2)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Find me a morning flight from {a} to {b} next Friday, "
                                                f"and a hotel near the centre for two nights."}]
        turn = i % 3
        if turn >= 1:
            call = {"id": f"call_{i}", "type": "function",
                    "function": {"name": "search_flights",
                                 "arguments": json.dumps({"origin": a[:3].upper(), "destination": b[:3].upper(),
                                                          "date": "2026-05-15"})}}
            messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": tool_result(call, rng)}]
        if turn >= 2:
            messages += [{"role": "assistant", "content": "The cheapest morning flight leaves at 07:10 for 89 euros."},
                         {"role": "user", "content": rng.choice(FOLLOW_UPS)}]
        prompts.append(encode_chat(tokenizer, messages, TOOLS))
    return prompts


class Requests:
    """The prompt pool, cycled; each request gets a fresh lazy tool grammar (as the server's)."""

    def __init__(self, engine, prompts: list[list[int]], max_tokens: int, grammar: bool, method: str):
        self.engine, self.prompts, self.max_tokens, self.method = engine, prompts, max_tokens, method
        self.grammars = None
        if grammar:
            from whiflash_core.constraints import GrammarFactory
            self.grammars = GrammarFactory(engine.tokenizer, engine.vocab_size, engine.eos_ids)
        self.next = 0

    def start(self):
        ids = self.prompts[self.next % len(self.prompts)]
        self.next += 1
        constraint = self.grammars.lazy_tool_calls(TOOLS, parallel=False) if self.grammars else None
        gen = self.engine.start(GenerationRequest(ids, self.max_tokens, speculation=SpeculationConfig(self.method),
                                                  constraint=constraint))
        gen.prefill()
        return gen


def run(engine, requests: Requests, streams: int, rounds: int) -> dict:
    """`rounds` passes over `streams` active generations; a finished one is replaced at once."""
    requests.next = 0
    active = [requests.start() for _ in range(streams)]
    cpu, tokens, calls = 0.0, 0, 0
    for _ in range(rounds):
        before = sum(len(g.output) for g in active)
        t0 = time.thread_time()
        results = engine.step_many(active)
        cpu += time.thread_time() - t0
        calls += 1
        bad = [r for r in results if isinstance(r, Exception)]
        if bad:
            raise bad[0]
        tokens += sum(len(g.output) for g in active) - before
        active = [requests.start() if g.finished else g for g in active]
    return {"streams": streams, "rounds": calls, "tokens": tokens, "cpu_s": round(cpu, 4),
            "tokens_per_cpu_s": round(tokens / cpu, 3), "ms_per_pass": round(1000 * cpu / calls, 3)}


# --- the breakdown: CPU time per phase, by wrapping the functions of each phase -------------------

PHASES = {  # phase -> (module, qualified name); wrapped only where present (older code lacks some)
    "route": ("whiflash_core.router", "Router.route"),
    "draft": ("whiflash_core.engine", "Generation._propose"),
    "grammar": ("whiflash_core.constraints", "GrammarConstraint.masks"),
    "plan": ("whiflash_core.engine", "Generation.plan"),
    "plan_many": ("whiflash_core.engine", "Engine.plan_many"),
    "forward": ("whiflash_core.target", "TargetModel.forward"),
    "forward_many": ("whiflash_core.target", "TargetModel.forward_many"),
    "commit": ("whiflash_core.engine", "Generation.commit"),
    "attention": ("whiflash_core.target", "Attention.forward_many"),
    "attend_rows": ("whiflash_core.target", "Attention.attend_rows"),
    "logits": ("whiflash_core.target", "TargetModel.logits"),
    "mlp": ("whiflash_core.target", "GatedMLP.forward"),
    "eagle3.catch_up": ("whiflash_core.drafters.eagle3", "Eagle3Drafter.catch_up"),
    "eagle3.propose": ("whiflash_core.drafters.eagle3", "Eagle3Drafter.propose"),
    "eagle3.propose_many": ("whiflash_core.drafters.eagle3", "Eagle3Drafter.propose_many"),
    "dflash.catch_up": ("whiflash_core.drafters.dflash", "DFlashDrafter.catch_up"),
    "dflash.propose": ("whiflash_core.drafters.dflash", "DFlashDrafter.propose"),
    "dflash.propose_many": ("whiflash_core.drafters.dflash", "DFlashDrafter.propose_many"),
    "ngram.propose": ("whiflash_core.drafters.ngram", "NgramDrafter.propose"),
    "verify": ("whiflash_core.engine", "Generation._verify"),
    "emit": ("whiflash_core.engine", "Generation._emit"),
}


def wrap_phases(spent: dict[str, float]) -> None:
    """Charge each phase's CPU time to `spent`, counted inside Engine.step_many only (not the
    untimed prefills of replacement requests). Nested phases (draft inside plan, attention inside
    forward_many) are counted in both."""
    import importlib

    from whiflash_core.engine import Engine

    inside = [False]
    step_many = Engine.step_many

    def counted_step_many(*a, **kw):
        inside[0] = True
        try:
            return step_many(*a, **kw)
        finally:
            inside[0] = False
    Engine.step_many = functools.wraps(step_many)(counted_step_many)
    for phase, (module, qualname) in PHASES.items():
        owner_name, _, attr = qualname.rpartition(".")
        owner = getattr(importlib.import_module(module), owner_name, None)
        fn = getattr(owner, attr, None) if owner is not None else None
        if fn is None:
            continue

        def timed(*a, __fn=fn, __phase=phase, **kw):
            if not inside[0]:
                return __fn(*a, **kw)
            t0 = time.thread_time()
            try:
                return __fn(*a, **kw)
            finally:
                spent[__phase] += time.thread_time() - t0
        setattr(owner, attr, functools.wraps(fn)(timed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=None, help="passes per run (default: 480 // streams, at least 40)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--method", default="whiflash")
    ap.add_argument("--no-grammar", action="store_true", help="no lazy tool grammar (the server adds one with tools)")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--profile", default=None, help="write a torch.profiler table of one N-stream run here")
    ap.add_argument("--ab-prefix-reads", action="store_true",
                    help="also run each stream count with every request reading its cached prefix from its own "
                         "cache (layer_stack.shared_prefixes off), interleaved: what reading a shared prefix once gains")
    ap.add_argument("--ab-context", action="store_true",
                    help="also run each stream count with the router's context terms off, interleaved")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.ab_prefix_reads and args.ab_context:
        ap.error("one A/B at a time")

    engine = load_engine(None, None, args.dtype, threads=args.threads, weights=args.weights)
    torch.set_num_threads(args.threads)
    engine.prefix_cache = PrefixCache(512 * 2**20)
    requests = Requests(engine, conversations(engine.tokenizer, args.prompts), args.max_tokens,
                        not args.no_grammar, args.method)
    spent: dict[str, float] = defaultdict(float)
    if args.breakdown:
        wrap_phases(spent)
    rounds = {n: args.rounds or max(40, 480 // n) for n in args.streams}
    run(engine, requests, max(args.streams), 4)   # warm-up: kernels, grammar, prefix cache
    runs = []
    shared_prefixes = layer_stack.shared_prefixes
    costs = engine.costs
    measured = costs.per_position
    # (what an A/B varies, its arms: the engine's way first)
    variant, variants = ("context", ["context", "flat"]) if args.ab_context else ("prefix_reads", ["shared", "own"])
    if not (args.ab_prefix_reads or args.ab_context):
        variants = variants[:1]
    for rep in range(args.reps):
        for n in args.streams:
            for arm in variants:
                layer_stack.shared_prefixes = shared_prefixes if arm != "own" else (lambda segments: None)
                costs.set_per_position(measured if arm != "flat" else {})
                spent.clear()
                r = run(engine, requests, n, rounds[n])
                r["rep"] = rep
                if len(variants) > 1:
                    r[variant] = arm
                if args.breakdown:
                    r["breakdown_ms_per_pass"] = {k: round(1000 * v / r["rounds"], 3) for k, v in spent.items()}
                runs.append(r)
                print(json.dumps(r), flush=True)
    layer_stack.shared_prefixes = shared_prefixes
    costs.set_per_position(measured)
    summary = {}
    for n in args.streams:
        rates = [r["tokens_per_cpu_s"] for r in runs if r["streams"] == n and r.get(variant, variants[0]) == variants[0]]
        summary[n] = {"median_tokens_per_cpu_s": round(statistics.median(rates), 3), "max": max(rates)}
        if len(variants) > 1:
            first, other = variants
            others = [r["tokens_per_cpu_s"] for r in runs if r["streams"] == n and r[variant] == other]
            summary[n][f"{other}_{variant}_median"] = round(statistics.median(others), 3)
            summary[n][f"{first}_over_{other}"] = round(summary[n]["median_tokens_per_cpu_s"] / statistics.median(others), 3)
    base = args.streams[0]
    for n in args.streams[1:]:
        summary[n]["median_vs_%d" % base] = round(summary[n]["median_tokens_per_cpu_s"]
                                                  / summary[base]["median_tokens_per_cpu_s"], 3)
    print(json.dumps(summary), flush=True)
    if args.profile:   # step_many calls only: requests long enough that none finishes, prefilled first
        from torch.profiler import ProfilerActivity, profile
        n = max(args.streams)
        requests.max_tokens, requests.next = 10**4, 0
        active = [requests.start() for _ in range(n)]
        engine.step_many(active)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                engine.step_many([g for g in active if not g.finished])
        with open(args.profile, "w") as f:
            f.write(f"{n} streams, 10 passes of Engine.step_many\n")
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    if args.out:
        out = {"command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
               "machine": machine_info(args.dtype, args.threads), "git": git_info(),
               "formats": None if engine.target.formats is None else vars(engine.target.formats),
               "args": vars(args), "runs": runs, "summary": summary}
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
