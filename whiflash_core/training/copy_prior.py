"""`whiflash train copy-prior`: how prompt-lookup copies run on in the target's own answers.

    whiflash train copy-prior --data datasets/smollm2-distill,... --out models/smollm2-135m-instruct/copy_prior.json

The routers price a prompt-lookup draft of every length by p_1..p_K, its per-position acceptance
(p_i: draft token i accepted given 1..i-1 were), in situations by copy run (how many tokens up
to the pending one agree with the text before the match: acceptance.copy_situation). A request
learns its own rates as it goes (Router._observe_copy), but it starts from a prior, and most
requests are too short to learn long drafts from scratch. This is that prior, counted exactly as
a request counts: at every response position of the distilled answers (train split, the target's
greedy answers: what a greedy verify accepts), NgramDrafter finds its match and copy run, and the
copy of up to K tokens is compared with the answer's next tokens; per situation and position,
accepted / (accepted + rejected). No model runs: token ids only, a minute on one core.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone

from ..acceptance import COPY_RUN_BINS, copy_situation
from ..drafters.ngram import NgramConfig, NgramDrafter
from .data import load_examples

# a situation's position with fewer observations than this borrows the rate before it
MIN_COUNT = 20


def count(examples, drafter: NgramDrafter, k: int) -> dict[int, list[list[int]]]:
    """Per copy situation, per draft position: [accepted, rejected] over every response position."""
    counts: dict[int, list[list[int]]] = {}
    for e in examples:
        state, ids, end = drafter.new_state(0), e.ids, e.length
        seq = ids.tolist()
        for n in range(e.prompt_len - 1, end - 1):   # pending token n, the answer's next at n + 1..
            size, start = drafter.match(state, ids, n)
            if not size:
                continue
            where = copy_situation(drafter.copy_run(state, n, start))
            copy = drafter.copy(ids, n, start, k)
            truth = seq[n + 1:n + 1 + len(copy)]
            table = counts.setdefault(where, [[0, 0] for _ in range(k)])
            for i, (c, t) in enumerate(zip(copy, truth)):
                if c != t:
                    table[i][1] += 1
                    break
                table[i][0] += 1
    return counts


def rates(counts: dict[int, list[list[int]]]) -> dict[int, list[float]]:
    """accepted / observed per position; a position seen fewer than MIN_COUNT times keeps the
    rate before it (the first: 0.5)."""
    out = {}
    for where, table in sorted(counts.items()):
        rs, last = [], 0.5
        for hit, miss in table:
            if hit + miss >= MIN_COUNT:
                last = hit / (hit + miss)
            rs.append(round(last, 4))
        out[where] = rs
    return out


def main(args: argparse.Namespace) -> None:
    t0 = time.time()
    examples = load_examples(args.data, "train", args.max_len, args.exclude_sources)
    drafter = NgramDrafter(NgramConfig())
    k = drafter.cfg.routed_draft_tokens
    counts = count(examples, drafter, k)
    result = {
        "what": "prompt lookup's per-position acceptance p_1..p_K by copy-run situation (the routers' prior)",
        "command": f"whiflash train copy-prior --data {args.data} --out {args.out}"
                   + (f" --exclude-sources {args.exclude_sources}" if args.exclude_sources else ""),
        "made": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "data": args.data, "split": "train", "sequences": len(examples), "excluded_sources": args.exclude_sources,
        "copy_run_bins": list(COPY_RUN_BINS), "draft_tokens": k, "min_count": MIN_COUNT,
        "rates": {str(w): r for w, r in rates(counts).items()},
        "observations": {str(w): [h + m for h, m in table] for w, table in sorted(counts.items())},
        "seconds": round(time.time() - t0, 1),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({w: r[:6] for w, r in result["rates"].items()}))


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("copy-prior", help="prompt lookup's acceptance by copy run, for the routers' prior",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="distilled data directories, comma-separated (train split)")
    p.add_argument("--out", required=True, help="the JSON to write (beside the drafters: copy_prior.json)")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--exclude-sources", default="", help="comma-separated sources to leave out")
    p.set_defaults(func=main)
    return p
