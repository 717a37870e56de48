"""Shared machinery of the drafter trainers (`whiflash train eagle3` / `whiflash train dflash`).

One way to do each thing, used by both trainers:

    data         load_examples()    distilled samples -> Example (prompt + response ids)
    vocabulary   build_draft_vocab() the most frequent response (assistant) tokens
    batching     plan_epoch()       shuffled, then packed up to a token budget
    features     FeatureStore       frozen target forward (taps, final hidden, argmax), cached on disk
    optimiser    make_optimizer() + lr_at()  AdamW (0.9, 0.95); warm-up then cosine / constant / wsd
    state        save_checkpoint() / load_checkpoint()  model + optimiser + data position + RNG, atomic
    logging      MetricsLog (JSONL) + plot_log() (PNG)
    loop         train()            the loop both trainers run, parameterised by a DrafterTask

A trainer is a `DrafterTask`: it builds the drafter, turns a batch into per-sequence work items
(`prepare`), gives one item's loss (`loss`), evaluates teacher-forced accuracy on the val split
(`evaluate`) and exports the published checkpoint (`export`). Sequences are processed one at a
time (the target and the drafter modules use the [T, H] batch-1 layout); a batch is a gradient
accumulation over sequences whose loss normaliser is computed up front (`prepare`), so the
gradient equals that of the whole-batch mean while only one sequence's activations are alive.

Output directory (`--out DIR`, shareable by both trainers):

    DIR/{name}.ckpt.pt      training state (resume with --resume)
    DIR/{name}.log.jsonl    train and val records
    DIR/{name}.loss.png     loss / accuracy curves
    DIR/{name}/             the drafter in its published layout (what `--drafters DIR` loads)
    DIR/features/           cached target features (unless --feature-cache none)

Log records: `kind: train` every --log-every steps with loss (the optimised objective), ce / acc
per slot (EAGLE-3 unroll step, DFlash block slot) on the training positions, positions_per_s
(EAGLE-3 rows / DFlash anchors with a first label, per second of training time), labels_per_s
(loss terms per second) and target_s_frac (share of that time in the target forward: 0 once the
features are cached). `kind: val` with loss, acc per slot against the target's greedy token, tau
(1 + mean leading run of correct drafts: the teacher-forced greedy acceptance length of a chain
started there), tau4 (the same over the first 4 drafts) and tau_by_source.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..target import TargetModel
from .distill import load_distilled


# --------------------------------------------------------------------------- settings

@dataclass
class TrainSettings:
    """Settings shared by both trainers (each trainer subclasses this with its own)."""
    data: str
    out: str
    steps: int = 2000
    lr: float = 5e-4
    warmup: int = 50
    schedule: str = "cosine"          # cosine | constant | wsd (constant, then linear decay)
    min_lr_ratio: float = 0.1         # cosine / wsd end at lr * min_lr_ratio
    decay_frac: float = 0.2           # wsd: fraction of steps spent decaying
    weight_decay: float = 0.0
    clip: float = 0.5
    batch_tokens: int = 4096
    max_len: int = 2048
    draft_vocab: int = 8192
    freeze_head: bool = False
    threads: int = 1
    seed: int = 0
    log_every: int = 10
    val_every: int = 200
    val_samples: int = 64             # 0 = the whole val split
    ckpt_every: int = 50
    resume: bool = False
    feature_cache: str | None = None  # None = DIR/features; "none" = recompute every time
    model: str | None = None          # target (None = embedded SmolLM2-135M-Instruct)
    target_dtype: str = "bfloat16"
    autocast: bool = True             # bf16 autocast for the drafter (a bf16 matmul is ~4x fp32 here)
    exclude_sources: str = ""         # comma-separated train sources to leave out (e.g. non-commercial data)
    stop_at: int | None = None        # tests: leave after this step without a final save (a "kill")

    @classmethod
    def from_args(cls, args: argparse.Namespace):
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def add_common_args(p: argparse.ArgumentParser, lr: float, clip: float) -> None:
    p.add_argument("--data", required=True, help="distilled data directory (`whiflash train distill --out`)")
    p.add_argument("--out", required=True, help="output directory (checkpoint, logs, plot, exported drafter)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (the schedule's length)")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps")
    p.add_argument("--schedule", choices=["cosine", "constant", "wsd"], default="cosine",
                   help="after warm-up: cosine to lr*min-lr-ratio, constant, or constant then a linear "
                        "decay over the last --decay-frac of the steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--decay-frac", type=float, default=0.2)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=clip, help="gradient-norm clip")
    p.add_argument("--batch-tokens", type=int, default=4096, help="prompt+response tokens per batch")
    p.add_argument("--max-len", type=int, default=2048, help="longer sequences are truncated")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="reduced head: the N most frequent response tokens of the train split")
    p.add_argument("--freeze-head", action="store_true",
                   help="keep the reduced LM head at its initialisation (the target's rows)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--val-every", type=int, default=200)
    p.add_argument("--val-samples", type=int, default=64,
                   help="val sequences, round-robin over sources (0 = the whole val split)")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--resume", action="store_true", help="continue from DIR's checkpoint")
    p.add_argument("--feature-cache", default=None,
                   help="directory for cached target features (default DIR/features; 'none' = off)")
    p.add_argument("--model", default=None, help="target HF directory (default: embedded SmolLM2)")
    p.add_argument("--target-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--no-autocast", dest="autocast", action="store_false",
                   help="train in float32 instead of under bf16 autocast")
    p.add_argument("--exclude-sources", default="",
                   help="comma-separated sources to leave out of the train split (e.g. CC BY-NC data "
                        "for weights that ship); the val split stays whole")
    p.add_argument("--stop-at", type=int, default=None, help=argparse.SUPPRESS)


# --------------------------------------------------------------------------- data

@dataclass
class Example:
    """One prompt + response sequence. Loss positions are response tokens (index >= prompt_len)."""
    id: str
    source: str
    ids: torch.Tensor           # [T] long
    prompt_len: int

    @property
    def length(self) -> int:
        return self.ids.shape[0]

    def response_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.length, dtype=torch.bool)
        mask[self.prompt_len:] = True
        return mask


def load_examples(data_dir: str, split: str, max_len: int, exclude: str = "") -> list[Example]:
    """Distilled samples as Examples, truncated to max_len; sequences with < 2 response tokens
    (nothing to learn from) and those from the comma-separated `exclude` sources are dropped."""
    excluded = {x.strip() for x in exclude.split(",") if x.strip()}
    out = []
    for s in load_distilled(data_dir, split):
        if s["source"] in excluded:
            continue
        ids = np.concatenate([s["prompt_ids"], s["response_ids"]]).astype(np.int64)[:max_len]
        p = len(s["prompt_ids"])
        if len(ids) - p >= 2:
            out.append(Example(s["id"], s["source"], torch.from_numpy(ids), p))
    return out


def pick_val(examples: list[Example], n: int) -> list[Example]:
    """Up to n examples, round-robin over sources (each source sorted by id): a stable subset."""
    if n <= 0 or n >= len(examples):
        return sorted(examples, key=lambda e: e.id)
    by_source: dict[str, list[Example]] = defaultdict(list)
    for e in sorted(examples, key=lambda e: e.id):
        by_source[e.source].append(e)
    picked, i = [], 0
    while len(picked) < n:
        for src in sorted(by_source):
            if i < len(by_source[src]) and len(picked) < n:
                picked.append(by_source[src][i])
        i += 1
    return picked


def build_draft_vocab(examples: list[Example], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """(sorted target ids of the `size` most frequent response tokens, their share of response
    tokens). Ties break by id; fewer seen tokens are padded with the lowest unseen ids (as EAGLE-3
    and speculators do)."""
    size = min(size, vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(e.ids[e.prompt_len:], minlength=vocab_size)
    # stable sort on -count keeps id order among equal counts
    order = torch.sort(-counts, stable=True).indices[:size]
    coverage = float(counts[order].sum()) / max(int(counts.sum()), 1)
    return torch.sort(order).values, coverage


def plan_epoch(examples: list[Example], batch_tokens: int, seed: int, epoch: int) -> list[list[str]]:
    """Example ids in a seeded random order, packed greedily into batches of <= batch_tokens
    tokens (a longer sequence forms a batch on its own)."""
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    batches: list[list[str]] = []
    cur: list[str] = []
    tokens = 0
    for i in order.tolist():
        e = examples[i]
        if cur and tokens + e.length > batch_tokens:
            batches.append(cur)
            cur, tokens = [], 0
        cur.append(e.id)
        tokens += e.length
    if cur:
        batches.append(cur)
    return batches


def step_generator(seed: int, step: int) -> torch.Generator:
    """Randomness of one step (e.g. DFlash anchors) as a function of (seed, step) alone, so a
    resumed run draws exactly what an uninterrupted one would."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


# --------------------------------------------------------------------------- target features

@dataclass
class Features:
    """Frozen-target outputs for one sequence, teacher-forced over prompt + response."""
    taps: torch.Tensor                 # [T, n_taps, H] target dtype (HF hidden_states indices)
    argmax: torch.Tensor               # [T] long: the target's greedy next token after position p
    last_hidden: torch.Tensor | None   # [T, H] final-norm output (EAGLE's soft targets), if asked


class FeatureStore:
    """Runs the frozen target over a sequence once; caches the result on disk when `cache_dir`.

    Per token that is n_taps x H (+ H for `last_hidden`) values in the target dtype plus an int32:
    about 4.6 KB for EAGLE-3's 3 taps + final hidden, 4.6 KB for DFlash's 4 taps, in bf16.
    Keys hash the token ids, the tap set and a fingerprint of the target's weights, so a changed
    sample or target never reads stale features. The target's soft distribution is not stored:
    it is recomputed from `last_hidden` through the draft-vocab rows of the LM head (cheap).
    """

    def __init__(self, target: TargetModel, tap_layers: tuple[int, ...], need_hidden: bool,
                 cache_dir: str | None):
        self.target = target
        self.tap_layers = tuple(tap_layers)
        self.need_hidden = need_hidden
        self.cache_dir = cache_dir
        self.memory: dict[str, Features] = {}  # pinned entries (the val set)
        self.seconds = 0.0                     # time spent in the target forward
        self._prefix = self._fingerprint(target) + repr((self.tap_layers, need_hidden))

    @staticmethod
    def _fingerprint(target: TargetModel) -> str:
        h = hashlib.sha1(repr(target.cfg).encode())
        for w in (target.embed_tokens.weight[:4], target.layers[-1].mlp.down_proj.weight[:4], target.norm.weight):
            h.update(w.detach().float().numpy().tobytes())
        h.update(str(target.dtype).encode())
        return h.hexdigest()

    def _key(self, ids: torch.Tensor) -> str:
        return hashlib.sha1(self._prefix.encode() + ids.numpy().astype(np.int32).tobytes()).hexdigest()

    def __call__(self, ex: Example, pin: bool = False) -> Features:
        key = self._key(ex.ids)
        if key in self.memory:
            return self.memory[key]
        feats = self._read(key) if self.cache_dir else None
        if feats is None:
            feats = self.compute(ex.ids)
            if self.cache_dir:
                self._write(key, feats)
        if pin:
            self.memory[key] = feats
        return feats

    def compute(self, ids: torch.Tensor) -> Features:
        t0 = time.time()
        target = self.target
        with torch.inference_mode():
            out = target(ids, target.new_cache(ids.shape[0]), taps=self.tap_layers)
            argmax = out.logits.argmax(-1)
            last = out.last_hidden if self.need_hidden else None
        # clones made outside inference mode are ordinary tensors that autograd may save
        feats = Features(out.taps.clone(), argmax.clone(), None if last is None else last.clone())
        self.seconds += time.time() - t0
        return feats

    def _path(self, key: str) -> str:
        return os.path.join(self.cache_dir, key[:2], key + ".safetensors")

    def _read(self, key: str) -> Features | None:
        from safetensors.torch import load_file

        path = self._path(key)
        if not os.path.exists(path):
            return None
        d = load_file(path)
        return Features(d["taps"], d["argmax"].long(), d.get("last_hidden"))

    def _write(self, key: str, feats: Features) -> None:
        from safetensors.torch import save_file

        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        d = {"taps": feats.taps.contiguous(), "argmax": feats.argmax.int().contiguous()}
        if feats.last_hidden is not None:
            d["last_hidden"] = feats.last_hidden.contiguous()
        tmp = f"{path}.tmp{os.getpid()}"
        save_file(d, tmp)
        os.replace(tmp, path)


# --------------------------------------------------------------------------- task interface

@dataclass
class Item:
    """One sequence's work in a batch, as prepared by a task."""
    example: Example
    feats: Features
    data: dict[str, Any] = field(default_factory=dict)


class DrafterTask(ABC):
    """What a trainer provides to the shared loop."""

    name: str
    model: nn.Module
    tap_layers: tuple[int, ...]
    need_hidden: bool
    n_slots: int  # accuracy is tracked per unroll step (EAGLE-3) / block slot (DFlash)

    def trainable(self, freeze_head: bool) -> list[nn.Parameter]:
        """Parameters the optimiser updates: everything except shared target weights."""
        params = []
        for name, p in self.model.named_parameters():
            if name.startswith("embed_tokens.") or (freeze_head and name.startswith("lm_head.")):
                p.requires_grad_(False)
                continue
            params.append(p)
        return params

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.model.state_dict().items() if not k.startswith("embed_tokens.")}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.startswith("embed_tokens.")]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the {self.name} drafter: "
                             f"missing {missing}, unexpected {unexpected}")

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The drafter config as a plain dict (stored in the checkpoint to rebuild on resume)."""

    @abstractmethod
    def prepare(self, items: list[Item], gen: torch.Generator) -> Any:
        """Fill each item's `data` (masks, anchors...) and return the batch normaliser."""

    @abstractmethod
    def loss(self, item: Item, norm: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(this item's share of the batch loss, counts {"n", "correct", "ce"} per slot)."""

    @abstractmethod
    def evaluate(self, items: list[Item]) -> dict[str, Any]:
        """Teacher-forced validation metrics (no gradients)."""

    @abstractmethod
    def export(self, path: str, extra: dict[str, Any]) -> None:
        """Save the drafter in its published layout."""


def slot_counts(n_slots: int) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(n_slots, dtype=torch.float64) for k in ("n", "correct", "ce")}


def chain_metrics(correct: torch.Tensor, available: torch.Tensor, sources: list[str],
                  chain4: int = 4) -> dict[str, Any]:
    """Validation summary from per-start correctness.

    correct/available: [N, K] bool, row = one drafting start (a context position for EAGLE-3, an
    anchor for DFlash), column k = draft k. Teacher forcing makes "draft k correct" equal to
    "draft k is accepted given drafts < k were", so the leading run of correct drafts is the
    greedy acceptance of a chain started there; tau = 1 + its mean (tokens per target forward).
    """
    ok = correct & available
    run = torch.cumprod(ok.long(), dim=1)
    acc = (ok.sum(0).double() / available.sum(0).clamp(min=1)).tolist()
    tau = 1 + run.sum(1).double()
    tau4 = 1 + run[:, :chain4].sum(1).double()
    by_source: dict[str, list[float]] = defaultdict(list)
    for src, t in zip(sources, tau.tolist()):
        by_source[src].append(t)
    return {
        "acc": [round(a, 4) for a in acc],
        "tau": round(float(tau.mean()), 4) if len(tau) else 0.0,
        "tau4": round(float(tau4.mean()), 4) if len(tau4) else 0.0,
        "tau_by_source": {s: round(sum(v) / len(v), 3) for s, v in sorted(by_source.items())},
        "starts": int(correct.shape[0]),
    }


# --------------------------------------------------------------------------- initialisation

# The drafters' reduced heads start as the target's LM-head rows (tied embedding for SmolLM2). With
# the target's final-norm gain as well, an untrained drafter's random hidden state gives large,
# confidently wrong logits (soft CE 14-22 for EAGLE-3, 70-120 for DFlash, against ln 8192 = 9 for a
# uniform guess) and gradient norms in the hundreds. A tenth of that gain starts near uniform. EAGLE-3
# A/B on 40 steps of the real data: val tau 1.24 (gain x0.1) vs 1.18 (x1); step-4 acc .106 vs .062.
HEAD_GAIN_INIT = 0.1


def init_head_norm(norm: nn.Module, target: TargetModel) -> None:
    """The drafter's output norm gain := HEAD_GAIN_INIT x the target's final-norm gain."""
    with torch.no_grad():
        norm.weight.copy_(target.norm.weight.float() * HEAD_GAIN_INIT)


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


# --------------------------------------------------------------------------- logging

class MetricsLog:
    """Append-only JSONL. On resume, records past the checkpoint's step are dropped (they belong
    to the part of the killed run that is about to be redone)."""

    def __init__(self, path: str, keep_until: int | None):
        self.path = path
        if keep_until is None:
            open(path, "w").close()
        elif os.path.exists(path):
            kept = [r for r in read_log(path) if r["step"] <= keep_until]
            with open(path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_log(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_log(log_path: str, png_path: str, title: str) -> None:
    """Train loss (raw and smoothed) and val accuracy per slot / tau over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_log(log_path)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    if train:
        steps = [r["step"] for r in train]
        loss = [r["loss"] for r in train]
        ax1.plot(steps, loss, alpha=0.35, label="train loss")
        w = max(1, len(loss) // 20)  # trailing mean over ~5% of the run
        smooth = [sum(loss[max(0, i - w + 1):i + 1]) / len(loss[max(0, i - w + 1):i + 1]) for i in range(len(loss))]
        ax1.plot(steps, smooth, label=f"train loss (mean of {w})")
    if val:
        ax1.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="val loss")
        n_slots = len(val[-1]["acc"])
        for k in range(n_slots):
            ax2.plot([r["step"] for r in val], [r["acc"][k] for r in val], ".-", label=f"acc {k}")
        ax3 = ax2.twinx()
        ax3.plot([r["step"] for r in val], [r["tau"] for r in val], "ko--", label="tau")
        ax3.set_ylabel("tau (teacher-forced acceptance length)")
        ax3.legend(loc="lower right")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.legend()
    ax1.set_title(title)
    ax2.set_xlabel("step")
    ax2.set_ylabel("val top-1 accuracy")
    ax2.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, png_path)


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


def train(factory: TaskFactory, name: str, s: TrainSettings, target: TargetModel | None = None,
          quiet: bool = False) -> dict[str, Any]:
    """Train (or resume) one drafter; returns a summary. `target` may be passed in (tests)."""
    torch.set_num_threads(s.threads)
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

    if ckpt is not None:
        vocab_ids, coverage = ckpt["vocab_ids"], ckpt["vocab_coverage"]
        config = ckpt["config"]
    else:
        vocab_ids, coverage = build_draft_vocab(train_set, s.draft_vocab, target.cfg.vocab_size)
        config = None
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
        step, epoch, batch_i, plan = ckpt["step"], ckpt["epoch"], ckpt["batch_i"], ckpt["plan"]
        wall0 = ckpt.get("wall_s", 0.0)
    else:
        step, epoch, batch_i, plan = 0, 0, 0, plan_epoch(train_set, s.batch_tokens, s.seed, 0)
        wall0 = 0.0
    log = MetricsLog(log_path, keep_until=step if ckpt is not None else None)
    by_id = {e.id: e for e in train_set}
    missing = [i for b in plan for i in b if i not in by_id]
    if missing:
        raise SystemExit(f"{len(missing)} samples of the checkpoint's epoch are gone from {s.data}")

    say = (lambda *a: None) if quiet else (lambda msg: print(f"[{name}] {msg}", file=sys.stderr, flush=True))
    say(f"{len(train_set)} train / {len(val_set)} val sequences; draft vocab {len(vocab_ids)} covers "
        f"{coverage:.1%} of response tokens; {n_params / 1e6:.2f} M trainable parameters; "
        f"{'resuming at step ' + str(step) if ckpt is not None else 'starting'}")

    def checkpoint() -> None:
        save_checkpoint(ckpt_path, {
            "name": name, "step": step, "epoch": epoch, "batch_i": batch_i, "plan": plan,
            "model": task.state_dict(), "optimizer": opt.state_dict(), "rng": torch.get_rng_state(),
            "config": task.config(), "vocab_ids": vocab_ids, "vocab_coverage": coverage,
            "settings": asdict(s), "wall_s": wall0 + time.time() - t_start,
        })

    def export() -> None:
        task.export(export_dir, {"whiflash_training": {
            "step": step, "data": os.path.abspath(s.data), "train_sequences": len(train_set),
            "draft_vocab_coverage": round(coverage, 4), "last_val": last_val}})

    t_start = time.time()
    vals = [r for r in read_log(log_path) if r["kind"] == "val"] if ckpt is not None else []
    last_val: dict[str, Any] | None = vals[-1] if vals else None
    acc_counts = slot_counts(task.n_slots)
    window = {"loss": 0.0, "steps": 0, "tokens": 0, "t0": time.time(), "feat_s": store.seconds, "gnorm": 0.0}
    task.model.train()
    with _StopFlag() as stop:
        while step < s.steps:
            if batch_i >= len(plan):  # new epoch: pick up samples distilled since the last one
                epoch, batch_i = epoch + 1, 0
                train_set = load_examples(s.data, "train", s.max_len, s.exclude_sources)
                by_id = {e.id: e for e in train_set}
                plan = plan_epoch(train_set, s.batch_tokens, s.seed, epoch)
            batch = [by_id[i] for i in plan[batch_i]]
            batch_i += 1

            lr = lr_at(step, s)
            for group in opt.param_groups:
                group["lr"] = lr
            items = [Item(e, store(e)) for e in batch]
            norm = task.prepare(items, step_generator(s.seed, step))
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for item in items:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.autocast):
                    loss, counts = task.loss(item, norm)
                if loss.requires_grad:
                    loss.backward()
                total += float(loss.detach())
                for k in acc_counts:
                    acc_counts[k] += counts[k]
            gnorm = float(torch.nn.utils.clip_grad_norm_(params, s.clip))
            opt.step()
            step += 1

            window["loss"] += total
            window["steps"] += 1
            window["tokens"] += sum(e.length for e in batch)
            window["gnorm"] += gnorm
            if step % s.log_every == 0 or step == s.steps:
                dt = time.time() - window["t0"]
                n = acc_counts["n"].clamp(min=1)
                record = {
                    "kind": "train", "step": step, "epoch": epoch, "lr": lr,
                    "loss": window["loss"] / window["steps"],
                    "ce": (acc_counts["ce"] / n).round(decimals=4).tolist(),
                    "acc": (acc_counts["correct"] / n).round(decimals=4).tolist(),
                    "grad_norm": round(window["gnorm"] / window["steps"], 4),
                    "positions_per_s": round(float(acc_counts["n"][0]) / dt, 1),
                    "labels_per_s": round(float(acc_counts["n"].sum()) / dt, 1),
                    "tokens_per_s": round(window["tokens"] / dt, 1),
                    "target_s_frac": round((store.seconds - window["feat_s"]) / dt, 3),
                    "elapsed_s": round(time.time() - t_start, 1),
                }
                log.write(record)
                say(f"step {step} lr {lr:.2e} loss {record['loss']:.4f} acc0 {record['acc'][0]:.3f} "
                    f"{record['positions_per_s']:.0f} pos/s (target {record['target_s_frac']:.0%})")
                acc_counts = slot_counts(task.n_slots)
                window = {"loss": 0.0, "steps": 0, "tokens": 0, "t0": time.time(), "feat_s": store.seconds,
                          "gnorm": 0.0}

            if s.stop_at is not None and step >= s.stop_at:
                return {"step": step, "stopped": True}
            t_aside, feat_aside = time.time(), store.seconds  # val and checkpoints are not training time
            if val_set and (step % s.val_every == 0 or step == s.steps):
                last_val = _validate(task, store, val_set, s, step, log, t_start)
                export()
                plot_log(log_path, png_path, f"{name}: {len(train_set)} sequences")
            if step % s.ckpt_every == 0 or step == s.steps or stop.set:
                checkpoint()
            window["t0"] += time.time() - t_aside
            window["feat_s"] += store.seconds - feat_aside
            if stop.set:
                say(f"stopped at step {step}; continue with --resume")
                return {"step": step, "stopped": True}

    export()
    plot_log(log_path, png_path, f"{name}: {len(train_set)} sequences")
    say(f"done: {step} steps in {time.time() - t_start:.0f} s; drafter saved to {export_dir}")
    return {"step": step, "stopped": False, "last_val": last_val, "export": export_dir}
