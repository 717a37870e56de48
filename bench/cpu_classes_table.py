"""Issue 20's summary table for each CPU class, from the files bench/cpu_classes.sh wrote.

    .venv/bin/python bench/cpu_classes_table.py [native avx2]   # markdown to stdout

Per class: the forward times --weights auto chose from (machine_table_<class>.json), prefill
tokens/s against llama.cpp's on the same GGUF (prefill_probe_<class>.json), and plain and
`whiflash` decode and end-to-end tokens/s against llama.cpp's plain decode on Spec-Bench and the
agentic workload (specbench_<class>.json, agentic_<class>.json). Every ratio is within one run.
"""
from __future__ import annotations

import json
import os
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def overall(bench: dict) -> dict[str, dict]:
    return {r["method"]: r for r in bench["summary"] if r["category"] == "all"}


def class_table(cls: str) -> list[str]:
    table, probe = load(f"machine_table_{cls}.json"), load(f"prefill_probe_{cls}.json")
    m, f = table["machine"], table["formats"]
    forced = " (AVX2 kernels forced: " + " ".join(f"{k}={v}" for k, v in m["forced"].items()) + ")" if m["forced"] else ""
    lines = [f"**{cls}**: {m['cpu']}, ISA {' '.join(m['isa'])}, torch kernels {m['kernels']}{forced}; "
             f"{m['threads']} threads. `--weights auto` chose {f['dtype']} activations with {f['weights']} weights "
             f"(LM head {f['head']}) for decode and verify, {f['prefill_dtype']} dense from {f['prefill_from_rows']} rows.", ""]
    rows = ["1", "4", "8", "16", "32", "128"]
    lines += ["| format | " + " | ".join(f"T({r}) ms" for r in rows) + " |", "|---|" + "---:|" * len(rows)]
    for name, t in table["table"].items():
        if not name.startswith("head:"):
            lines.append(f"| {name} | " + " | ".join(f"{1e3 * t[r]:.1f}" if r in t else "-" for r in rows) + " |")
    ours, peer = probe["prefill_tokens_per_s"]["auto"], probe["llama_cpp"]["prefill_s"]
    lines += ["", "| prefill tokens | ours (auto) tok/s | llama.cpp tok/s | ratio |", "|---:|---:|---:|---:|"]
    for n in ours:
        theirs = int(n) / peer[n]
        lines.append(f"| {n} | {ours[n]:.0f} | {theirs:.0f} | {ours[n] / theirs:.2f}x |")
    lines += ["", "| workload | plain decode | llama.cpp decode | plain / llama.cpp | whiflash decode | "
              "whiflash / llama.cpp decode | whiflash e2e / llama.cpp e2e | best single method | whiflash / best |",
              "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for label, name in (("Spec-Bench (13 prompts)", f"specbench_{cls}.json"), ("agentic (16 prompts)", f"agentic_{cls}.json")):
        s = overall(load(name))
        none, peer_r, wf = s["none"], s["llama_cpp"], s["whiflash"]
        best = max(("eagle3", "dflash", "ngram"), key=lambda k: s[k]["decode_tps"])
        lines.append(f"| {label} | {none['decode_tps']:.1f} | {peer_r['decode_tps']:.1f} | "
                     f"{none['decode_tps'] / peer_r['decode_tps']:.2f}x | {wf['decode_tps']:.1f} | "
                     f"{wf['decode_tps'] / peer_r['decode_tps']:.2f}x | {wf['e2e_tps'] / peer_r['e2e_tps']:.2f}x | "
                     f"{best} {s[best]['decode_tps']:.1f} | {wf['decode_tps'] / s[best]['decode_tps']:.2f}x |")
    return lines


def main(argv: list[str]) -> None:
    for cls in argv or ["native", "avx2"]:
        print("\n".join(class_table(cls)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
