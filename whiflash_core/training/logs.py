"""Training logs: append-only JSONL records and the loss / accuracy plot drawn from them.

Records: `kind: train` every --log-every steps with loss (the optimised objective), ce / acc per
slot (EAGLE-3 unroll step, DFlash block slot) on the training positions, positions_per_s (EAGLE-3
rows / DFlash anchors with a first label, per second of training time), labels_per_s (loss terms
per second) and target_s_frac (share of that time in the target forward: 0 once the features are
cached). `kind: val` with loss, acc per slot against the target's greedy token, tau (1 + mean
leading run of correct drafts: the teacher-forced greedy acceptance length of a chain started
there), tau4 (the same over the first 4 drafts) and tau_by_source.
"""
from __future__ import annotations

import json
import os
from typing import Any


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
