"""Offline probe of a retrieval drafter (REST-like): how often would a drafter that continues the
longest matching n-gram (up to MAXN tokens) of the target's own distilled answers (the train splits of
datasets/smollm2-distill*) be accepted on the target's greedy Spec-Bench text (the tokens of a
drafter_ab results file, 130 prompts)? Greedy chains of up to 4 tokens from every position.

    python bench/corpus_lookup_probe.py [MAXN] [greedy]     # greedy: only the greedy answers

Prints P(accepted >= j) for j = 1..4 and the expected accepted tokens of chains of 1..4 per
category, and the first token's acceptance by match length and by the continuation's share of
its n-gram's occurrences. Session 2026-12-07 #12: 0.29 first-token acceptance overall (README).
"""
import glob, json, ast, sys, numpy as np, collections
MAXN = int(sys.argv[1]) if len(sys.argv) > 1 else 6
greedy_only = len(sys.argv) > 2 and sys.argv[2] == "greedy"
seqs = []
for f in sorted(glob.glob("datasets/smollm2-distill*/shards/train/*.npz")):
    z = np.load(f)
    off = 0
    for pl, rl, s in zip(z["prompt_lens"], z["response_lens"], z["sampled"]):
        if not (greedy_only and s):
            seqs.append(z["tokens"][off + pl: off + pl + rl].astype(np.int64))
        off += pl + rl
SEP = 65535
corpus = np.concatenate([np.append(s, SEP) for s in seqs])
print("corpus tokens", len(corpus), "docs", len(seqs))
P = np.uint64(1000003)
tables = {}
for n in range(1, MAXN + 1):
    h = np.zeros(len(corpus) - n, dtype=np.uint64)
    for j in range(n):
        h = h * P + corpus[j:len(corpus) - n + j].astype(np.uint64)
    nxt = corpus[n:]
    ok = (nxt != SEP)
    for j in range(n):
        ok &= corpus[j:len(corpus) - n + j] != SEP
    h, nxt = h[ok], nxt[ok]
    o = np.lexsort((nxt, h)); h, nxt = h[o], nxt[o]
    brk = np.flatnonzero((np.diff(h) != 0) | (np.diff(nxt) != 0)) + 1
    starts = np.r_[0, brk]; cnt = np.diff(np.r_[starts, len(h)])
    ph, pn = h[starts], nxt[starts]
    # per hash: best next and total
    hb = np.r_[0, np.flatnonzero(np.diff(ph) != 0) + 1]
    tot = np.add.reduceat(cnt, hb)
    best = np.zeros(len(hb), dtype=np.int64); bestc = np.zeros(len(hb), dtype=np.int64)
    mx = np.maximum.reduceat(cnt, hb)
    # per n-gram the most frequent continuation (the smallest token id among equally frequent ones)
    grp = np.repeat(np.arange(len(hb)), np.diff(np.r_[hb, len(ph)]))
    seen = np.zeros(len(hb), bool)
    for i in np.flatnonzero(cnt == mx[grp]):
        g = grp[i]
        if not seen[g]:
            seen[g], best[g], bestc[g] = True, pn[i], cnt[i]
    tables[n] = (ph[hb], best, bestc, tot)
    print("n", n, "grams", len(hb))

def hashof(ctx):
    h = np.uint64(0)
    with np.errstate(over='ignore'):   # the hash wraps modulo 2^64 on purpose
        for t in ctx: h = h * P + np.uint64(t)
    return h

def next_tok(ctx, min_count=1):
    for n in range(min(MAXN, len(ctx)), 0, -1):
        keys, best, bestc, tot = tables[n]
        h = hashof(ctx[-n:]); i = np.searchsorted(keys, h)
        if i < len(keys) and keys[i] == h and tot[i] >= min_count:
            return int(best[i]), n, bestc[i] / tot[i], int(tot[i])
    return None, 0, 0.0, 0

d = json.load(open("bench/results/drafter_ab_e3r24_l10_zen3.json"))
K = 4
by_cat = collections.defaultdict(lambda: np.zeros(K + 2))
by_n = collections.defaultdict(lambda: [0, 0])
by_conf = collections.defaultdict(lambda: [0, 0])
for p in d["prompts"]:
    runs = p["runs"] if isinstance(p["runs"], dict) else ast.literal_eval(p["runs"])
    toks = next(iter(runs.values()))["tokens"]
    for i in range(1, len(toks) - 1):
        ctx = list(toks[:i]); acc = 0
        for k in range(K):
            t, n, conf, tot = next_tok(ctx)
            if k == 0:
                by_n[n][0] += 1; by_conf[round(conf, 1)][0] += 1
            if t is None or i + k >= len(toks) or t != toks[i + k]:
                break
            if k == 0:
                by_n[n][1] += 1; by_conf[round(conf, 1)][1] += 1
            acc += 1; ctx.append(t)
        c = by_cat[p["category"]]; c[0] += 1; c[1 + acc] += 1
tot = sum(by_cat.values())
def summary(c):
    n = c[0]; dist = c[1:] / n
    # P(accepted >= j) for j=1..K
    ge = [dist[j:].sum() for j in range(1, K + 1)]
    return " ".join(f"{x:.2f}" for x in ge) + f"  E[acc|k=1..4]=" + " ".join(f"{sum(ge[:k]):.2f}" for k in range(1, K + 1))
for cat, c in by_cat.items(): print(f"{cat:15s}", summary(c))
print(f"{'all':15s}", summary(tot))
print("first-token acceptance by match n:", {n: (v[0], round(v[1] / max(v[0], 1), 2)) for n, v in sorted(by_n.items())})
print("by confidence:", {c: (v[0], round(v[1] / max(v[0], 1), 2)) for c, v in sorted(by_conf.items())})
