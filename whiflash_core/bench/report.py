"""Presenting results: text and Markdown tables (same rows, two renderings), the PNG chart,
and the machine / git description stored in every results file.

Everything here reads the results JSON shape written by `cli.py`, so a committed results file
can be re-rendered (`whiflash bench --markdown FILE`) without rerunning anything.
"""
from __future__ import annotations

import os
import platform
import subprocess

from .stats import ALL, BASELINE

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- environment ------------------------------------------------------------------------------


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def llama_cpp_info() -> dict | None:
    """llama-cpp-python's version and the CPU features its ggml build uses (a bench peer's build
    decides its kernels: a GGML_NATIVE build on an AVX-512 machine is not an AVX2 peer)."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        import llama_cpp

        return {"version": llama_cpp.__version__, "location": os.path.dirname(llama_cpp.__file__),
                "system_info": llama_cpp.llama_print_system_info().decode().strip()}
    except Exception as exc:  # a broken optional peer must not break the report
        return {"error": repr(exc)}


def machine_info(dtype: str, threads: int) -> dict:
    import torch
    import transformers

    flags = (_cpuinfo_field("flags") or "").split()
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu": _cpuinfo_field("model name") or platform.processor() or "unknown",
        "cores": os.cpu_count(),
        "cpu_flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
        "cpu_flags_all": " ".join(flags),  # what lscpu prints as Flags
        # the kernels torch dispatches to, and any forced with ATEN_CPU_CAPABILITY & co
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "forced_isa": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                   "MKL_ENABLE_INSTRUCTIONS") if k in os.environ},
        "memory_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": dtype,
        "threads": threads,
        "llama_cpp": llama_cpp_info(),
    }


def git_info() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", "-C", REPO_ROOT, *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD") or None
    return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


# -- tables -----------------------------------------------------------------------------------


def _f(value, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if value is None else fmt.format(value)


def _pct(value) -> str:
    return _f(None if value is None else 100 * value, "{:.0f}%")


def methods_of(results: dict) -> list[str]:
    return list(dict.fromkeys(s["method"] for s in results["summary"]))


def categories_of(results: dict) -> list[str]:
    return list(dict.fromkeys(s["category"] for s in results["summary"]))


def _lookup(results: dict) -> dict:
    return {(s["category"], s["method"]): s for s in results["summary"]}


def overall_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """One row per method over all categories."""
    headers = ["method", "tok/s decode", "tok/s e2e", "x none decode", "x none e2e", "acc. len",
               "draft ms/rd", "verify ms/rd", "catch-up ms/rd", "router ms/rd", "rounds by drafter", "switches/req",
               "identical", "prefix agree"]
    http = any(s.get("gateway_overhead_ms") is not None for s in results["summary"])
    if http:
        headers.append("gateway ms/req")
    rows = []
    for s in results["summary"]:
        if s["category"] != ALL:
            continue
        ms = s.get("ms_per_round") or {}
        row = [s["method"], _f(s["decode_tps"]), _f(s["e2e_tps"]), _f(s["ratio_decode"], "{:.2f}x"),
               _f(s["ratio_e2e"], "{:.2f}x"), _f(s["acceptance_length"], "{:.2f}"),
               _f(ms.get("draft"), "{:.2f}"), _f(ms.get("verify"), "{:.2f}"), _f(ms.get("catch_up"), "{:.2f}"),
               router_cell(ms), round_share(s.get("round_share")),
               _f(s["switches_per_prompt"], "{:.1f}") if s["method"] == "whiflash" else "-",
               _pct(s["identical_fraction"]) if s["method"] != BASELINE else "(ref)",
               _pct(s["prefix_agreement"]) if s["method"] != BASELINE else "(ref)"]
        if http:
            row.append(_f(s.get("gateway_overhead_ms")))
        rows.append(row)
    return headers, rows


def router_cell(ms: dict) -> str:
    """"0.61 (1.5%)": the router's ms per round and its share of the round (router, catch-up,
    draft, verify): what routing itself costs, the learned policy's MLP included."""
    if ms.get("router") is None:
        return "-"
    total = sum(ms.get(k) or 0.0 for k in ("router", "catch_up", "draft", "verify"))
    share = f" ({100 * ms['router'] / total:.1f}%)" if total > 0 else ""
    return f"{ms['router']:.2f}{share}"


def round_share(share: dict | None) -> str:
    """"eagle3 61%, ngram 30%, plain 9%": each drafter's share of the method's rounds."""
    if not share:
        return "-"
    return ", ".join(f"{name} {v:.0%}" for name, v in sorted(share.items(), key=lambda kv: -kv[1]))


def speed_key(results: dict) -> str:
    """decode_tps, or e2e_tps when no run could time its decode (HTTP without server timing)."""
    return "decode_tps" if any(s.get("decode_tps") for s in results["summary"]) else "e2e_tps"


def speed_title(results: dict) -> str:
    return "Decode tokens/s" if speed_key(results) == "decode_tps" else "End-to-end tokens/s"


def category_rows(results: dict, key: str) -> tuple[list[str], list[list[str]]]:
    """Categories x methods. key = "decode_tps" / "e2e_tps" (with the ratio to none) or "acceptance_length"."""
    table = _lookup(results)
    methods = methods_of(results)
    if key == "acceptance_length":
        methods = [m for m in methods if any(table.get((c, m), {}).get(key) for c in categories_of(results))]
    headers = ["category", "prompts"] + methods
    rows = []
    for c in categories_of(results):
        first = next((table[(c, m)] for m in methods if (c, m) in table), None)
        row = [c, str(first["prompts"]) if first else "-"]
        for m in methods:
            s = table.get((c, m))
            if s is None:
                row.append("-")
            elif key in ("decode_tps", "e2e_tps"):
                ratio = s.get("ratio_decode" if key == "decode_tps" else "ratio_e2e")
                cell = _f(s[key])
                if m != BASELINE and ratio is not None:
                    cell += f" ({ratio:.2f}x)"
                row.append(cell)
            else:
                row.append(_f(s.get(key), "{:.2f}"))
        rows.append(row)
    return headers, rows


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    align = ["---"] + ["---:"] * (len(headers) - 1)   # numbers right-aligned
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def setup_line(results: dict) -> str:
    m, c, g = results["machine"], results["config"], results.get("git") or {}
    commit = (g.get("commit") or "unknown")[:10] + ("+dirty" if g.get("dirty") else "")
    return (f"{c['workload_name']}: {c['prompts']} prompts, max {c['max_tokens']} tokens, {c['repeats']} repeat(s), "
            f"{c['mode']}, {m['dtype']}{' int4 weights' if c.get('weights') == 'int4' else ''}, "
            f"{m['threads']} thread(s), drafters: {c['drafters']}; "
            f"{m['cpu']} ({m['cores']} cores{isa_note(m)}), torch {m['torch']}, transformers {m['transformers']}, "
            f"commit {commit}")


def isa_note(machine: dict) -> str:
    """', ISA ...; torch kernels ... (forced ...)' from a results file's machine description ('' in
    files from before it recorded them)."""
    flags, kernels, forced = machine.get("cpu_flags"), machine.get("torch_cpu_capability"), machine.get("forced_isa")
    note = f", ISA {' '.join(flags)}" if flags else ""
    note += f"; torch kernels {kernels}" if kernels else ""
    if forced:
        note += " (forced: " + " ".join(f"{k}={v}" for k, v in forced.items()) + ")"
    return note


def agreement_lines(results: dict) -> list[str]:
    agr = results.get("agreement") or {}
    lines = [f"losslessness vs none ({agr.get('unit', 'tokens')}): " + (
        "all methods identical on every prompt" if agr.get("all_identical")
        else f"{len(agr.get('mismatches', []))} mismatching (prompt, method) pair(s)"
        + (" -- a BUG in " + results["machine"]["dtype"] if agr.get("strict") else
           " (bf16: k-token and 1-token forwards round differently; near-ties may flip)"))]
    for mm in agr.get("mismatches", [])[:20]:
        lines.append(f"  prompt {mm['prompt']} ({mm['category']}) {mm['method']}: first difference at "
                     f"{mm['first_diff']} of {mm['length']} vs {mm['baseline_length']} {mm['unit']}")
    return lines


def render_text(results: dict) -> str:
    parts = [setup_line(results), "", "All categories:", text_table(*overall_rows(results)), "",
             f"{speed_title(results)} per category (ratio to none):",
             text_table(*category_rows(results, speed_key(results))), "",
             "Acceptance length per category (tokens per target forward):",
             text_table(*category_rows(results, "acceptance_length")), ""]
    parts += agreement_lines(results)
    parts += [f"note: {n}" for n in results.get("notes", [])]
    return "\n".join(parts)


def render_markdown(results: dict) -> str:
    parts = [f"_{setup_line(results)}_", "", markdown_table(*overall_rows(results)), "",
             f"{speed_title(results)} per category (ratio to `none`):", "",
             markdown_table(*category_rows(results, speed_key(results))), "",
             "Acceptance length per category:", "", markdown_table(*category_rows(results, "acceptance_length")), ""]
    parts += [f"- {line.strip()}" for line in agreement_lines(results)]
    parts += [f"- {n}" for n in results.get("notes", [])]
    source = results["config"].get("out") or "a results JSON"
    parts += ["", f"<sub>Generated by `whiflash bench --markdown` from `{source}`; "
              f"command: `{results['command']}`</sub>"]
    return "\n".join(parts)


# -- chart ------------------------------------------------------------------------------------


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = _lookup(results)
    cats = categories_of(results)
    methods = methods_of(results)
    al_methods = [m for m in methods if any((table.get((c, m)) or {}).get("acceptance_length") for c in cats)]
    fig, axes = plt.subplots(2, 1, figsize=(min(16, max(8, 0.25 * len(cats) * len(methods))), 8), sharex=True)
    for ax, key, ms, label in ((axes[0], speed_key(results), methods, speed_title(results).lower()),
                               (axes[1], "acceptance_length", al_methods, "acceptance length")):
        width = 0.8 / max(1, len(ms))
        for i, m in enumerate(ms):
            xs = [j + (i - (len(ms) - 1) / 2) * width for j in range(len(cats))]
            ys = [(table.get((c, m)) or {}).get(key) or 0.0 for c in cats]
            ax.bar(xs, ys, width, label=m)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=min(len(methods), 4), fontsize=8)
    axes[1].set_xticks(range(len(cats)))
    axes[1].set_xticklabels(cats, rotation=30, ha="right")
    m = results["machine"]
    axes[0].set_title(f"{results['config']['workload_name']} - {m['dtype']}, {m['threads']} thread(s), "
                      f"drafters: {results['config']['drafters']}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
