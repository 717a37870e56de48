"""Regenerate the README's results section from committed results files (never typed by hand).

    .venv/bin/python bench/update_readme.py [RESULTS.json ...]

Replaces the text between `<!-- results:start -->` and `<!-- results:end -->` in README.md with
`whiflash bench --markdown` tables of the given Spec-Bench results and the verify-cost curve.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from whiflash_core.bench.report import render_markdown  # noqa: E402

START, END = "<!-- results:start -->", "<!-- results:end -->"


def verify_curve_markdown(path: str) -> str:
    with open(path) as f:
        r = json.load(f)
    names = list(r["verify_ms"])
    lines = [f"_`{r['command']}` — {r['machine']['cpu']}, {r['machine']['threads']} threads, "
             f"torch {r['machine']['torch']}, commit {r['git_commit']}_", "",
             "| k | " + " | ".join(f"{n} ms | ratio" for n in names) + " |",
             "|---:|" + "---:|---:|" * len(names)]
    for k in r["verify_ms"][names[0]]:
        cells = " | ".join(f"{r['verify_ms'][n][k]:.1f} | {r['verify_ratio'][n][k]:.2f}" for n in names)
        lines.append(f"| {k} | {cells} |")
    d = r["plain_decode_tokens_per_s"]
    lines += ["", "Plain decode, 128 tokens (tokens/s): " + ", ".join(f"{k} {v:.1f}" for k, v in d.items()) + ".",
              "Engine / `transformers` `generate`: " +
              ", ".join(f"{k} {v:.2f}x" for k, v in r["engine_vs_transformers"].items()) + "."]
    return "\n".join(lines)


def main() -> None:
    files = sys.argv[1:] or [os.path.join(ROOT, "bench/results/specbench_untrained.json")]
    parts = []
    for path in files:
        with open(path) as f:
            parts.append(render_markdown(json.load(f)).split("\nDecode tokens/s per category")[0].strip())
    curve = os.path.join(ROOT, "bench/results/verify_curve.json")
    if os.path.exists(curve):
        parts.append("Verify cost curve T(k) (one forward over k new tokens, 300-token context):\n\n"
                     + verify_curve_markdown(curve))
    readme = os.path.join(ROOT, "README.md")
    with open(readme) as f:
        text = f.read()
    a, b = text.index(START) + len(START), text.index(END)
    text = text[:a] + "\n" + "\n\n".join(parts) + "\n" + text[b:]
    with open(readme, "w") as f:
        f.write(text)
    print(f"updated {readme} from {', '.join(files)}")


if __name__ == "__main__":
    main()
