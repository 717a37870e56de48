"""The training loop both trainers run (`whiflash train eagle3` / `whiflash train dflash`),
parameterised by a `DrafterTask` (task.py). The pieces, one module each:

    data.py       distilled samples -> Examples, draft vocabulary, epochs packed into batches
    features.py   frozen target forward (taps, final hidden, argmax), cached on disk
    task.py       the DrafterTask interface and the helpers both trainers share
    logs.py       JSONL records and the loss plot
    loop.py       settings, optimiser (AdamW (0.9, 0.95); warm-up then cosine / constant / wsd),
                  checkpoints (model + optimiser + data position + RNG, atomic) and the loop

Output directory (`--out DIR`, shareable by both trainers):

    DIR/{name}.ckpt.pt      training state (resume with --resume)
    DIR/{name}.log.jsonl    train and val records (logs.py)
    DIR/{name}.loss.png     loss / accuracy curves
    DIR/{name}/             the drafter in its published layout (what `--drafters DIR` loads)
    DIR/features/           cached target features (unless --feature-cache none)

`--init-from DRAFTER` starts from a shipped or exported drafter instead of a random init
(init_from.py); exports then count its steps, tokens and hours into cumulative totals.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..cli_args import from_args, setting
from ..machine import cpu_info
from ..target import TargetModel
from .data import (Example, build_draft_vocab, data_dirs, load_examples, parse_repeats, pick_val, plan_epoch,
                   repeat_sources, step_generator, vocab_coverage)
from .features import FeatureStore
from .init_from import InitDrafter, grow_vocab, load_init, totals
from .logs import MetricsLog, plot_log, read_log
from .task import DrafterTask, Item, slot_counts


# --------------------------------------------------------------------------- settings

@dataclass
class TrainSettings:
    """Settings shared by both trainers (each trainer subclasses this with its own). The
    `whiflash train` flags are generated from these fields (cli_args.py)."""
    data: str = setting(help="distilled data directories (`whiflash train distill --out`), comma-separated; "
                        "train and val splits are their union")
    out: str = setting(help="output directory (checkpoint, logs, plot, exported drafter)")
    steps: int = setting(2000, "optimizer steps (the schedule's length)")
    lr: float = setting(5e-4, "peak learning rate")
    warmup: int = setting(50, "linear warm-up steps")
    schedule: str = setting("cosine", "after warm-up: cosine to lr*min-lr-ratio, constant, or constant then a "
                            "linear decay over the last --decay-frac of the steps",
                            choices=["cosine", "constant", "wsd"])
    min_lr_ratio: float = setting(0.1, "cosine / wsd end at lr * min-lr-ratio")
    decay_frac: float = setting(0.2, "wsd: fraction of steps spent decaying")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    clip: float = setting(0.5, "gradient-norm clip")
    batch_tokens: int = setting(4096, "prompt+response tokens per batch")
    max_len: int = setting(2048, "longer sequences are truncated")
    draft_vocab: int = setting(8192, "reduced head: the N most frequent response tokens of the train split")
    freeze_head: bool = setting(False, "keep the reduced LM head at its initialisation (the target's rows)")
    threads: int = setting(1, "torch threads")
    seed: int = setting(0, "initialisation and data order")
    log_every: int = setting(10, "steps between train records")
    val_every: int = setting(200, "steps between validations (and exports)")
    val_samples: int = setting(64, "val sequences, round-robin over sources (0 = the whole val split)")
    ckpt_every: int = setting(50, "steps between checkpoints")
    resume: bool = setting(False, "continue from DIR's checkpoint")
    init_from: str | None = setting(None, "start a new run from this shipped/exported drafter (same kind): its "
                                    "weights, draft vocabulary and architecture (overriding --draft-vocab, "
                                    "--layers, --taps...); exports count its steps, tokens and hours in")
    grow_vocab: int | None = setting(None, "with --init-from: widen its draft vocabulary to N rows with the most "
                                     "frequent response tokens of the train split it lacks (its trained rows "
                                     "kept, new rows from the target's LM head)")
    feature_cache: str | None = setting(None, "directory for cached target features (default DIR/features; "
                                        "'none' = off)")
    model: str | None = setting(None, "target HF directory (default: embedded SmolLM2)")
    target_dtype: str = setting("bfloat16", "target dtype", choices=["bfloat16", "float32"])
    autocast: bool = setting(True, "train in float32 instead of under bf16 autocast (a bf16 matmul is ~4x "
                             "fp32 here)", flag="--no-autocast")
    exclude_sources: str = setting("", "comma-separated sources to leave out of the train split (e.g. CC BY-NC "
                                   "data for weights that ship); the val split stays whole")
    repeat_sources: str = setting("", "comma-separated SOURCE=N: each sample of SOURCE comes N times an epoch "
                                  "(weights a kind of text the drafter is weak at)")
    stop_at: int | None = setting(None, "tests: leave after this step without a final save (a 'kill')", hidden=True)

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        return from_args(cls, args)


# --------------------------------------------------------------------------- optimiser

def make_optimizer(params: list[nn.Parameter], s: TrainSettings) -> torch.optim.Optimizer:
    # EAGLE-3's betas; weight decay 0 as in its DeepSpeed config
    return torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)


def lr_at(step: int, s: TrainSettings) -> float:
    """Learning rate for optimiser step `step` (0-based)."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    low = s.lr * s.min_lr_ratio
    if s.schedule == "constant":
        return s.lr
    if s.schedule == "wsd":
        decay_start = int(s.steps * (1 - s.decay_frac))
        if step < decay_start:
            return s.lr
        frac = (step - decay_start) / max(s.steps - decay_start, 1)
        return s.lr + (low - s.lr) * min(frac, 1.0)
    frac = min((step - s.warmup) / max(s.steps - s.warmup, 1), 1.0)
    return low + (s.lr - low) * 0.5 * (1 + math.cos(math.pi * frac))


# --------------------------------------------------------------------------- checkpoints

def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """torch.save into a temp file, fsync, rename: a kill leaves the previous checkpoint intact."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


# --------------------------------------------------------------------------- the loop

TaskFactory = Callable[[TargetModel, torch.Tensor, TrainSettings, "dict[str, Any] | None"], DrafterTask]


class _StopFlag:
    """SIGINT/SIGTERM ask the loop to checkpoint after the current step and leave."""

    def __init__(self):
        self.set = False
        self._old: dict[int, Any] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not in the main thread (e.g. some test runners)
                pass
        return self

    def _handle(self, signum, frame):
        if self.set:  # a second signal: leave now
            raise KeyboardInterrupt
        self.set = True
        print("\nstop requested: checkpointing after this step", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _load_target(s: TrainSettings) -> TargetModel:
    from ..loading import load_target

    target, _ = load_target(s.model, s.target_dtype)
    return target


def _validate(task: DrafterTask, store: FeatureStore, val: list[Example], s: TrainSettings, step: int,
              log: MetricsLog, t_start: float) -> dict[str, Any]:
    task.model.eval()
    items = [Item(e, store(e, pin=True)) for e in val]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.autocast):
        metrics = task.evaluate(items)
    task.model.train()
    record = {"kind": "val", "step": step, **metrics, "elapsed_s": round(time.time() - t_start, 1)}
    log.write(record)
    print(f"[{task.name}] val step {step}: loss {metrics['loss']:.4f} acc "
          f"{' '.join(f'{a:.3f}' for a in metrics['acc'])} tau {metrics['tau']:.3f} (tau@4 {metrics['tau4']:.3f})",
          file=sys.stderr, flush=True)
    return record


@dataclass
class _Position:
    """Where the loop is in the data: saved in every checkpoint, so a resumed run goes on exactly."""
    step: int
    epoch: int
    batch_i: int
    plan: list[list[str]]     # this epoch's batches of example ids
    tokens: int = 0           # prompt + response tokens trained on so far


def tokens_seen(ckpt: dict[str, Any]) -> int:
    """Prompt + response tokens a checkpoint's run has trained on. Checkpoints from before the
    loop counted them: whole epochs of the (filtered) train split plus the batches already taken
    from the current epoch's plan (exact unless the data grew between epochs)."""
    if "tokens" in ckpt:
        return ckpt["tokens"]
    s = ckpt["settings"]
    examples = load_examples(s["data"], "train", s["max_len"], s.get("exclude_sources", ""))
    length = {e.id: e.length for e in examples}
    per_epoch = sum(length.values())
    current = sum(length[i] for batch in ckpt["plan"][:ckpt["batch_i"]] for i in batch)
    return ckpt["epoch"] * per_epoch + current


class _Window:
    """Train-record figures accumulated since the last record."""

    def __init__(self, task: DrafterTask, store: FeatureStore):
        self.task, self.store = task, store
        self.counts = slot_counts(task.n_slots)
        self.loss = self.gnorm = 0.0
        self.steps = self.tokens = 0
        self.t0, self.feat_s = time.time(), store.seconds

    def add(self, loss: float, gnorm: float, tokens: int) -> None:
        self.loss += loss
        self.gnorm += gnorm
        self.steps += 1
        self.tokens += tokens

    def pause(self, t_aside: float, feat_aside: float) -> None:
        """Leave validation and checkpoint time (since t_aside) out of the throughput figures."""
        self.t0 += time.time() - t_aside
        self.feat_s += self.store.seconds - feat_aside

    def record(self, step: int, epoch: int, lr: float, t_start: float) -> dict[str, Any]:
        dt = time.time() - self.t0
        n = self.counts["n"].clamp(min=1)
        return {
            "kind": "train", "step": step, "epoch": epoch, "lr": lr,
            "loss": self.loss / self.steps,
            "ce": (self.counts["ce"] / n).round(decimals=4).tolist(),
            "acc": (self.counts["correct"] / n).round(decimals=4).tolist(),
            "grad_norm": round(self.gnorm / self.steps, 4),
            "positions_per_s": round(float(self.counts["n"][0]) / dt, 1),
            "labels_per_s": round(float(self.counts["n"].sum()) / dt, 1),
            "tokens_per_s": round(self.tokens / dt, 1),
            "target_s_frac": round((self.store.seconds - self.feat_s) / dt, 3),
            "elapsed_s": round(time.time() - t_start, 1),
        }


def _train_step(task: DrafterTask, opt: torch.optim.Optimizer, params: list[nn.Parameter], store: FeatureStore,
                batch: list[Example], s: TrainSettings, step: int, counts: dict[str, torch.Tensor]) -> tuple[float, float]:
    """One optimiser step over a batch, accumulated sequence by sequence: (loss, grad norm); each
    sequence's per-slot counts are added to `counts`."""
    lr = lr_at(step, s)
    for group in opt.param_groups:
        group["lr"] = lr
    items = [Item(e, store(e)) for e in batch]
    norm = task.prepare(items, step_generator(s.seed, step))
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for item in items:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.autocast):
            loss, item_counts = task.loss(item, norm)
        if loss.requires_grad:
            loss.backward()
        total += float(loss.detach())
        for k in counts:
            counts[k] += item_counts[k]
    gnorm = float(torch.nn.utils.clip_grad_norm_(params, s.clip))
    opt.step()
    return total, gnorm


def _warn_dropped_exclusions(prior: dict[str, Any], exclude: str, say: Callable[[str], None]) -> None:
    """Earlier runs left some sources out (licences of weights that ship): say so when this run
    would train on them, since --exclude-sources is not inherited with the weights."""
    now = {x.strip() for x in exclude.split(",") if x.strip()}
    before = {x.strip() for r in prior["lineage"] for x in r.get("exclude_sources", "").split(",") if x.strip()}
    if before - now:
        say(f"warning: earlier runs of these weights excluded {','.join(sorted(before - now))}; "
            "this run trains on them (pass --exclude-sources to keep them out)")


def train(factory: TaskFactory, name: str, s: TrainSettings, target: TargetModel | None = None,
          quiet: bool = False) -> dict[str, Any]:
    """Train (or resume) one drafter; returns a summary. `target` may be passed in (tests)."""
    torch.set_num_threads(s.threads)
    try:
        parse_repeats(s.repeat_sources)  # a malformed spec fails before the target loads
    except ValueError as e:
        raise SystemExit(str(e)) from None

    def epoch_plan(examples: list[Example], epoch: int) -> list[list[str]]:
        try:
            return plan_epoch(repeat_sources(examples, s.repeat_sources), s.batch_tokens, s.seed, epoch)
        except ValueError as e:  # a --repeat-sources source with no samples
            raise SystemExit(str(e)) from None

    os.makedirs(s.out, exist_ok=True)
    ckpt_path = os.path.join(s.out, f"{name}.ckpt.pt")
    log_path = os.path.join(s.out, f"{name}.log.jsonl")
    png_path = os.path.join(s.out, f"{name}.loss.png")
    export_dir = os.path.join(s.out, name)

    ckpt = None
    if os.path.exists(ckpt_path):
        if not s.resume:
            raise SystemExit(f"{ckpt_path} exists: pass --resume to continue it, or use another --out")
        ckpt = load_checkpoint(ckpt_path)

    if target is None:
        target = _load_target(s)
    target.requires_grad_(False)  # the drafter shares its embedding; never train it

    train_set = load_examples(s.data, "train", s.max_len, s.exclude_sources)
    val_set = pick_val(load_examples(s.data, "val", s.max_len), s.val_samples)
    if not train_set:
        raise SystemExit(f"no training samples in {s.data}")

    init: InitDrafter | None = None
    if ckpt is not None:
        vocab_ids, coverage = ckpt["vocab_ids"], ckpt["vocab_coverage"]
        config = ckpt["config"]
        prior = ckpt.get("prior")
    elif s.init_from:
        # the init drafter's vocabulary and shapes, so its weights load one to one
        init = load_init(s.init_from, name, target)
        if s.grow_vocab:
            init = grow_vocab(init, train_set, s.grow_vocab, target)
        vocab_ids, config, prior = init.vocab_ids, init.config, init.prior
        coverage = vocab_coverage(train_set, vocab_ids, target.cfg.vocab_size)
    elif s.grow_vocab:
        raise SystemExit("--grow-vocab widens the head of an --init-from drafter; without one use --draft-vocab")
    else:
        vocab_ids, coverage = build_draft_vocab(train_set, s.draft_vocab, target.cfg.vocab_size)
        config, prior = None, None
        torch.manual_seed(s.seed)  # initialisation
    task = factory(target, vocab_ids, s, config)
    params = task.trainable(s.freeze_head)
    opt = make_optimizer(params, s)
    n_params = sum(p.numel() for p in params)

    cache_dir = None if s.feature_cache == "none" else (s.feature_cache or os.path.join(s.out, "features"))
    store = FeatureStore(target, task.tap_layers, task.need_hidden, cache_dir)

    if ckpt is not None:
        task.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        pos = _Position(ckpt["step"], ckpt["epoch"], ckpt["batch_i"], ckpt["plan"], tokens_seen(ckpt))
        wall0 = ckpt.get("wall_s", 0.0)
        machines = ckpt.get("machines", [])
    else:
        if init is not None:
            task.load_state_dict(init.state)
        pos = _Position(0, 0, 0, epoch_plan(train_set, 0))
        wall0 = 0.0
        machines = []
    # the CPUs this run has trained on, for the model card (a run resumes across sessions and machines)
    here = f"{cpu_info()['cpu']}, {os.cpu_count()} cores"
    machines = machines + [here] if here not in machines else machines
    log = MetricsLog(log_path, keep_until=pos.step if ckpt is not None else None)
    by_id = {e.id: e for e in train_set}
    missing = [i for b in pos.plan for i in b if i not in by_id]
    if missing:
        raise SystemExit(f"{len(missing)} samples of the checkpoint's epoch are gone from {s.data}")

    say = (lambda *a: None) if quiet else (lambda msg: print(f"[{name}] {msg}", file=sys.stderr, flush=True))
    if prior and ckpt is None:
        _warn_dropped_exclusions(prior, s.exclude_sources, say)
    say(f"{len(train_set)} train / {len(val_set)} val sequences; draft vocab {len(vocab_ids)} covers "
        f"{coverage:.1%} of response tokens; {n_params / 1e6:.2f} M trainable parameters; "
        f"{'resuming at step ' + str(pos.step) if ckpt is not None else 'starting'}"
        f"{' from ' + prior['init_from'] + ' (' + str(prior['steps']) + ' steps before)' if prior else ''}")

    def checkpoint() -> None:
        save_checkpoint(ckpt_path, {
            "name": name, **asdict(pos),
            "model": task.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
            "config": task.config(), "vocab_ids": vocab_ids, "vocab_coverage": coverage,
            "settings": asdict(s), "wall_s": wall0 + time.time() - t_start, "prior": prior,
            "machines": machines,
        })

    def export() -> None:
        hours = (wall0 + time.time() - t_start) / 3600
        task.export(export_dir, {"whiflash_training": {
            "step": pos.step, "data": [os.path.abspath(d) for d in data_dirs(s.data)],
            "exclude_sources": s.exclude_sources, "repeat_sources": s.repeat_sources,
            "train_sequences": len(train_set),
            "draft_vocab_coverage": round(coverage, 4), "last_val": last_val,
            **totals(prior, pos.step, pos.tokens, hours)}})

    t_start = time.time()
    vals = [r for r in read_log(log_path) if r["kind"] == "val"] if ckpt is not None else []
    last_val: dict[str, Any] | None = vals[-1] if vals else None
    window = _Window(task, store)
    task.model.train()
    with _StopFlag() as stop:
        while pos.step < s.steps:
            if pos.batch_i >= len(pos.plan):  # new epoch: pick up samples distilled since the last one
                pos.epoch, pos.batch_i = pos.epoch + 1, 0
                train_set = load_examples(s.data, "train", s.max_len, s.exclude_sources)
                by_id = {e.id: e for e in train_set}
                pos.plan = epoch_plan(train_set, pos.epoch)
            batch = [by_id[i] for i in pos.plan[pos.batch_i]]
            pos.batch_i += 1
            loss, gnorm = _train_step(task, opt, params, store, batch, s, pos.step, window.counts)
            lr = lr_at(pos.step, s)
            pos.step += 1
            pos.tokens += sum(e.length for e in batch)
            step = pos.step
            window.add(loss, gnorm, sum(e.length for e in batch))

            if step % s.log_every == 0 or step == s.steps:
                record = window.record(step, pos.epoch, lr, t_start)
                log.write(record)
                say(f"step {step} lr {lr:.2e} loss {record['loss']:.4f} acc0 {record['acc'][0]:.3f} "
                    f"{record['positions_per_s']:.0f} pos/s (target {record['target_s_frac']:.0%})")
                window = _Window(task, store)

            if s.stop_at is not None and step >= s.stop_at:
                return {"step": step, "stopped": True}
            t_aside, feat_aside = time.time(), store.seconds  # val and checkpoints are not training time
            if val_set and (step % s.val_every == 0 or step == s.steps):
                last_val = _validate(task, store, val_set, s, step, log, t_start)
                export()
                plot_log(log_path, png_path, f"{name}: {len(train_set)} sequences")
            if step % s.ckpt_every == 0 or step == s.steps or stop.set:
                checkpoint()
            window.pause(t_aside, feat_aside)
            if stop.set:
                say(f"stopped at step {step}; continue with --resume")
                return {"step": step, "stopped": True}

    if last_val is None and val_set:  # a run of 0 steps: the starting point's validation (the baseline
        last_val = _validate(task, store, val_set, s, pos.step, log, t_start)  # a new version must beat)
    export()
    plot_log(log_path, png_path, f"{name}: {len(train_set)} sequences")
    say(f"done: {pos.step} steps in {time.time() - t_start:.0f} s; drafter saved to {export_dir}")
    return {"step": pos.step, "stopped": False, "last_val": last_val, "export": export_dir}
