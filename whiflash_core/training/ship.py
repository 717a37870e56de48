"""`whiflash train ship`: copy a trained drafter into the shipped layout and write its model card.

    whiflash train ship --run runs/e3 --name eagle3 --to models/smollm2-135m-instruct \\
        [--bench bench/results/specbench_trained.json] [--num-draft-tokens K] [--draft-vocab N]

Reads everything the card states from files, never from memory: the run's checkpoint (settings,
steps, epochs, wall time), its metrics log (last train and val records), the distillation
manifests of every data directory (sources, licences, token counts), the lineage of runs the
weights continue (`--init-from`: cumulative steps, tokens, hours) and, when given, a `whiflash bench` results file
(acceptance length and speed per Spec-Bench category). Run it once to ship the weights, bench,
then again with `--bench` to put the measured numbers into the card.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from typing import Any

import torch
from safetensors import safe_open

from ..cli_args import command_flags
from ..drafters.checkpoint import MAX_FILE_BYTES, load_state_dict, save_state_dict, weight_files
from .data import build_draft_vocab, data_dirs, load_examples
from .dflash import DFlashSettings
from .eagle3 import Eagle3Settings
from .init_from import totals
from .logs import read_log
from .loop import load_checkpoint, tokens_seen

SETTINGS = {"eagle3": Eagle3Settings, "dflash": DFlashSettings}   # whose flags a card's command may use


def data_table(data: str, excluded: set[str]) -> tuple[list[str], int, int]:
    """Markdown rows (source, licence, data directory, samples, response tokens) of the train
    split actually used, for every directory of the comma-separated `data`."""
    rows, samples, tokens = [], 0, 0
    for data_dir in data_dirs(data):
        with open(os.path.join(data_dir, "manifest.json")) as f:
            manifest = json.load(f)
        by_source = manifest["splits"]["train"]["by_source"]
        for src, c in sorted(by_source.items(), key=lambda kv: -kv[1]["response_tokens"]):
            if src in excluded:
                continue
            licence = manifest["sources"].get(src, {}).get("licence", "?")
            rows.append(f"| {src} | {licence} | {_dir_name(data_dir)} | {c['samples']:,} | {c['response_tokens']:,} |")
            samples += c["samples"]
            tokens += c["response_tokens"]
    return rows, samples, tokens


def _dir_name(data_dir: str) -> str:
    return os.path.basename(os.path.normpath(data_dir))


def lineage_lines(prior: dict[str, Any] | None, ckpt: dict[str, Any]) -> list[str]:
    """Card lines for a run continued from earlier weights (`--init-from`): cumulative totals and
    each earlier run, so the card accounts for all the training and data behind the weights."""
    if not prior:
        return []
    t = totals(prior, ckpt["step"], tokens_seen(ckpt), ckpt["wall_s"] / 3600)
    lines = [f"- Cumulative over {len(prior['lineage']) + 1} runs: {t['cumulative_steps']:,} steps, "
             f"{t['cumulative_tokens']:,} tokens, {t['cumulative_hours']:.2f} h. This run continued the weights "
             f"of `{prior['init_from']}`; the earlier runs, oldest first:"]
    for i, r in enumerate(prior["lineage"], 1):
        filters = f", excluding {r['exclude_sources']}" if r.get("exclude_sources") else ""
        filters += f", repeating {r['repeat_sources']}" if r.get("repeat_sources") else ""
        lines.append(f"  {i}. {r['steps']:,} steps, {r['tokens']:,} tokens, {r['hours']:.2f} h on "
                     f"{', '.join(f'`{_dir_name(d)}`' for d in r['data'])}{filters}"
                     + (f" (from `{r['init_from']}`)" if r.get("init_from") else ""))
    return lines


def bench_table(path: str, method: str) -> list[str]:
    """Per-category rows for `method` from a `whiflash bench` results file."""
    with open(path) as f:
        res = json.load(f)
    rows = [f"Measured by `{res['command']}` ({res['created']}, {res['machine'].get('cpu', '?')}, "
            f"{res['machine'].get('threads', '?')} threads, {res['config'].get('weights', 'dense')} target "
            f"weights, greedy, {res['config']['max_tokens']} new tokens):", "",
            "| category | prompts | acceptance length | tok/s | x plain decode |",
            "|---|---:|---:|---:|---:|"]
    found = False
    for r in res["summary"]:
        if r["method"] != method:
            continue
        found = True
        ratio = "not run" if r["ratio_decode"] is None else f"{r['ratio_decode']:.2f}x"   # no `none` in that run
        rows.append(f"| {r['category']} | {r['prompts']} | {r['acceptance_length']:.2f} | "
                    f"{r['decode_tps']:.1f} | {ratio} |")
    if not found:
        raise SystemExit(f"{path} has no results for method {method!r}")
    return rows


def write_card(run: str, name: str, dest: str, bench: str | None) -> str:
    ckpt = load_checkpoint(os.path.join(run, f"{name}.ckpt.pt"))
    s = ckpt["settings"]
    excluded = {x.strip() for x in s.get("exclude_sources", "").split(",") if x.strip()}
    # the log runs ahead of the checkpoint while training continues: keep what the weights saw
    log = [r for r in read_log(os.path.join(run, f"{name}.log.jsonl")) if r["step"] <= ckpt["step"]]
    train = [r for r in log if r["kind"] == "train"]
    vals = [r for r in log if r["kind"] == "val"]
    with open(os.path.join(dest, "config.json")) as f:
        config = json.load(f)
    exported = config.get("whiflash_training", {}).get("step")
    if exported != ckpt["step"]:
        raise SystemExit(f"{run}/{name} was exported at step {exported} but the checkpoint is at step "
                         f"{ckpt['step']}: let the run finish (it exports at its last step) before shipping")
    files = [os.path.join(dest, f) for f in weight_files(dest) if f.endswith(".safetensors")]
    n_params = 0
    for file in files:
        with safe_open(file, "pt") as f:
            n_params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    size_mb = sum(os.path.getsize(file) for file in files) / 1e6
    in_files = f" in {len(files)} files, each under {MAX_FILE_BYTES / 1e6:.0f} MB" if len(files) > 1 else ""
    rows, n_samples, n_resp = data_table(s["data"], excluded)
    prior = ckpt.get("prior")
    flags = command_flags(SETTINGS[name], s, skip=("resume", "stop_at"))

    lines = [
        f"# {name} drafter for SmolLM2-135M-Instruct",
        "",
        f"Trained by this repository's pipeline (`whiflash train {name}`) on SmolLM2-135M-Instruct's own "
        "answers (self-distillation), in the published layout the loaders also read "
        f"({'speculators EAGLE-3' if name == 'eagle3' else 'z-lab DFlash'} format, bf16 safetensors). "
        "The target's embedding (and, for DFlash, the LM-head rows of the draft vocabulary at init) "
        "is shared with the target and not stored.",
        "",
        f"- Values stored: {n_params / 1e6:.2f} M ({size_mb:.1f} MB{in_files}, bf16 weights plus the d2t/t2d "
        "vocabulary maps).",
        f"- Draft vocabulary: {_vocab_origin(ckpt)} "
        f"({ckpt['vocab_coverage']:.1%} of the train split's response tokens).",
    ]
    pruned = config.get("whiflash_training", {}).get("pruned_draft_vocab")
    if pruned:
        lines.append(f"- Shipped with the {pruned['size']} most frequent of those rows ({pruned['coverage']:.1%} "
                     f"coverage; `whiflash train ship --draft-vocab {pruned['size']}`) to fit the repository's size "
                     "budget; the kept rows are the trained ones. Validation below is of the full trained head, "
                     "the Spec-Bench table of the shipped one.")
    if name == "eagle3":
        lines.append(f"- One decoder layer on fused taps {config.get('eagle_aux_hidden_state_layer_ids')}; "
                     f"training-time test unrolled {s['ttt_steps']} steps (loss weight {s['step_decay']}^k); "
                     f"default chain length {_chain_length(config)} (chosen by measured tokens/s, see below).")
    else:
        # from the config, not the flags: with --init-from the architecture is the init drafter's
        lines.append(f"- {config['num_hidden_layers']} decoder layers, block size {config['block_size']}, target layers "
                     f"{config.get('dflash_config', {}).get('target_layer_ids', '?')}, loss weight "
                     f"exp(-(k-1)/{s.get('gamma')}), {s.get('anchors_per_seq')} random anchors per sequence per step.")
    lines += [
        "",
        "## Training",
        "",
        f"- Steps: {ckpt['step']:,} (epoch {ckpt['epoch']}), tokens seen: {tokens_seen(ckpt):,} "
        f"(prompt + response), wall time: {ckpt['wall_s'] / 3600:.2f} h on {s.get('threads', 1)} CPU thread(s) of "
        + ("; ".join(ckpt["machines"]) if ckpt.get("machines") else "a machine not recorded")
        + " (no GPU; the other cores did other work meanwhile).",
        *lineage_lines(prior, ckpt),
        f"- Command: `whiflash train {name} {flags}`",
        f"- Optimiser: AdamW, lr {s['lr']:g}, {s['schedule']} schedule, warm-up {s['warmup']}, "
        f"clip {s['clip']}, batches of {s['batch_tokens']} tokens, "
        + ("bf16 autocast." if s.get("autocast", True) else "float32 (no autocast)."),
    ]
    if train:
        t = train[-1]
        lines.append(f"- Last train window (step {t['step']}): loss {t['loss']:.3f}, top-1 per draft position "
                     f"{', '.join(f'{a:.2f}' for a in t['acc'])}.")
    if vals:
        v = vals[-1]
        lines.append(f"- Held-apart validation (step {v['step']}, {v['starts']:,} drafting starts, teacher-forced): "
                     f"tau {v['tau']:.2f} (chain of 4: {v['tau4']:.2f}); per-position accuracy "
                     f"{', '.join(f'{a:.2f}' for a in v['acc'])}.")
        lines.append("- Validation tau by source: " + ", ".join(f"{k} {t:.2f}" for k, t in v["tau_by_source"].items())
                     + ".")
    lines += ["", "![loss curve](loss.png)", "", "## Data", "",
              f"{n_samples:,} prompts answered by the target ({n_resp:,} response tokens; "
              f"{', '.join(f'`{d}`' for d in data_dirs(s['data']))}, made by `whiflash train distill`). "
              "Spec-Bench was never used."
              + (f" Left out for licence reasons: {', '.join(sorted(excluded))}." if excluded else "")
              + (f" Repeated within an epoch (SOURCE=times): {s['repeat_sources']}." if s.get("repeat_sources") else "")
              + (" Earlier runs' data: see the lineage above." if prior else ""), "",
              "| source | licence | data | samples | response tokens |", "|---|---|---|---:|---:|", *rows, ""]
    lines += ["## Acceptance on Spec-Bench", ""]
    lines += bench_table(bench, name) if bench else ["Not benchmarked yet (run `whiflash train ship ... --bench FILE`)."]
    lines.append("")
    return "\n".join(lines)


def _vocab_origin(ckpt: dict[str, Any]) -> str:
    n = len(ckpt["vocab_ids"])
    if (ckpt.get("prior") or {}).get("init_from"):
        if ckpt["settings"].get("grow_vocab"):
            return (f"the rows of the drafter it continues, grown to {n} with the most frequent train-split "
                    "response tokens it lacked (`--grow-vocab`; new rows started as the target's LM-head rows)")
        return f"the {n} rows of the drafter it continues"
    return f"{n} most frequent response tokens"


def _record_totals(dest: str, ckpt: dict[str, Any]) -> None:
    """Write the card's own counts into the shipped config's whiflash_training block (the export
    took its wall time a moment before the final checkpoint), so a later --init-from continues
    from exactly the totals the card states."""
    path = os.path.join(dest, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.setdefault("whiflash_training", {}).update(
        totals(ckpt.get("prior"), ckpt["step"], tokens_seen(ckpt), ckpt["wall_s"] / 3600))
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def prune_draft_vocab(dest: str, settings: dict[str, Any], keep: int) -> float:
    """Keep the `keep` most frequent rows of a shipped drafter's reduced head (trained rows, not
    re-initialised), so the file fits the repository's size budget; returns their coverage of the
    train split's response tokens. Frequencies come from the run's own data and filters, ranked
    among the trained rows (for a fresh run those are the top of the same ranking; for an
    --init-from run, the rows it inherited)."""
    cfg_path = os.path.join(dest, "config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    vocab_size = config.get("vocab_size") or config["transformer_layer_config"]["vocab_size"]
    sd = load_state_dict(dest)
    ids = torch.arange(len(sd["d2t"])) + sd["d2t"]  # target id of each draft row
    examples = load_examples(settings["data"], "train", settings["max_len"], settings.get("exclude_sources", ""))
    kept, coverage = build_draft_vocab(examples, keep, vocab_size, within=ids)
    rows = torch.searchsorted(ids, kept)
    sd["lm_head.weight"] = sd["lm_head.weight"][rows]
    sd["d2t"] = kept - torch.arange(keep)
    if "t2d" in sd:
        sd["t2d"] = torch.zeros_like(sd["t2d"])
        sd["t2d"][kept] = True
    save_state_dict(sd, os.path.join(dest, "model.safetensors"))
    config["draft_vocab_size"] = keep
    config.setdefault("whiflash_training", {})["pruned_draft_vocab"] = {
        "trained_size": len(ids), "size": keep, "coverage": round(coverage, 4)}
    with open(cfg_path, "w") as f:
        json.dump(config, f, indent=2)
    return coverage


def _chain_length(config: dict) -> int:
    return config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]


def ship(run: str, name: str, to: str, bench: str | None, num_draft_tokens: int | None = None,
         draft_vocab: int | None = None) -> str:
    src = os.path.join(run, name)
    dest = os.path.join(to, name)
    os.makedirs(dest, exist_ok=True)
    for f in weight_files(dest):   # a re-ship leaves no shard of the version before
        os.remove(os.path.join(dest, f))
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(src, f), os.path.join(dest, f))
    if num_draft_tokens is not None:  # EAGLE-3's default chain length, as the speculators config holds it
        if name != "eagle3":
            raise SystemExit("--num-draft-tokens applies to eagle3 (DFlash drafts its trained block)")
        path = os.path.join(dest, "config.json")
        with open(path) as f:
            config = json.load(f)
        config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = num_draft_tokens
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
    ckpt = load_checkpoint(os.path.join(run, f"{name}.ckpt.pt"))
    _record_totals(dest, ckpt)
    if draft_vocab is not None:
        prune_draft_vocab(dest, ckpt["settings"], draft_vocab)
    weights = os.path.join(dest, "model.safetensors")
    if os.path.getsize(weights) > MAX_FILE_BYTES:   # a wide draft vocabulary: shards, each under the budget
        save_state_dict(load_state_dict(dest), weights, max_file_bytes=MAX_FILE_BYTES)
    shutil.copyfile(os.path.join(run, f"{name}.loss.png"), os.path.join(dest, "loss.png"))
    card = write_card(run, name, dest, bench)
    with open(os.path.join(dest, "README.md"), "w") as f:
        f.write(card)
    return dest


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("ship", help="copy a trained drafter into models/ with its model card",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="the trainer's --out directory")
    p.add_argument("--name", required=True, choices=["eagle3", "dflash"])
    p.add_argument("--to", required=True, help="drafter directory (e.g. models/smollm2-135m-instruct)")
    p.add_argument("--bench", default=None, help="`whiflash bench` results JSON for the acceptance table")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="eagle3: default chain length to write into the shipped config (pick it by measurement)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="keep only this many of the trained draft-vocabulary rows (the most frequent), to fit a size budget")
    p.set_defaults(func=lambda a: print(ship(a.run, a.name, a.to, a.bench, a.num_draft_tokens, a.draft_vocab)))
    return p
