"""Where the router phase of a round goes, in-run: whiflash over Spec-Bench (one prompt a category,
128 tokens), every piece of Router.options timed with perf_counter around the call (a wrapper
adds well under a microsecond a call). In a round everything the router touches is cold (the
target's forward has just evicted the caches), so a piece's cost here can be several times its
cost in a loop of its own.

    .venv/bin/python bench/router_profile.py [THREADS] [POLICY] [whole]

Prints to stdout: the router's share of a round (RoundTimes.router, as the bench reports it) and
per piece calls, microseconds a call and a round (nested pieces count in their callers too).
`whole`: no pieces timed, only the share (the wrappers' own cold microseconds left out).
"""
import collections
import sys
import time

sys.path.insert(0, ".")
from whiflash_core import acceptance, costs, decode_ops, router, router_mlp  # noqa: E402
from whiflash_core.bench.workload import load_workload  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
policy = sys.argv[2] if len(sys.argv) > 2 else "learned"
engine = load_engine(None, None, "bfloat16", threads=threads, weights="auto")
prompts = load_workload("../shared/data/bench/spec_bench.jsonl", limit=1)
seconds, calls = collections.Counter(), collections.Counter()
pieces = not (len(sys.argv) > 3 and sys.argv[3] == "whole")


def timed(owner, name: str, label: str) -> None:
    f = getattr(owner, name, None)
    if f is None or not pieces:   # a piece this commit does not have
        return

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - t0
            calls[label] += 1
    setattr(owner, name, wrapper)


timed(router.Router, "options", "Router.options")
timed(router.Router, "inputs", "  Router.inputs")
timed(router, "entropy_and_top1", "    entropy_and_top1")
timed(decode_ops, "softmax_stats", "      decode_ops.softmax_stats")
timed(decode_ops._library(), "softmax_stats_f32", "        C softmax_stats_f32")
lookup = engine.drafters.get("ngram")
if lookup is not None:
    timed(type(lookup), "match", "    NgramDrafter.match (also in propose)")
    timed(type(lookup), "copy_run", "    NgramDrafter.copy_run")
timed(router.Router, "_gain_options", "  Router._gain_options")
timed(router.Router, "predicted_rates", "    Router.predicted_rates")
timed(router, "scalar_features", "      scalar_features")
timed(acceptance.AcceptanceModel, "rates", "        AcceptanceModel.rates")
timed(decode_ops._library(), "mlp2_at_f32", "      C mlp2_at_f32")
timed(decode_ops.MLP2, "__call__", "      MLP2.__call__")
timed(router_mlp.RouterMLP, "_folded", "      RouterMLP._folded")
timed(router_mlp.RouterMLP, "rates_at", "      RouterMLP.rates_at")
timed(costs.VerifyCost, "estimates", "    VerifyCost.estimates")
timed(costs.CostModel, "attention", "    CostModel.attention")
timed(costs.CostModel, "drafting_line", "    CostModel.drafting_line")
timed(acceptance.AcceptanceModel, "gains", "    AcceptanceModel.gains")
timed(router, "expected_tokens_by_k", "    expected_tokens_by_k")
timed(getattr(router, "Options", None), "best", "Options.best")
timed(router.Router, "observe", "Router.observe (after the round)")

rounds, router_s, total_s, tokens, t0 = 0, 0.0, 0.0, 0, time.time()
for p in prompts:
    ids = p.ids or encode_chat(engine.tokenizer, p.messages, p.tools)
    g = engine.start(GenerationRequest(ids, 128, speculation=SpeculationConfig("whiflash", policy=policy)))
    g.prefill()
    while not g.finished:
        r = g.step()
        if r is None:
            break
        rounds, router_s, total_s = rounds + 1, router_s + r.times.router, total_s + r.times.total
    tokens += len(g.output)
print(f"{len(prompts)} prompts, {tokens} tokens, {rounds} rounds in {time.time() - t0:.1f} s, {threads} thread(s), "
      f"policy {policy}: router {1e6 * router_s / rounds:.1f} us a round, {100 * router_s / total_s:.2f} % of a "
      f"{1e3 * total_s / rounds:.2f} ms round")
for label in seconds:
    print(f"{label:44s} calls {calls[label]:6d}  us/call {1e6 * seconds[label] / calls[label]:7.1f}  "
          f"us/round {1e6 * seconds[label] / rounds:7.1f}")
