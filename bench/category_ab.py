"""Prompt lookup alone vs whiflash on the Spec-Bench prompt of one category, alternating twice in one
process (2 threads): tokens/s and per drafter (rounds, tokens, ms a round).

    .venv/bin/python bench/category_ab.py summarization
"""
import sys, time, collections, torch
sys.path.insert(0, '.')
from whiflash_core.loading import load_engine
from whiflash_core.bench.workload import load_workload
from whiflash_core.chat import encode_chat
from whiflash_core.engine import GenerationRequest, SpeculationConfig
eng = load_engine(None, None, "bfloat16", threads=2, weights="auto")
cat = sys.argv[1]
prompts = [p for p in load_workload("../shared/data/bench/spec_bench.jsonl", limit=1) if p.category == cat]
for method in ("ngram", "whiflash", "ngram", "whiflash"):
    for p in prompts:
        ids = p.ids or encode_chat(eng.tokenizer, p.messages, p.tools)
        g = eng.start(GenerationRequest(ids, 128, speculation=SpeculationConfig(method)))
        g.prefill(); t0 = time.perf_counter(); rounds = collections.Counter(); toks = collections.Counter(); tm = collections.Counter()
        while not g.finished:
            r = g.step()
            if r is None: break
            rounds[r.drafter] += 1; toks[r.drafter] += r.decided; tm[r.drafter] += r.times.total
        dt = time.perf_counter() - t0
        print(method, len(ids), len(g.output), "tok/s %.1f" % (len(g.output) / dt), {str(k): (rounds[k], toks[k], round(1000 * tm[k] / rounds[k], 2)) for k in rounds}, "round sum ms %.0f wall ms %.0f" % (1000 * sum(tm.values()), 1000 * dt))
