"""The LM head's refinement and the greedy verify's argmax in C against PyTorch's ops, inside real rounds.

    .venv/bin/python bench/head_ops_ab.py > bench/results/head_ops_ab_zen4.txt

Eight Spec-Bench prompts (every tenth of the first 80; 64 tokens, greedy), `none` and `whiflash`,
each prompt generated with the C ops (decode_ops.refine_top, decode_ops.argmax_rows) and with
them off (TargetModel.logits and verify_greedy then use torch.topk / einsum / scatter / argmax),
interleaved prompt by prompt, three times over, one thread. Reported per method and variant: the
time per round in TargetModel.logits, in verify_greedy, and the whole round (the last is the
noisiest: on a shared machine other work moves it by more than these ops cost).
"""
import json
import os
import sys
import time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
from whiflash_core.loading import load_engine
from whiflash_core.engine import GenerationRequest, SpeculationConfig
from whiflash_core.chat import encode_chat
from whiflash_core import decode_ops, sampling, target as target_mod
engine = load_engine(None, None, "bfloat16", threads=1, weights="auto")
torch.set_num_threads(1)
rows = [json.loads(l) for l in open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "bench", "spec_bench.jsonl"))][:80:10]
prompts = [encode_chat(engine.tokenizer, [{"role": "user", "content": r["turns"][0]}]) for r in rows]
real = (decode_ops.refine_top, decode_ops.argmax_rows)
spent = {"logits": 0.0, "verify": 0.0}
def wrap(owner, name, key):
    f = getattr(owner, name)
    def w(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); spent[key] += time.perf_counter() - t0; return r
    setattr(owner, name, w)
wrap(target_mod.TargetModel, "logits", "logits")
import whiflash_core.engine as eng
wrap(sampling, "verify_greedy", "verify")
if hasattr(eng, "verify_greedy"): eng.verify_greedy = sampling.verify_greedy
res = {}
for rep in range(3):
    for p in prompts:
        for c in (True, False):
            decode_ops.refine_top, decode_ops.argmax_rows = real if c else ((lambda *a: False), (lambda *a: None))
            for method in ("none", "whiflash"):
                g = engine.start(GenerationRequest(p, 64, speculation=SpeculationConfig(method)))
                g.prefill(); spent.update(logits=0.0, verify=0.0)
                t0 = time.perf_counter()
                while not g.finished: g.step()
                total = time.perf_counter() - t0
                r = res.setdefault((method, c), {"rounds": 0, "logits": 0.0, "verify": 0.0, "total": 0.0})
                r["rounds"] += g.rounds; r["logits"] += spent["logits"]; r["verify"] += spent["verify"]; r["total"] += total
for (m, c), r in sorted(res.items()):
    n = r["rounds"]
    print(m, "C" if c else "torch", f"rounds {n}: logits {1e3*r['logits']/n:.3f} ms, verify_greedy {1e3*r['verify']/n:.3f} ms, round {1e3*r['total']/n:.3f} ms")
