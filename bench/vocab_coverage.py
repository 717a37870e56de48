"""How much of the target's text can a drafter's head draft at all? Draft-vocabulary coverage.

    .venv/bin/python bench/vocab_coverage.py --answers bench/results/drafter_ab_e3r21_l10_xeon.json \
        --data datasets/smollm2-distill,datasets/smollm2-distill-r2 --sizes 8192 12288 16384 \
        --out bench/results/vocab_coverage_xeon.json

An EAGLE-3 or DFlash head scores only its draft vocabulary (d2t/t2d): a target token outside it
can never be drafted, so the chain ends there whatever the drafter learned. This reads the
target's greedy answers of an earlier run (`bench/drafter_ab.py` or `router_ab.py` results: the
emitted token ids per prompt; the answers are the target's, so only where they are evaluated,
never trained on) and reports, per category, the share of answer tokens that:
  - the shipped drafter's head covers (`--drafter`, its t2d), and
  - a head of each `--sizes` rows would cover, its rows the most frequent response tokens of the
    training data (`--data`, train splits as training loads them, `--exclude-sources` left out),
    chosen by the function `--draft-vocab` uses (training.data.build_draft_vocab).
With acceptance rate p per drafted position and coverage c, a chain's tokens scale with (c p)^j at
position j: the coverage is a ceiling no amount of training on the same head lifts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from whiflash_core.bench.report import git_info, machine_info  # noqa: E402
from whiflash_core.drafters.checkpoint import load_state_dict  # noqa: E402
from whiflash_core.loading import SHIPPED_DRAFTERS  # noqa: E402
from whiflash_core.training.data import build_draft_vocab, load_examples, response_counts  # noqa: E402


def answers_by_category(path: str, run: str | None) -> dict[str, list[int]]:
    """Emitted token ids per category from a drafter_ab / router_ab result (run: which arm)."""
    with open(path) as f:
        result = json.load(f)
    out: dict[str, list[int]] = defaultdict(list)
    for prompt in result["prompts"]:
        arm = run or next(iter(prompt["runs"]))
        out[prompt["category"]] += prompt["runs"][arm]["tokens"]
    return dict(out)


def coverage(mask: torch.Tensor, tokens: list[int]) -> float:
    return round(float(mask[torch.tensor(tokens)].float().mean()), 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--answers", required=True, help="a drafter_ab.py / router_ab.py result JSON")
    ap.add_argument("--run", default=None, help="which arm's tokens (default: the first)")
    ap.add_argument("--drafter", default=os.path.join(SHIPPED_DRAFTERS, "eagle3"))
    ap.add_argument("--data", required=True, help="distilled directories, comma-separated")
    ap.add_argument("--exclude-sources", default="alpaca_en_demo,alpaca_seed_tasks,code_alpaca_2k,new_codealpaca")
    ap.add_argument("--max-len", type=int, default=2048, help="as the training run's --max-len")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 12288, 16384])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    shipped = load_state_dict(args.drafter)["t2d"].bool()   # one file or shards; [target vocab]
    vocab = len(shipped)
    examples = load_examples(args.data, "train", args.max_len, args.exclude_sources)
    counts = response_counts(examples, vocab)
    heads = {"shipped": shipped}
    for n in args.sizes:
        heads[f"top{n}"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, build_draft_vocab(examples, n, vocab)[0], True)
    answers = answers_by_category(args.answers, args.run)
    everything = [t for tokens in answers.values() for t in tokens]
    table = {name: {**{c: coverage(m, t) for c, t in answers.items()}, "all": coverage(m, everything),
                    "train": round(float(counts[m].sum()) / float(counts.sum()), 4), "rows": int(m.sum())}
             for name, m in heads.items()}
    for name, row in table.items():
        print(f"{name:>10} rows {row['rows']:>6}  train {row['train']:.3f}  answers {row['all']:.3f}  "
              + " ".join(f"{c} {v:.3f}" for c, v in row.items() if c in answers))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "git": git_info(),
                       "machine": machine_info("bfloat16", 1), "answers": args.answers,
                       "answer_tokens": len(everything), "coverage": table}, f, indent=1)


if __name__ == "__main__":
    main()
