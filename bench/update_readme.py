"""Regenerate the README's results section from committed results files (never typed by hand).

    .venv/bin/python bench/update_readme.py [RESULTS.json ...]

Replaces the text between `<!-- results:start -->` and `<!-- results:end -->` in README.md with
`whiflash bench --markdown` tables of the given Spec-Bench results (the first one with its
per-category tables, the others overall only), the router calibration, the drafter step costs and
the verify-cost curve.
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


def calibration_markdown(path: str) -> str:
    with open(path) as f:
        r = json.load(f)
    cal = r["calibration"]
    lines = [f"_`{r['command']}` ({r['weights']} weights, {r['machine']['threads']} threads, "
             f"commit {(r['git']['commit'] or '')[:7]})_", "",
             "| entropy threshold | acc. len | tok/s | round ms | EAGLE-3 share of rounds |", "|---:|---:|---:|---:|---:|"]
    for p in cal["sweep"]:
        lines.append(f"| {p['threshold']:g} | {p['acceptance_length']:.2f} | {p['tokens_per_s']:.1f} | "
                     f"{p['round_ms']:.1f} | {p['eagle3_round_share']:.0%} |")
    lines += ["", f"Acceptance-best threshold {cal['threshold_al']:g}, tokens/s-best {cal['threshold_tps']:g}. "
              "alpha -> threshold (measured mean round ms): " +
              ", ".join(f"{p['alpha']:.1f} -> {p['threshold']:g} ({p['round_ms']:.1f})" for p in r["alpha_path"]) + "."]
    return "\n".join(lines)


def drafter_step_markdown(path: str) -> str:
    with open(path) as f:
        r = json.load(f)
    parts = [f"_`{r['command']}` ({r['machine']['threads']} threads, {r['context']}-token context)_", ""]
    for weights, res in r["results"].items():
        label = "dense bf16 drafters" if weights == "dense" else f"int8 drafters (target {weights})"
        e, d = res.get("eagle3"), res.get("dflash")
        if e:
            parts.append(f"- {label}: EAGLE-3 {e['first_step_ms']:.2f} ms for one draft (full layer on the newest "
                         f"pair + head), then {e['chain_step_ms']:.2f} ms per further chain step (by chain length: " +
                         ", ".join(f"{k}: {v:.2f} ms" for k, v in e["propose_ms_by_k"].items()) + ")" +
                         (f"; DFlash block {d['block_size']} ({d['block_size'] - 1} drafts in one forward): "
                          f"{d['propose_ms']:.2f} ms." if d else "."))
    return "\n".join(parts)


def main() -> None:
    files = sys.argv[1:] or [os.path.join(ROOT, p) for p in ("bench/results/specbench_trained.json",
                                                              "bench/results/specbench_trained_int4.json")]
    parts = []
    for i, path in enumerate(files):
        with open(path) as f:
            md = render_markdown(json.load(f))
        cut = "\n- losslessness" if i == 0 else "\nDecode tokens/s per category"
        parts.append(md.split(cut)[0].strip())
    extra = [("Router calibration (`whiflash bench --calibrate-router`, on the small workload, not Spec-Bench):",
              "bench/results/router_calibration.json", calibration_markdown),
             ("Drafter cost per proposal (`bench/drafter_step.py`):", "bench/results/drafter_step.json",
              drafter_step_markdown)]
    for title, rel, render in extra:
        if os.path.exists(os.path.join(ROOT, rel)):
            parts.append(title + "\n\n" + render(os.path.join(ROOT, rel)))
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
