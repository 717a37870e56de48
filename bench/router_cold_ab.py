"""A/B of the router's per-round choice with the caches cold, in one process: methods as another
checkout has them (BASE, e.g. a `git worktree add /tmp/base HEAD`) against this tree's, taking
turns every round of a whiflash run over Spec-Bench (one prompt a category, 96 tokens, 2
threads). Before each timed choice (Router.options, then `best`, as Generation.route_round makes
it) a sweep over 8 MB of memory evicts L1 and L2, as a round's target forward does. Two processes
on this shared 2-core VM differ by +-25 % in such a time; turns in one process compare to a few
microseconds. Both versions must pick the same candidate (asserted every round).

    .venv/bin/python bench/router_cold_ab.py BASE [Class:method:path:module ...]

Swapped by default: Router._gain_options and RouterMLP._folded; more with the arguments (e.g.
MLP2:__call__:whiflash_core/decode_ops.py:whiflash_core.decode_ops). Prints each side's median
and quartiles and their per-round difference, in microseconds.
"""
import ast
import statistics
import sys
import textwrap
import time

import torch

sys.path.insert(0, ".")
from whiflash_core import router, router_mlp  # noqa: E402
from whiflash_core.bench.workload import load_workload  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402

EVICT_BYTES = 8 << 20   # four times a core's L2 here


def method_of(path: str, cls: str, name: str, module) -> object:
    """Method `name` of class `cls` in the source file `path`, compiled in `module`'s namespace."""
    src = open(path).read()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == name:
                    scope: dict = {}
                    exec(textwrap.dedent(ast.get_source_segment(src, f)), module.__dict__, scope)
                    return scope[name]
    raise KeyError(f"{cls}.{name} not in {path}")


base = sys.argv[1]
swaps = [(router.Router, "_gain_options", "whiflash_core/router.py", router),
         (router_mlp.RouterMLP, "_folded", "whiflash_core/router_mlp.py", router_mlp)]
for spec in sys.argv[2:]:
    cls, name, path, module = spec.split(":")
    swaps.append((getattr(sys.modules[module], cls), name, path, sys.modules[module]))
sides = {"this": [(c, n, getattr(c, n)) for c, n, _, _ in swaps],
         "base": [(c, n, method_of(f"{base}/{p}", c.__name__, n, m)) for c, n, p, m in swaps]}

engine = load_engine(None, None, "bfloat16", threads=2, weights="auto")
prompts = load_workload("../shared/data/bench/spec_bench.jsonl", limit=1)
sweep = torch.ones(EVICT_BYTES // 4)
times: dict[str, list[float]] = {side: [] for side in sides}
rounds = 0
for p in prompts:
    ids = p.ids or encode_chat(engine.tokenizer, p.messages, p.tools)
    g = engine.start(GenerationRequest(ids, 96, speculation=SpeculationConfig("whiflash")))
    g.prefill()
    while not g.finished:
        limit = min(g.request.max_new_tokens - len(g.output) - 1, engine.max_context - g.cache.length - 2)
        ctx, picks = g._context(), {}
        for side in (("base", "this") if rounds % 2 else ("this", "base")):
            for c, n, f in sides[side]:
                setattr(c, n, f)
            sweep.add_(1.0)
            t0 = time.perf_counter()
            pick = g.router.options(g.states, ctx, g.last_logits, limit, g.last_hidden).best(g.router.alpha)
            times[side].append(time.perf_counter() - t0)
            picks[side] = (pick.drafter, pick.k, pick.tokens, pick.seconds)
        assert picks["base"] == picks["this"], picks
        for c, n, f in sides["this"]:   # the real round runs this tree's code
            setattr(c, n, f)
        rounds += 1
        if g.step() is None:
            break
for side, ts in times.items():
    q1, q2, q3 = statistics.quantiles(ts, n=4)
    print(f"{side}: cold options+best median {1e6 * q2:.1f} us (quartiles {1e6 * q1:.1f}, {1e6 * q3:.1f}), {len(ts)} rounds")
# the side timed second in a round finds a little more in cache: the order alternates, and the
# difference is the mean of the two orders' median differences
diffs = [a - b for a, b in zip(times["this"], times["base"])]
diff = (statistics.median(diffs[0::2]) + statistics.median(diffs[1::2])) / 2
print(f"this - base: {1e6 * diff:+.1f} us (median per-round difference, the two orders averaged)")
