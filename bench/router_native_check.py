"""The C round (router_native.py) against router.py's round on real requests: whiflash over
Spec-Bench (one prompt a category, 128 tokens, the embedded default), every round priced both ways
from the same request state and the picks compared field for field.

    .venv/bin/python bench/router_native_check.py [THREADS] [POLICY ...]

Prints per policy the rounds compared and how many picks differed (tests/test_router_native.py
pins the same on random states; this is the served model's real ones).
"""
import sys

sys.path.insert(0, ".")
from whiflash_core import router  # noqa: E402
from whiflash_core.bench.report import machine_info  # noqa: E402
from whiflash_core.bench.workload import load_workload  # noqa: E402
from whiflash_core.chat import encode_chat  # noqa: E402
from whiflash_core.engine import GenerationRequest, SpeculationConfig  # noqa: E402
from whiflash_core.loading import load_engine  # noqa: E402

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
policies = sys.argv[2:] or ["learned", "cost"]
engine = load_engine(None, None, "bfloat16", threads=threads, weights="auto")
prompts = load_workload("../shared/data/bench/spec_bench.jsonl", limit=1)
options = router.Router.options
counts: dict[str, int] = {}


def both(self, states, ctx, logits, limit=None, hidden=None, lone=False):
    """Router.options that, for a request alone, prices the round in Python first and checks the C pick."""
    if not (lone and self.native is not None):
        return options(self, states, ctx, logits, limit, hidden, lone)
    python = options(self, states, ctx, logits, limit, hidden).best(self.alpha)
    native = options(self, states, ctx, logits, limit, hidden, lone=True)
    key = "same" if native.best(self.alpha) == python else "different"
    key = key if not native.priced else "python only (the C round did not take the inputs)"
    counts[key] = counts.get(key, 0) + 1
    return native


router.Router.options = both
machine = machine_info("bfloat16", threads)
print(f"{machine['cpu']} ({' '.join(machine['cpu_flags'])}; torch kernels {machine['torch_cpu_capability']}), {threads} thread(s)")
for policy in policies:
    counts.clear()
    for p in prompts:
        ids = p.ids or encode_chat(engine.tokenizer, p.messages, p.tools)
        g = engine.start(GenerationRequest(ids, 128, speculation=SpeculationConfig("whiflash", policy=policy)))
        g.prefill()
        while not g.finished and g.step() is not None:
            pass
    print(f"policy {policy}: {sum(counts.values())} rounds, {counts}")
