"""Training data: distilled samples as `Example`s, the draft vocabulary, and epochs packed into
batches.

    data_dirs()          the `--data` value (comma-separated distilled directories) as a list
    load_examples()      distilled samples of every directory -> Example (prompt + response ids)
    pick_val()           a stable, source-balanced validation subset
    build_draft_vocab()  the most frequent response (assistant) tokens
    repeat_sources()     each sample of the named sources N times (weights a kind of text)
    plan_epoch()         shuffled, then packed up to a token budget
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from .distill import load_distilled


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


def data_dirs(data: str) -> list[str]:
    """`--data a,b` -> ["a", "b"]. A comma list (not nargs) keeps `data` one string, so settings
    stored by earlier runs (checkpoints, configs) read the same way."""
    dirs = [d.strip() for d in data.split(",") if d.strip()]
    if not dirs:
        raise ValueError("no data directory given")
    return dirs


def load_examples(data: str, split: str, max_len: int, exclude: str = "") -> list[Example]:
    """Distilled samples of every directory in `data` (comma-separated) as Examples, truncated to
    max_len; sequences with < 2 response tokens (nothing to learn from) and those from the
    comma-separated `exclude` sources are dropped. Ids ("source/key") must be unique across the
    directories: batches and checkpoints refer to examples by id."""
    excluded = {x.strip() for x in exclude.split(",") if x.strip()}
    out: list[Example] = []
    origin: dict[str, str] = {}
    for data_dir in data_dirs(data):
        for s in load_distilled(data_dir, split):
            if s["id"] in origin:
                raise ValueError(f"sample {s['id']!r} is in both {origin[s['id']]} and {data_dir}")
            origin[s["id"]] = data_dir
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


def response_counts(examples: list[Example], vocab_size: int) -> torch.Tensor:
    """[vocab_size] how often each token occurs in the responses."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(e.ids[e.prompt_len:], minlength=vocab_size)
    return counts


def build_draft_vocab(examples: list[Example], size: int, vocab_size: int,
                      within: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(sorted target ids of the `size` most frequent response tokens, their share of response
    tokens). Ties break by id; fewer seen tokens are padded with the lowest unseen ids (as EAGLE-3
    and speculators do). `within` (sorted target ids) restricts the choice to those ids (pruning
    a trained head keeps only rows it has)."""
    counts = response_counts(examples, vocab_size)
    candidates = torch.arange(vocab_size) if within is None else within
    size = min(size, len(candidates))
    # stable sort on -count keeps id order among equal counts
    order = candidates[torch.sort(-counts[candidates], stable=True).indices[:size]]
    coverage = float(counts[order].sum()) / max(int(counts.sum()), 1)
    return torch.sort(order).values, coverage


def vocab_coverage(examples: list[Example], ids: torch.Tensor, vocab_size: int) -> float:
    """Share of the response tokens that a given draft vocabulary (target ids) covers."""
    counts = response_counts(examples, vocab_size)
    return float(counts[ids].sum()) / max(int(counts.sum()), 1)


def parse_repeats(spec: str) -> dict[str, int]:
    """`--repeat-sources "a=2, b=3"` -> {"a": 2, "b": 3}; N is a whole number >= 1."""
    out: dict[str, int] = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        source, sep, n = item.partition("=")
        if not sep or not source.strip() or not n.strip().isdigit() or int(n) < 1:
            raise ValueError(f"--repeat-sources: {item!r} is not SOURCE=N with N a whole number >= 1")
        out[source.strip()] = int(n)
    return out


def repeat_sources(examples: list[Example], spec: str) -> list[Example]:
    """The examples with each sample of a source named in `spec` ("SOURCE=N,...") N times: an epoch
    then trains N times as often on a kind of text the drafter is weak at. Order is kept (the
    epoch's shuffle comes after); a named source with no samples is an error, not a silent no-op."""
    repeats = parse_repeats(spec)
    missing = sorted(set(repeats) - {e.source for e in examples})
    if missing:
        raise ValueError(f"--repeat-sources: no training samples from {', '.join(missing)}")
    return [e for e in examples for _ in range(repeats.get(e.source, 1))]


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
