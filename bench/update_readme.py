"""Regenerate the README's results section from committed results files (never typed by hand).

    .venv/bin/python bench/update_readme.py [RESULTS.json ...]

Replaces the text between `<!-- results:start -->` and `<!-- results:end -->` in README.md with
`whiflash bench --markdown` tables of the given Spec-Bench results (the first one with its
per-category tables, the others overall only), the router calibration, the drafter step costs and
the verify-cost curve.
"""
from __future__ import annotations

import glob
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
    floor = r.get("bf16_weight_stream_floor")
    if floor:
        lines.append(f"Streaming the {floor['bf16_weight_bytes'] / 1e6:.0f} MB of bf16 linear weights once (one GEMV, "
                     f"{floor['gb_per_s']:.1f} GB/s) takes {floor['stream_ms']:.1f} ms: no bf16 decode step here can be "
                     f"faster, i.e. at most {1000 / floor['stream_ms']:.0f} tokens/s.")
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


def sweep_markdown(paths: list[str]) -> str:
    """One row per sweep run: the drafting method's length setting against `none` in that run."""
    lines = ["| run | method | draft length | acc. len | tok/s | x none (same run) | draft / verify ms per round |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        rows = {s["method"]: s for s in r["summary"] if s["category"] == "all"}
        cfg = r["config"]
        for method, s in rows.items():
            if method == "none":
                continue
            length = f"k={cfg['num_draft_tokens']}" if method == "eagle3" else f"block {cfg['block_size']}"
            ms = s["ms_per_round"]
            lines.append(f"| {os.path.basename(path)} | {method} | {length} | {s['acceptance_length']:.2f} | "
                         f"{s['decode_tps']:.1f} | {s['ratio_decode']:.2f}x | {ms['draft']:.2f} / {ms['verify']:.2f} |")
    return "\n".join(lines)


def runner_before_after_markdown(before_path: str, after_path: str) -> str:
    """The target runner before and after session 3's work: two back-to-back verify_curve runs."""
    with open(before_path) as f:
        b = json.load(f)
    with open(after_path) as f:
        a = json.load(f)
    lines = [f"_before: commit {b['git_commit']}, after: commit {a['git_commit']}; the same script on the same "
             "machine in one session (separate runs, so compare ratios more than absolute ms)_", "",
             "| format | T(1) ms before -> after | T(4) ms | T(16) ms | plain decode tok/s |",
             "|---|---:|---:|---:|---:|"]
    for name in a["verify_ms"]:
        if name not in b["verify_ms"]:
            continue
        cells = [f"{b['verify_ms'][name][k]:.1f} -> {a['verify_ms'][name][k]:.1f}" for k in ("1", "4", "16")]
        dec = f"{b['plain_decode_tokens_per_s'][name]:.1f} -> {a['plain_decode_tokens_per_s'][name]:.1f}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {dec} |")
    return "\n".join(lines)


def compile_probe_markdown(path: str) -> str:
    with open(path) as f:
        r = json.load(f)
    lines = [f"_`{r['command']}` (torch {r['torch']}, {r['context_tokens']}-token cache)_", "",
             "| format | k | eager ms | torch.compile ms | compiled argmax same |", "|---|---:|---:|---:|---|"]
    for res in r["results"]:
        for row in res["rows"]:
            lines.append(f"| {res['format']} | {row['k']} | {row['eager_ms']:.1f} | {row['compiled_ms']:.1f} | "
                         f"{'yes' if row['same_argmax'] else 'no'} |")
    return "\n".join(lines)


def main() -> None:
    # default: the Spec-Bench run the README's section shows (its lead-in names the same file)
    files = sys.argv[1:] or [os.path.join(ROOT, f"bench/results/{name}.json") for name in
                             ("specbench_l3_xeon_s16", "specbench_l3_xeon_avx2_s16", "specbench_l3_zen3_s14")]
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
    sweeps = sorted(glob.glob(os.path.join(ROOT, "bench/results/sweep_int4_*.json")))
    if sweeps:
        parts.append("Draft length with the int4 target (`whiflash bench --workload bench/workload_small.jsonl "
                     "--weights int4 --methods none,eagle3|dflash --max-tokens 128 --num-draft-tokens K | "
                     "--block-size B`; the int4 kernel works in blocks of 4 rows, so verifying more than 4 "
                     "tokens costs a second block):\n\n" + sweep_markdown(sweeps))
    curve = os.path.join(ROOT, "bench/results/verify_curve.json")
    if os.path.exists(curve):
        parts.append("Verify cost curve T(k) (one forward over k new tokens, 300-token context):\n\n"
                     + verify_curve_markdown(curve))
    probe = os.path.join(ROOT, "bench/results/compile_probe.json")
    if os.path.exists(probe):
        with open(probe) as f:
            rows = [row for res in json.load(f)["results"] for row in res["rows"]]
        verdict = ("no: eager was faster in every case, so the engine runs eager"
                   if all(r["compiled_ms"] > r["eager_ms"] for r in rows) else "in some cases (see the table)")
        parts.append(f"Does `torch.compile` (inductor, static shapes, decoder stack) pay on this CPU? {verdict}:\n\n"
                     + compile_probe_markdown(probe))
    before = os.path.join(ROOT, "bench/results/verify_curve_before.json")
    if os.path.exists(curve) and os.path.exists(before):
        parts.append("Target runner before and after the lean-runner work (stacked q/k/v and gate/up matmuls, "
                     "GQA-as-rows attention for few bf16 rows, one-roll RoPE, masks built once):\n\n"
                     + runner_before_after_markdown(before, curve))
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
