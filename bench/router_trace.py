"""Router trace on Spec-Bench (one prompt a category, whiflash, 128 tokens): per chosen drafter its rounds,
predicted vs observed tokens a round, ms a round and tokens per ms; and prompt lookup's counterfactual
acceptance at every round (from the final greedy output), by suffix-match size and by copy run.

    .venv/bin/python bench/router_trace.py THREADS

Ad-hoc diagnosis behind the copy-run router (2026-12-02 session note); prints to stdout.
"""
import sys, json, time, collections, os
import torch
sys.path.insert(0, '.')
from whiflash_core.loading import load_engine
from whiflash_core.bench.workload import load_workload
from whiflash_core.chat import encode_chat
from whiflash_core.engine import GenerationRequest, SpeculationConfig
from whiflash_core import router as R
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
eng = load_engine(None, None, "bfloat16", threads=threads, weights="auto")
prompts = load_workload("../shared/data/bench/spec_bench.jsonl", limit=1)
rec = []
cur = {}
orig_options, orig_observe = R.Router.options, R.Router.observe
def options(self, states, ctx, logits, limit=None, hidden=None):
    opts = orig_options(self, states, ctx, logits, limit, hidden)
    cands = opts.candidates()   # a request alone picks from the arrays (Options.best): list them here
    lk = self.drafters.get("ngram")
    m, s = lk.match(states["ngram"], ctx.ids, ctx.n) if lk else (0, 0)
    bestby = {}
    for c in cands:
        sc = c.score(self.alpha)
        if c.drafter not in bestby or sc > bestby[c.drafter][0]:
            bestby[c.drafter] = (sc, c.k, c.tokens, c.seconds)
    cur["o"] = dict(n=ctx.n, match=m, start=s, best=bestby, ng=[(c.k, round(c.tokens, 3), round(1000 * c.seconds, 2)) for c in cands if c.drafter == "ngram"], plain=[round(1000 * c.seconds, 2) for c in cands if c.drafter is None], e3=[(c.k, round(c.tokens, 3), round(1000 * c.seconds, 2)) for c in cands if c.drafter == "eagle3"])
    return opts
def observe(self, route, r):
    o = cur.pop("o", None)
    if o is not None:
        rec.append(dict(o, drafter=route.drafter, k=r.draft_len, acc=r.accepted, exp=route.expected_tokens,
                        exp_s=route.expected_s, sec=r.times.total, gen=len(gens)))
    return orig_observe(self, route, r)
R.Router.options, R.Router.observe = options, observe
gens = []
t0 = time.time()
for p in prompts:
    ids = p.ids or encode_chat(eng.tokenizer, p.messages, p.tools)
    g = eng.start(GenerationRequest(ids, 128, speculation=SpeculationConfig("whiflash")))
    g.prefill()
    while not g.finished:
        g.step()
    gens.append((p.category, g.ids.clone(), len(ids) + len(g.output)))
print("wall", round(time.time() - t0, 1))
# counterfactual lookup acceptance per round
for r in rec:
    cat, ids, end = gens[r["gen"]]
    cf = 0
    if r["match"]:
        n, s = r["n"], r["start"]
        while s + cf <= n and n + 1 + cf < end and int(ids[s + cf]) == int(ids[n + 1 + cf]):
            cf += 1
    r["cf"] = cf
by = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
for r in rec:
    b = by[r["drafter"]]; b[0] += 1; b[1] += r["exp"] or 0; b[2] += r["acc"] + 1; b[3] += r["sec"]
print("drafter rounds predicted_g observed_g ms/round tok/ms")
for d, (n, e, o, s) in by.items():
    print(d, n, round(e / n, 3), round(o / n, 3), round(1000 * s / n, 2), round(o / (1000 * s), 3))
# plain rounds that had a lookup match: what lookup would have accepted
pm = [r for r in rec if r["drafter"] is None and r["match"]]
print("plain rounds with a match:", len(pm), "of", sum(1 for r in rec if r["drafter"] is None),
      "mean cf accepted", round(sum(r["cf"] for r in pm) / max(len(pm), 1), 3),
      "mean lookup predicted g", round(sum(r["best"]["ngram"][2] for r in pm if "ngram" in r["best"]) / max(len(pm), 1), 3))
e3 = [r for r in rec if r["drafter"] == "eagle3"]
print("eagle3 rounds with a match:", sum(1 for r in e3 if r["match"]), "cf acc there", round(sum(r["cf"] for r in e3 if r["match"]) / max(1, sum(1 for r in e3 if r["match"])), 3))
ng = [r for r in rec if r["drafter"] == "ngram"]
print("ngram rounds: mean k", round(sum(r["k"] for r in ng) / max(len(ng), 1), 2), "cf", round(sum(r["cf"] for r in ng) / max(len(ng), 1), 3), "acc", round(sum(r["acc"] for r in ng) / max(len(ng), 1), 3))
# by match length
bm = collections.defaultdict(lambda: [0, 0, 0.0])
for r in rec:
    if r["match"]:
        b = bm[r["match"]]; b[0] += 1; b[1] += r["cf"]; b[2] += r["best"].get("ngram", (0, 0, 0))[2] - 1
print("match len: rounds, mean cf accepted (uncapped by k), mean predicted accepted of best lookup cand")
for m in sorted(bm): print(m, bm[m][0], round(bm[m][1] / bm[m][0], 3), round(bm[m][2] / bm[m][0], 3))
json.dump(rec, open("/tmp/diag_router.json", "w"))
for r in [r for r in rec if r["match"] == 3][:12]:
    print(r["drafter"], r["k"], "acc", r["acc"], "cf", r["cf"], "plain", r["plain"], "ng", r["ng"], "e3", r["e3"])
# extended match length: how far back the context agrees with the copy source
import statistics
bl = collections.defaultdict(list)
for r in rec:
    if not r["match"]:
        continue
    cat, ids, end = gens[r["gen"]]
    n, s = r["n"], r["start"]
    L = 0
    while s - 1 - L >= 0 and int(ids[s - 1 - L]) == int(ids[n - L]) and L < 64:
        L += 1
    b = 2 if L <= 2 else 3 if L <= 3 else 4 if L < 8 else 8 if L < 16 else 16
    bl[b].append(r["cf"])
print("extended match bucket: rounds, mean cf, median cf, P(cf>=3), P(cf>=8)")
for b in sorted(bl):
    v = bl[b]
    print(b, len(v), round(sum(v) / len(v), 2), statistics.median(v), round(sum(x >= 3 for x in v) / len(v), 2), round(sum(x >= 8 for x in v) / len(v), 2))
