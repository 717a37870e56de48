"""`whiflash train distill`: the target model answers training prompts (self-distillation data).

Drafters learn to predict what *this* target writes, so their training responses come from the
target itself: mostly greedy, plus a deterministic fraction sampled at a temperature so the
drafter also sees the target's sampled distribution. Prompts are rendered with the server's chat
renderer (`whiflash_core.chat.encode_chat`) so training and serving prompts are identical.

Output layout (`--out DIR`):

    manifest.json          counts per source and split, tokens, wall time, settings, licences
    shards/{split}/*.npz   one file per generated batch, written to a temp file and renamed
    {split}.npz            all shards of a split merged, once every prompt is done

Each npz holds `tokens` (uint16: every sample's prompt ids then response ids, concatenated),
`prompt_lens`, `response_lens`, `ids`, `sources`, `sampled`, `finished`. A shard exists only once
complete, so a kill at any moment loses at most the batch in flight, and the shard files themselves
record which prompts are done: a rerun with the same arguments skips them.

`load_distilled(out_dir, split)` reads the merged file and any shards back.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import glob
import hashlib
import json
import os
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

import numpy as np

from whiflash_core.cli_args import add_arguments, from_args, setting
from whiflash_core.training.prompts import Conversation, load_prompts, source_info

# torch and transformers are imported inside functions: `whiflash train --help` stays fast

SPLITS = ("train", "val")
FORMAT = "whiflash-distill-v1"
MAX_VOCAB = 1 << 16  # token ids are stored as uint16
# Settings that change what a prompt's sample is, or which split it lands in: a resumed run
# must use the same values, or the output would mix two datasets (or leak val into train).
IDENTITY_SETTINGS = ("model", "dtype", "max_new_tokens", "max_prompt_tokens", "temperature",
                     "sample_frac", "val_per_source", "seed")
# exclude_done_in may grow on resume (a data set made since, e.g. a router label set, whose prompts
# this one must not answer too), never shrink; see _check_resume and distill()


# --------------------------------------------------------------------------- CLI

@dataclass
class DistillSettings:
    """`whiflash train distill` settings; its flags are generated from these fields (cli_args.py)."""
    prompts: list[str] = setting(help="prompt files or directories (known sources or generic messages JSONL)",
                                 metavar="FILE_OR_DIR")
    out: str = setting(help="output directory (resumed when it exists)")
    model: str | None = setting(None, "HF model directory (default: the embedded SmolLM2-135M-Instruct GGUF)")
    dtype: str = setting("bfloat16", "target dtype", choices=["bfloat16", "float32"])
    max_new_tokens: int = setting(256, "longest answer")
    max_prompt_tokens: int = setting(768, "longer prompts are dropped")
    batch_size: int = setting(32, "most prompts per generate call (32 measured about 20%% faster than 16 on "
                              "short prompts, 1 thread)")
    max_batch_tokens: int = setting(16384, "cap on batch * (prompt length + max new tokens): smaller batches for "
                                    "long prompts")
    sample_frac: float = setting(0.2, "fraction of train prompts answered by sampling instead of greedy")
    temperature: float = setting(0.7, "sampling temperature of those")
    val_per_source: int = setting(8, "prompts per source held apart in the 'val' split (answered greedily)")
    seed: int = setting(0, "prompt split and sampling")
    threads: int = setting(1, "torch threads (other work shares the CPU)")
    limit: int | None = setting(None, "answer at most N not-yet-done prompts in this run, then stop")
    per_source: int | None = setting(None, "in this run, fill each source's train split up to N samples at most "
                                     "(a balanced first pass over all sources; a later run without it goes on)")
    exclude_done_in: list[str] = setting(list, "earlier distillation directories: prompts answered there (train or "
                                         "val) are left out here, before the val split is chosen, so data sets "
                                         "made in other dtypes add answers without repeating or leaking them",
                                         metavar="DIR")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DistillSettings":
        return from_args(cls, args)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "distill", help="generate self-distillation data with the target model",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, DistillSettings)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    distill(DistillSettings.from_args(args))
    return 0


# --------------------------------------------------------------------------- work items

@dataclass
class Job:
    id: str
    source: str
    prompt_ids: list[int]
    split: str
    sampled: bool
    priority: int


def _unit_hash(*parts: object) -> float:
    """Deterministic value in [0, 1) (Python's hash() is salted per process)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def make_jobs(conversations: list[Conversation], tokenizer, s: DistillSettings,
              stats: dict[str, Counter]) -> list[Job]:
    """Tokenize, drop over-long and duplicate prompts, choose the val slice and the sampled set.

    The val slice is chosen per source among the kept prompts by a seeded hash, independent of
    --limit and of the other sources, so it is the same on every run.
    """
    from whiflash_core.chat import encode_chat

    jobs: list[Job] = []
    seen: set[tuple[int, ...]] = set()
    for conv in conversations:
        src = conv["source"]
        stats["available"][src] += 1
        ids = encode_chat(tokenizer, conv["messages"], conv["tools"])
        if len(ids) > s.max_prompt_tokens:
            stats["too_long"][src] += 1
            continue
        key = tuple(ids)
        if key in seen:  # same rendered prompt in two sets (e.g. the two code alpaca files)
            stats["duplicate"][src] += 1
            continue
        seen.add(key)
        jobs.append(Job(conv["id"], src, ids, "train", False, source_info(src).priority))

    by_source: dict[str, list[Job]] = defaultdict(list)
    for job in jobs:
        by_source[job.source].append(job)
    for src_jobs in by_source.values():
        ranked = sorted(src_jobs, key=lambda j: _unit_hash(s.seed, "val", j.id))
        for job in ranked[: s.val_per_source]:
            job.split = "val"  # val stays greedy: a clean measure of greedy acceptance
    for job in jobs:
        if job.split == "train":
            job.sampled = _unit_hash(s.seed, "sample", job.id) < s.sample_frac
    return jobs


def plan_batches(jobs: list[Job], s: DistillSettings) -> list[list[Job]]:
    """Val first, then train by source priority; within a group, sorted by prompt length so
    left padding wastes little. Greedy and sampled prompts need separate generate calls."""
    groups: dict[tuple, list[Job]] = defaultdict(list)
    for job in jobs:
        groups[(job.split != "val", job.priority, job.sampled)].append(job)
    batches: list[list[Job]] = []
    for key in sorted(groups):
        group = sorted(groups[key], key=lambda j: (len(j.prompt_ids), j.id))
        i = 0
        while i < len(group):
            # the longest prompt of a batch is its last one (sorted): size the batch for it
            n = min(s.batch_size, len(group) - i)
            while n > 1 and n * (len(group[i + n - 1].prompt_ids) + s.max_new_tokens) > s.max_batch_tokens:
                n -= 1
            batches.append(group[i: i + n])
            i += n
    return batches


# --------------------------------------------------------------------------- storage

@dataclass
class Sample:
    id: str
    source: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    sampled: bool
    finished: bool


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, write) -> None:
    """Write through `write(file)` into a temp file, fsync, then rename over `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def write_samples(path: str, samples: list[Sample]) -> None:
    arrays = {
        "tokens": np.concatenate([np.concatenate([x.prompt_ids, x.response_ids]) for x in samples]
                                 ).astype(np.uint16) if samples else np.zeros(0, np.uint16),
        "prompt_lens": np.array([len(x.prompt_ids) for x in samples], dtype=np.int32),
        "response_lens": np.array([len(x.response_ids) for x in samples], dtype=np.int32),
        "ids": np.array([x.id for x in samples], dtype=str),
        "sources": np.array([x.source for x in samples], dtype=str),
        "sampled": np.array([x.sampled for x in samples], dtype=bool),
        "finished": np.array([x.finished for x in samples], dtype=bool),
    }
    _atomic_write(path, lambda f: np.savez(f, **arrays))


def read_samples(path: str) -> list[Sample]:
    with np.load(path, allow_pickle=False) as z:
        tokens = z["tokens"]
        plens, rlens = z["prompt_lens"], z["response_lens"]
        ids, sources, sampled, finished = z["ids"], z["sources"], z["sampled"], z["finished"]
    out, pos = [], 0
    for i in range(len(ids)):
        p, r = int(plens[i]), int(rlens[i])
        out.append(Sample(str(ids[i]), str(sources[i]), tokens[pos: pos + p],
                          tokens[pos + p: pos + p + r], bool(sampled[i]), bool(finished[i])))
        pos += p + r
    return out


def _split_files(out_dir: str, split: str) -> list[str]:
    """The merged file first, then shards in creation order; temp files are never listed."""
    merged = os.path.join(out_dir, f"{split}.npz")
    shards = sorted(glob.glob(os.path.join(out_dir, "shards", split, "*.npz")))
    return ([merged] if os.path.exists(merged) else []) + shards


def iter_samples(out_dir: str, split: str) -> Iterator[Sample]:
    """Every sample of a split once (a kill between merging and deleting shards leaves copies)."""
    seen: set[str] = set()
    for path in _split_files(out_dir, split):
        for sample in read_samples(path):
            if sample.id not in seen:
                seen.add(sample.id)
                yield sample


def load_distilled(out_dir: str, split: str = "train") -> list[dict[str, Any]]:
    """Distilled samples of `split` as dicts: id, source, prompt_ids and response_ids (uint16
    arrays; a response that finished ends with the eos id), sampled, finished."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}")
    return [asdict(x) for x in iter_samples(out_dir, split)]


def compact(out_dir: str, split: str) -> None:
    """Merge a split's shards into `{split}.npz` (atomically), then delete the shards."""
    shards = sorted(glob.glob(os.path.join(out_dir, "shards", split, "*.npz")))
    if not shards:
        return
    write_samples(os.path.join(out_dir, f"{split}.npz"), list(iter_samples(out_dir, split)))
    for path in shards:
        os.remove(path)


# --------------------------------------------------------------------------- manifest

@dataclass
class SplitStats:
    samples: int = 0
    prompt_tokens: int = 0
    response_tokens: int = 0
    sampled: int = 0
    finished: int = 0
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, x: Sample) -> None:
        self.samples += 1
        self.prompt_tokens += len(x.prompt_ids)
        self.response_tokens += len(x.response_ids)
        self.sampled += x.sampled
        self.finished += x.finished
        src = self.by_source.setdefault(x.source, {"samples": 0, "response_tokens": 0})
        src["samples"] += 1
        src["response_tokens"] += len(x.response_ids)


def _read_manifest(out_dir: str) -> dict[str, Any] | None:
    path = os.path.join(out_dir, "manifest.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _check_resume(previous: dict[str, Any] | None, settings: dict[str, Any]) -> None:
    if not previous:
        return
    old = previous.get("settings", {})
    changed = [k for k in IDENTITY_SETTINGS if k in old and old[k] != settings[k]]
    if changed:
        diff = ", ".join(f"{k}: {old[k]!r} -> {settings[k]!r}" for k in changed)
        raise SystemExit(f"{settings['out']} was made with other settings ({diff}); "
                         "use those settings to resume, or a new --out")
    dropped = sorted(set(old.get("exclude_done_in", [])) - set(settings["exclude_done_in"]))
    if dropped:
        raise SystemExit(f"{settings['out']} was made excluding the prompts of {dropped}: keep them in "
                         "--exclude-done-in (more may be added)")


# --------------------------------------------------------------------------- generation

def load_target(s: DistillSettings):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if s.model:
        tokenizer = AutoTokenizer.from_pretrained(s.model)
        model = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32)
    else:
        from whiflash_core.loading import load_hf_model

        # the GGUF dequantized to float32 (its conversion kept in the cache), then cast
        model, tokenizer = load_hf_model(None)
    model = model.to(getattr(torch, s.dtype)).eval()
    if model.config.vocab_size > MAX_VOCAB:
        raise SystemExit(f"vocab {model.config.vocab_size} does not fit the uint16 storage")
    return tokenizer, model


def generate_batch(model, batch: list[Job], s: DistillSettings, eos_id: int, pad_id: int) -> list[Sample]:
    import torch
    from transformers import GenerationConfig

    width = max(len(j.prompt_ids) for j in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, job in enumerate(batch):  # left padding: every prompt ends where generation starts
        input_ids[row, width - len(job.prompt_ids):] = torch.tensor(job.prompt_ids)
        attention[row, width - len(job.prompt_ids):] = 1

    sampled = batch[0].sampled
    if sampled:
        # pure temperature sampling (no top-k/top-p), seeded by the batch so reruns agree
        config = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=True,
                                  temperature=s.temperature, top_k=0, top_p=1.0,
                                  eos_token_id=eos_id, pad_token_id=pad_id)
        torch.manual_seed(int(_unit_hash(s.seed, "batch", batch[0].id) * 2**63))
    else:
        config = GenerationConfig(max_new_tokens=s.max_new_tokens, do_sample=False,
                                  eos_token_id=eos_id, pad_token_id=pad_id)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)

    samples = []
    for job, row in zip(batch, out[:, width:].tolist()):
        finished = eos_id in row
        response = row[: row.index(eos_id) + 1] if finished else row  # keep the eos
        samples.append(Sample(job.id, job.source, np.asarray(job.prompt_ids, dtype=np.uint16),
                              np.asarray(response, dtype=np.uint16), job.sampled, finished))
    return samples


def distill(s: DistillSettings) -> dict[str, Any]:
    """Run (or resume) a distillation into `s.out`; returns the final manifest."""
    import torch
    from tqdm import tqdm

    torch.set_num_threads(s.threads)
    os.makedirs(s.out, exist_ok=True)
    settings = asdict(s)
    previous = _read_manifest(s.out)
    _check_resume(previous, settings)

    # what earlier runs finished: the shards are the record
    stats = {split: SplitStats() for split in SPLITS}
    done: set[str] = set()
    for split in SPLITS:
        for sample in iter_samples(s.out, split):
            stats[split].add(sample)
            done.add(sample.id)

    conversations = load_prompts(s.prompts)
    elsewhere = {x.id for d in s.exclude_done_in for split in SPLITS for x in iter_samples(d, split)}
    if done & elsewhere:   # an exclusion added on resume that this directory already answered
        raise SystemExit(f"{len(done & elsewhere)} prompt(s) answered in {s.out} are also answered in "
                         f"--exclude-done-in {s.exclude_done_in}: the two data sets would overlap")
    conversations = [c for c in conversations if c["id"] not in elsewhere]
    tokenizer, model = load_target(s)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(eos_id, int) or eos_id == tokenizer.unk_token_id:
        eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id

    prompt_stats: dict[str, Counter] = {k: Counter() for k in ("available", "too_long", "duplicate")}
    jobs = make_jobs(conversations, tokenizer, s, prompt_stats)
    val_by_source = Counter(j.source for j in jobs if j.split == "val")
    pending = [j for j in jobs if j.id not in done]
    if s.per_source is not None:
        room = Counter({src: s.per_source for src in prompt_stats["available"]})
        room.subtract(Counter(j.source for j in jobs if j.id in done and j.split == "train"))
        kept = []
        for job in pending:
            if job.split == "val" or room[job.source] > 0:
                kept.append(job)
                room[job.source] -= job.split == "train"
        pending = kept
    if s.limit is not None:
        pending = [j for batch in plan_batches(pending, s) for j in batch][: s.limit]
    batches = plan_batches(pending, s)

    session = {"started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
               "wall_s": 0.0, "samples": 0, "response_tokens": 0, "threads": s.threads,
               "batch_size": s.batch_size}
    sessions = (previous or {}).get("sessions", []) + [session]
    n_shard0 = len(glob.glob(os.path.join(s.out, "shards", "*", "*.npz")))
    session_id = len(sessions) - 1

    def write_manifest(complete: bool) -> dict[str, Any]:
        sources = sorted(prompt_stats["available"], key=lambda n: (source_info(n).priority, n))
        manifest = {
            "format": FORMAT,
            "complete": complete,
            "target": {"model": s.model or "embedded:SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
                       "dtype": s.dtype, "eos_id": eos_id},
            "settings": settings,
            "splits": {k: asdict(v) for k, v in stats.items()},
            "sources": {
                n: {"licence": source_info(n).licence, "origin": source_info(n).origin,
                    "priority": source_info(n).priority,
                    "prompts": prompt_stats["available"][n],
                    "dropped_too_long": prompt_stats["too_long"][n],
                    "dropped_duplicate": prompt_stats["duplicate"][n],
                    "val": val_by_source[n]}
                for n in sources
            },
            "wall_s": round(sum(x["wall_s"] for x in sessions), 1),
            "sessions": sessions,
        }
        _atomic_write(os.path.join(s.out, "manifest.json"),
                      lambda f: f.write(json.dumps(manifest, indent=2).encode()))
        return manifest

    print(f"distill: {len(jobs)} prompts ({sum(val_by_source.values())} val), {len(done)} already done, "
          f"{len(pending)} to answer in {len(batches)} batches; "
          f"dropped {sum(prompt_stats['too_long'].values())} over {s.max_prompt_tokens} tokens, "
          f"{sum(prompt_stats['duplicate'].values())} duplicates", file=sys.stderr, flush=True)

    start = time.time()
    bar = tqdm(total=len(pending), unit="prompt", dynamic_ncols=True, file=sys.stderr,
               mininterval=2.0 if sys.stderr.isatty() else 30.0)
    for b, batch in enumerate(batches):
        samples = generate_batch(model, batch, s, eos_id, pad_id)
        split = batch[0].split
        shard_dir = os.path.join(s.out, "shards", split)
        os.makedirs(shard_dir, exist_ok=True)
        write_samples(os.path.join(shard_dir, f"{session_id:03d}-{n_shard0 + b:06d}.npz"), samples)
        for x in samples:
            stats[split].add(x)
            session["samples"] += 1
            session["response_tokens"] += len(x.response_ids)
        session["wall_s"] = round(time.time() - start, 1)
        write_manifest(complete=False)
        bar.update(len(batch))
        bar.set_postfix_str(f"{session['response_tokens'] / max(time.time() - start, 1e-9):.0f} tok/s, "
                            f"{batch[0].source}, len {len(batch[-1].prompt_ids)}", refresh=False)
    bar.close()
    elapsed = time.time() - start
    session["wall_s"] = round(elapsed, 1)

    done.update(j.id for batch in batches for j in batch)
    complete = all(j.id in done for j in jobs)
    if complete:  # every prompt answered: merge the shards into one file per split
        for split in SPLITS:
            compact(s.out, split)
    manifest = write_manifest(complete)
    print(f"distill: {session['samples']} samples, {session['response_tokens']} response tokens in "
          f"{elapsed:.0f} s ({session['response_tokens'] / max(elapsed, 1e-9):.0f} tok/s); "
          f"total train {stats['train'].samples}, val {stats['val'].samples}"
          f"{'' if complete else ' (incomplete: rerun the same command to continue)'}",
          file=sys.stderr, flush=True)
    return manifest
