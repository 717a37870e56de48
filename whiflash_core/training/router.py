"""`whiflash train router`: labels, training and held-out evaluation of the learned routing policy.

    whiflash train router --out runs/router --to models/smollm2-135m-instruct

1. Labels (`label_sequence`, teacher-forced). One float32 target forward over prompt + answer
   gives, at every position, the target's logits, final-norm hidden state and the taps the
   drafters read. Then at every round position n of the answer (verified seq[:n], pending seq[n])
   every drafter proposes its full draft from that verified context through its own serving code
   (`propose`, lazy catch-up included), and the label is how many leading draft tokens a greedy
   verify would accept: d_i equal to the target's argmax at position n+i-1, with the answer
   following d_1..d_{i-1} (so that argmax was computed on the context the draft assumes). The
   answers are the target's own greedy ones (distilled samples with `sampled` set are left out),
   so this is what each round of a greedy decode of that prompt would see.
2. Rows (`replay`). Requests are replayed round by round over their labels with a behaviour
   policy (a random drafter among those with a draft, `explore`), and each round start is one
   row: the features a router would have there (router_mlp.features: the request's acceptance so
   far included, built by the same code as in serving) and every drafter's label.
3. Training: for drafter d and draft position i the row says "accepted" (i <= a), "rejected"
   (i = a + 1 <= drafted) or nothing (later positions): masked binary cross-entropy of p_i, the
   exact likelihood of the accepted count under g's model (acceptance.py). AdamW, the best of
   the dev samples' loss (a slice of the train samples) is kept.
4. Evaluation on the `val` split (held apart from every training step): loss and predicted vs
   actual accepted tokens per drafter, for the MLP and for the `cost` policy's running estimates at
   the same rows; then every policy replayed over the val answers on this machine's cost model
   (`--costs`): tokens per round, estimated tokens/s, share of rounds per drafter and the regret
   against an oracle that knows each drafter's outcome (the best realised g / t ** alpha).

DFlash's labels are taken at its full block; a shorter DFlash draft is that block's prefix
(DFlashDrafter.propose_many drafts the whole trained block and keeps the first k slots), so the
labels hold for every draft length, as the router's g assumes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..acceptance import entropy_and_top1, situation
from ..cli_args import add_arguments, from_args, setting
from ..config import SpeculationConfig
from ..drafters.base import Context, DraftSampling
from ..rounds import Round
from ..router import LOOKUP, Route, Router, RoundInputs
from ..router_mlp import FILE_NAME, RouterMLP, RouterMLPConfig, features, scalar_names
from .data import Example, data_dirs, pick_val
from .distill import load_distilled


@dataclass
class RouterSettings:
    """`whiflash train router` settings; its flags are generated from these fields (cli_args.py)."""
    out: str = setting(help="run directory: label caches, metrics.json, the trained router_mlp.safetensors")
    data: str = setting("datasets/smollm2-distill-router,datasets/smollm2-distill-router2",
                        "distilled directories (comma-separated) whose train split labels the router (the shipped "
                        "drafters never trained on these: their labels are not inflated by memorised answers; "
                        "smollm2-distill-f32, the first label set, is EAGLE-3 training data since its round two)")
    val_data: str = setting("datasets/smollm2-distill,datasets/smollm2-distill-f32,datasets/smollm2-distill-r2",
                            "distilled directories whose val split (never trained on) evaluates it")
    to: str | None = setting(None, "ship router_mlp.safetensors and its card (router_mlp.md) into this drafter "
                             "directory")
    drafters: str | None = setting(None, "drafter directory (default: the shipped drafters)")
    train_samples: int = setting(550, "greedy train answers labelled (source-balanced)")
    val_samples: int = setting(120, "greedy val answers labelled (source-balanced)")
    dev_frac: float = setting(0.1, "share of the labelled train answers kept for choosing the best step")
    max_draft: int = setting(4, "draft positions labelled per drafter (at least its default draft length)")
    max_len: int = setting(2048, "longest prompt + answer")
    trajectories: int = setting(2, "replays per train answer with the exploring behaviour policy (rows)")
    steps: int = setting(1500, "optimizer steps")
    batch: int = setting(512, "rows per step")
    lr: float = setting(1e-3, "peak learning rate (cosine to 10%%)")
    weight_decay: float = setting(0.1, "AdamW weight decay")
    dropout: float = setting(0.5, "dropout after the hidden layer (the rows of one answer are alike: it overfits fast)")
    eval_every: int = setting(100, "dev loss every N steps")
    costs: str = setting("int4", "cost model of the replay: the round times measured on this machine for a target "
                         "in these --weights (int4, int8, dense, auto), or 'flat' (every round alike)")
    seed: int = setting(0, "row replay and training")
    threads: int = setting(1, "torch threads (other work shares the CPU)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterSettings:
        return from_args(cls, args)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("router", help="label, train and evaluate the learned routing policy",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, RouterSettings)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    train_router(RouterSettings.from_args(args))
    return 0


# --------------------------------------------------------------------------- labels

@dataclass
class SequenceLabels:
    """One answer's labels. Index j is the round position n = prompt_len + j (verified seq[:n],
    pending seq[n]), for j < L = len(seq) - 1 - prompt_len (a round needs a token after the pending one)."""
    id: str
    source: str
    prompt_len: int
    drafters: list[str]      # the columns of drafted / accepted
    hidden: torch.Tensor     # [L, d] bf16: the target's final-norm hidden state at position n - 1
    entropy: torch.Tensor    # [L] its entropy there (nats)
    top1: torch.Tensor       # [L] its top-1 probability there
    match: torch.Tensor      # [L] prompt lookup's suffix match size (0: none)
    drafted: torch.Tensor    # [L, D] draft tokens each drafter proposed that the answer can check (0: no draft)
    accepted: torch.Tensor   # [L, D] leading ones a greedy verify accepts

    @property
    def length(self) -> int:
        return self.entropy.shape[0]

    def col(self, drafter: str) -> int:
        return self.drafters.index(drafter)


def draft_lens(engine, max_draft: int) -> dict[str, int]:
    """Positions labelled per drafter: max_draft, but at least the drafter's default draft length
    (DFlash: its whole block) and at most what it can draft."""
    spec = SpeculationConfig()
    return {name: max(d.draft_len(spec), min(max_draft, d.max_draft_tokens)) for name, d in engine.drafters.items()}


@torch.inference_mode()
def label_sequence(engine, ids: torch.Tensor, prompt_len: int, lens: dict[str, int],
                   id: str = "", source: str = "") -> SequenceLabels:
    """Teacher-forced labels of one prompt + answer `ids` [T] (see the module docstring)."""
    target, names = engine.target, list(lens)
    T, p = ids.shape[0], prompt_len
    L = T - 1 - p
    out = target(ids, target.new_cache(T), engine.tap_layers, logits_from=p - 1)
    # greedy[n - (p - 1)]: the target's choice for position n + 1 given seq[:n + 1]
    greedy, seq = out.logits.argmax(-1).tolist(), ids.tolist()
    logits = out.logits[:L]                     # positions p-1 .. T-3: the rows that chose each pending token
    entropy, top1 = torch.tensor([entropy_and_top1(row) for row in logits]).unbind(1)   # as Router.inputs
    hidden = out.last_hidden[p - 1:p - 1 + L].to(torch.bfloat16)
    drafted = torch.zeros(L, len(names), dtype=torch.long)
    accepted = torch.zeros(L, len(names), dtype=torch.long)
    match = torch.zeros(L, dtype=torch.long)
    states = {name: engine.drafters[name].new_state(T + 2) for name in names}
    greedy_draft = DraftSampling()
    for j in range(L):
        n = p + j
        ctx = Context(ids, n, out.taps, engine.tap_layers)
        for col, name in enumerate(names):
            draft = engine.drafters[name].propose(states[name], ctx, lens[name], greedy_draft).tokens.tolist()
            draft = draft[:T - 1 - n]            # tokens past the answer's end cannot be checked
            a = 0
            for i, tok in enumerate(draft):      # d_{i+1}, verified by the row at position n + i
                if tok != greedy[n + i - p + 1]:
                    break
                a += 1
                if tok != seq[n + i + 1]:        # the answer leaves the draft: later rows are unchecked
                    draft = draft[:a]
                    break
            drafted[j, col], accepted[j, col] = len(draft), a
        if LOOKUP in states:
            match[j] = engine.drafters[LOOKUP].match(states[LOOKUP], ids, n)[0]
    return SequenceLabels(id, source, p, names, hidden, entropy, top1, match, drafted, accepted)


def greedy_examples(dirs: str, split: str, max_len: int) -> list[Example]:
    """Greedy (not sampled) distilled answers of `split` with at least 2 answer tokens."""
    out = []
    for data_dir in data_dirs(dirs):
        for s in load_distilled(data_dir, split):
            if s["sampled"] or len(s["response_ids"]) < 2 or len(s["prompt_ids"]) + 2 > max_len:
                continue
            ids = np.concatenate([s["prompt_ids"], s["response_ids"]]).astype(np.int64)[:max_len]
            out.append(Example(s["id"], s["source"], torch.from_numpy(ids), len(s["prompt_ids"])))
    return out


def build_labels(engine, examples: list[Example], lens: dict[str, int], cache_path: str,
                 fingerprint: dict) -> tuple[list[SequenceLabels], float]:
    """Labels of every example, cached in `cache_path` (resumed: labelled answers are kept, saved
    every 20 answers; a cache made with another fingerprint is rebuilt), and the seconds their
    labelling took over all runs that built the cache."""
    done: dict[str, dict] = {}
    seconds = 0.0
    if os.path.exists(cache_path):
        cached = torch.load(cache_path, weights_only=False)
        if cached.get("fingerprint") == fingerprint:
            done, seconds = cached["labels"], cached.get("seconds", 0.0)
    todo = [e for e in examples if e.id not in done]
    t0 = time.time()
    for i, e in enumerate(todo, 1):
        done[e.id] = asdict(label_sequence(engine, e.ids, e.prompt_len, lens, e.id, e.source))
        if i % 20 == 0 or i == len(todo):
            _save(cache_path, {"fingerprint": fingerprint, "labels": done, "seconds": seconds + time.time() - t0})
            print(f"  labelled {i}/{len(todo)} answers ({time.time() - t0:.0f} s)", flush=True)
    return [SequenceLabels(**done[e.id]) for e in examples], seconds + time.time() - t0


def _save(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- replay

# a pick: (router, labels, row j, inputs) -> Route; None means "the router's own policy"
Pick = Callable[[Router, SequenceLabels, int, RoundInputs], Route]


@dataclass
class ReplayTotals:
    rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0
    regret: float = 0.0      # sum over rounds of 1 - chosen / oracle score
    by_drafter: dict[str, int] = field(default_factory=dict)

    def add(self, other: ReplayTotals) -> None:
        self.rounds, self.tokens = self.rounds + other.rounds, self.tokens + other.tokens
        self.seconds, self.regret = self.seconds + other.seconds, self.regret + other.regret
        for k, v in other.by_drafter.items():
            self.by_drafter[k] = self.by_drafter.get(k, 0) + v

    def summary(self) -> dict:
        return {"rounds": self.rounds, "acceptance_length": round(self.tokens / max(self.rounds, 1), 4),
                "est_tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else None,
                "est_ms_per_round": round(1000 * self.seconds / max(self.rounds, 1), 3),
                "regret": round(self.regret / max(self.rounds, 1), 4),
                "round_share": {k: round(v / max(self.rounds, 1), 4) for k, v in sorted(self.by_drafter.items())}}


def round_inputs(router: Router, seq: SequenceLabels, j: int, n_seen: dict[str, int]) -> RoundInputs:
    """RoundInputs at row j from the labels, as Router.inputs builds them from a live request."""
    n = seq.prompt_len + j
    room = int(seq.drafted[j, seq.col(LOOKUP)]) if LOOKUP in router.drafters else 0
    backlogs = {name: max(n - max(n_seen[name], seq.prompt_len), 0) for name in router.drafters}
    return RoundInputs(limit=seq.length - j, top1=float(seq.top1[j]), entropy=float(seq.entropy[j]),
                       match=int(seq.match[j]), lookup_room=room, backlogs=backlogs, hidden=seq.hidden[j])


def outcome(router: Router, seq: SequenceLabels, j: int, inputs: RoundInputs, drafter: str | None,
            k: int) -> tuple[int, int, float]:
    """(draft tokens verified, accepted, round seconds) of drafting k tokens with `drafter` at row j."""
    if drafter is None:
        return 0, 0, router.costs.round_time(None, 0, 0)
    col = seq.col(drafter)
    k = min(k, int(seq.drafted[j, col]))
    if k <= 0:
        return 0, 0, router.costs.round_time(None, 0, 0)
    return k, min(int(seq.accepted[j, col]), k), router.costs.round_time(drafter, k, inputs.backlogs[drafter])


def oracle_pick(router: Router, seq: SequenceLabels, j: int, inputs: RoundInputs) -> Route:
    """The candidate with the best realised tokens / seconds ** alpha (it knows every outcome)."""
    best_score, best_route = -1.0, Route(None)
    for name in [None, *router.drafters]:
        for k in ([0] if name is None else range(1, min(router.draft_lens[name], inputs.limit) + 1)):
            drafted, a, t = outcome(router, seq, j, inputs, name, k)
            if name is not None and drafted < k:
                break
            score = (a + 1) / t ** router.alpha
            if score > best_score:
                best_score, best_route = score, Route(name, k, situation=situation(name, inputs.top1, inputs.match)
                                                      if name else 0)
    return best_route


def explore_pick(rng: random.Random) -> Pick:
    """Behaviour policy of the training rows: a random drafter among those with a draft, at its
    default length (so every drafter's history is seen in every situation)."""
    def pick(router: Router, seq: SequenceLabels, j: int, inputs: RoundInputs) -> Route:
        able = [name for name in router.drafters if seq.drafted[j, seq.col(name)] > 0]
        if not able:
            return Route(None)
        name = rng.choice(able)
        return Route(name, min(router.draft_lens[name], inputs.limit),
                     situation=situation(name, inputs.top1, inputs.match))
    return pick


def single_pick(name: str) -> Pick:
    """A single-drafter method: `name` every round at its full length (prompt lookup: when it matches)."""
    def pick(router: Router, seq: SequenceLabels, j: int, inputs: RoundInputs) -> Route:
        return Route(name, min(router.draft_lens[name], inputs.limit),
                     situation=situation(name, inputs.top1, inputs.match))
    return pick


def replay(router: Router, seq: SequenceLabels, pick: Pick | None = None,
           record: Callable[[int, RoundInputs], None] | None = None) -> ReplayTotals:
    """One request's rounds over its labels: each round `pick` (default: the router's own policy)
    chooses (drafter, k), the labels say how many tokens it accepts, the router learns from the
    round as in serving (Router.observe) and the next round starts after them. `record(j, inputs)`
    sees each round's inputs before the choice (the training rows)."""
    totals, j = ReplayTotals(), 0
    n_seen = {name: 0 for name in router.drafters}
    while j < seq.length:
        inputs = round_inputs(router, seq, j, n_seen)
        if record is not None:
            record(j, inputs)
        route = router.choose(inputs) if pick is None else pick(router, seq, j, inputs)
        k, a, seconds = outcome(router, seq, j, inputs, route.drafter, route.draft_len)
        drafter = route.drafter if k > 0 else None
        oracle = oracle_pick(router, seq, j, inputs)
        _, oa, ot = outcome(router, seq, j, inputs, oracle.drafter, oracle.draft_len)
        totals.regret += 1.0 - ((a + 1) / seconds ** router.alpha) / ((oa + 1) / ot ** router.alpha)
        router.observe(Route(drafter, k, situation=route.situation), Round(totals.rounds + 1, drafter, k, a))
        if drafter is not None:
            n_seen[drafter] = seq.prompt_len + j
        totals.rounds += 1
        totals.tokens += min(a + 1, seq.length - j)   # the data ends after the last answer token
        totals.seconds += seconds
        key = drafter or "plain"
        totals.by_drafter[key] = totals.by_drafter.get(key, 0) + 1
        j += a + 1
    return totals


def make_router(engine, policy: str, alpha: float, costs, mlp: RouterMLP | None = None,
                threshold: float | None = None) -> Router:
    spec = SpeculationConfig(method="whiflash", policy=policy, alpha=alpha)
    if threshold is None:
        threshold = engine.calibration.threshold(alpha)
    return Router(engine.drafters, spec, threshold, costs, mlp)


# --------------------------------------------------------------------------- rows and training

@dataclass
class Rows:
    x: torch.Tensor          # [N, F] features
    drafted: torch.Tensor    # [N, D]
    accepted: torch.Tensor   # [N, D]
    cost_rates: dict[str, torch.Tensor]   # the cost policy's p_1..p_K per drafter at each row [N, K]

    def __len__(self) -> int:
        return self.x.shape[0]


def make_rows(engine, cfg: RouterMLPConfig, labels: list[SequenceLabels], trajectories: int, seed: int) -> Rows:
    """Round-start rows of exploring replays (see the module docstring)."""
    xs, drafted, accepted = [], [], []
    cost_rates: dict[str, list] = {name: [] for name in cfg.drafters}
    for s, seq in enumerate(labels):
        for t in range(trajectories):
            router = make_router(engine, "cost", 1.0, None)
            rng = random.Random(seed * 1_000_003 + s * 101 + t)

            def record(j: int, inputs: RoundInputs) -> None:
                xs.append(features(cfg, inputs.hidden, inputs.entropy, inputs.top1, inputs.match, router.acceptance))
                drafted.append(seq.drafted[j])
                accepted.append(seq.accepted[j])
                for name, k in zip(cfg.drafters, cfg.draft_lens):
                    cost_rates[name].append(router.acceptance.rates(name, situation(name, inputs.top1, inputs.match), k))

            replay(router, seq, explore_pick(rng), record)
    return Rows(torch.stack(xs), torch.stack(drafted), torch.stack(accepted),
                {name: torch.tensor(v) for name, v in cost_rates.items()})


def position_targets(drafted: torch.Tensor, accepted: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, mask) [N, k] of p_1..p_k: position i (1-based) accepted when i <= a, rejected when
    i = a + 1 <= drafted, unobserved otherwise."""
    i = torch.arange(1, k + 1)
    a, d = accepted[:, None], drafted[:, None]
    return (i <= a).float(), ((i <= a + 1) & (i <= d)).float()


def rows_loss(logits: dict[str, torch.Tensor], rows_drafted: torch.Tensor, rows_accepted: torch.Tensor,
              drafters: tuple[str, ...]) -> torch.Tensor:
    """Masked BCE over every drafter's observed positions, averaged per observed position."""
    total, count = 0.0, 0.0
    for col, name in enumerate(drafters):
        y, m = position_targets(rows_drafted[:, col], rows_accepted[:, col], logits[name].shape[1])
        total = total + (F.binary_cross_entropy_with_logits(logits[name], y, reduction="none") * m).sum()
        count += float(m.sum())
    return total / max(count, 1.0)


def rates_nll(rates: dict[str, torch.Tensor], rows: Rows, drafters: tuple[str, ...]) -> float:
    """The same loss for given probabilities (the cost policy's estimates)."""
    logits = {n: torch.logit(r.clamp(1e-4, 1 - 1e-4)) for n, r in rates.items()}
    return float(rows_loss(logits, rows.drafted, rows.accepted, drafters))


def expected_accepted(rates: torch.Tensor, k: int) -> torch.Tensor:
    """[N] expected accepted tokens of a k-token draft: sum_{i<=k} prod_{j<=i} p_j (g(k) - 1)."""
    return torch.cumprod(rates[:, :k], dim=1).sum(1)


def fit(model: RouterMLP, train: Rows, dev: Rows, s: RouterSettings) -> dict:
    """AdamW on masked BCE; keeps the weights of the best dev loss. Returns the training log."""
    model.fit_scaling(train.x)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=s.weight_decay)
    gen = torch.Generator().manual_seed(s.seed)
    drafters = model.cfg.drafters
    best = (math.inf, 0, None)
    log = []
    t0 = time.thread_time()

    def dev_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = float(rows_loss(model.split(model(dev.x)), dev.drafted, dev.accepted, drafters))
        model.train()
        return loss

    model.train()
    for step in range(1, s.steps + 1):
        lr = s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 1) / s.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, len(train), (s.batch,), generator=gen)
        loss = rows_loss(model.split(model(train.x[idx])), train.drafted[idx], train.accepted[idx], drafters)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % s.eval_every == 0 or step == s.steps:
            d = dev_loss()
            log.append({"step": step, "train_loss": round(loss.item(), 4), "dev_loss": round(d, 4)})
            print(f"  step {step}: train {loss.item():.4f} dev {d:.4f}", flush=True)
            if d < best[0]:
                best = (d, step, {k: v.clone() for k, v in model.state_dict().items()})
    model.load_state_dict(best[2])
    model.eval()
    return {"steps": s.steps, "best_step": best[1], "best_dev_loss": round(best[0], 4),
            "cpu_s": round(time.thread_time() - t0, 1), "log": log}


# --------------------------------------------------------------------------- evaluation

def row_metrics(model: RouterMLP, rows: Rows, engine) -> dict:
    """Held-out loss and predicted vs actual accepted tokens per drafter (at its default draft
    length), for the MLP and for the cost policy's running estimates at the same rows."""
    spec = SpeculationConfig()
    with torch.no_grad():
        learned = {n: torch.sigmoid(v) for n, v in model.split(model(rows.x)).items()}
    out = {"rows": len(rows), "nll": {"learned": round(rates_nll(learned, rows, model.cfg.drafters), 4),
                                      "cost": round(rates_nll(rows.cost_rates, rows, model.cfg.drafters), 4)},
           "drafters": {}}
    for col, name in enumerate(model.cfg.drafters):
        k = engine.drafters[name].draft_len(spec)
        has = rows.drafted[:, col] >= k          # rows where a full default-length draft was made
        actual = rows.accepted[has, col].clamp(max=k).float()
        entry = {"k": k, "rows": int(has.sum()), "actual": round(float(actual.mean()), 4)}
        for policy, rates in (("learned", learned[name]), ("cost", rows.cost_rates[name])):
            pred = expected_accepted(rates[has], k)
            entry[policy] = {"predicted": round(float(pred.mean()), 4),
                             "mae": round(float((pred - actual).abs().mean()), 4),
                             "corr": round(float(torch.corrcoef(torch.stack([pred, actual]))[0, 1]), 4)}
        out["drafters"][name] = entry
    return out


def replay_metrics(engine, labels: list[SequenceLabels], mlp: RouterMLP, costs, alphas=(0.0, 0.5, 1.0)) -> dict:
    """Every policy replayed over the val answers, per alpha (see the module docstring)."""
    out: dict[str, dict] = {}
    for alpha in alphas:
        policies: dict[str, Callable[[], tuple[Router, Pick | None]]] = {
            "cost": lambda: (make_router(engine, "cost", alpha, costs), None),
            "learned": lambda: (make_router(engine, "learned", alpha, costs, mlp), None),
            "entropy": lambda: (make_router(engine, "entropy", alpha, costs), None),
            "oracle": lambda: (make_router(engine, "cost", alpha, costs), oracle_pick),
        }
        for name in engine.drafters:
            policies[name] = (lambda n=name: (make_router(engine, "cost", alpha, costs), single_pick(n)))
        row = {}
        for policy, factory in policies.items():
            totals = ReplayTotals()
            for seq in labels:
                router, pick = factory()
                totals.add(replay(router, seq, pick))
            row[policy] = totals.summary()
        out[f"alpha={alpha:g}"] = row
    return out


@torch.inference_mode()
def mlp_cost(mlp: RouterMLP, engine, calls: int = 1000) -> dict:
    """CPU time of what the learned policy adds to a round (the target's entropy over the
    vocabulary, the features, the MLP forward, reading p), by time.thread_time over many calls,
    each after writing a buffer larger than the caches (outside the timing), as a round's target
    forward does: warm-cache timings understate it about threefold."""
    router = make_router(engine, "learned", 1.0, None, mlp)
    logits = torch.randn(engine.target.cfg.vocab_size)
    hidden = torch.randn(mlp.cfg.hidden_size).to(engine.target.dtype)
    inputs = RoundInputs(limit=8, top1=0.7, entropy=1.2, match=2, lookup_room=3,
                         backlogs={n: 1 for n in engine.drafters}, hidden=hidden)
    evict = torch.zeros(8 << 20)   # 32 MB
    seconds = 0.0
    for i in range(calls + 20):
        evict.add_(1.0)
        logits.add_(0.0)               # the round's fresh logits sit in cache, as after the LM head
        t0 = time.thread_time()
        inputs.entropy, inputs.top1 = entropy_and_top1(logits)
        router.predicted_rates(inputs)
        if i >= 20:
            seconds += time.thread_time() - t0
    return {"ms_per_round": round(1000 * seconds / calls, 4), "calls": calls}


def measured_costs(kind: str, drafters: str | None):
    """The cost model of the replay: this machine's round times for a target in `kind` weights."""
    from ..costs import CostModel, measure
    from ..loading import load_engine

    if kind == "flat":
        return CostModel()
    engine = load_engine(None, drafters, "bfloat16", weights=kind, measure_costs=False)
    return measure(engine)


def cost_summary(costs, engine) -> dict:
    """The replay's round times (ms) per drafter and draft length, at a backlog of 1."""
    spec = SpeculationConfig()
    out = {"plain": round(1000 * costs.round_time(None, 0, 0), 3)}
    for name, d in engine.drafters.items():
        out[name] = [round(1000 * costs.round_time(name, k, 1), 3) for k in range(1, d.draft_len(spec) + 1)]
    return out


# --------------------------------------------------------------------------- the command

def train_router(s: RouterSettings) -> dict:
    from ..loading import SHIPPED_DRAFTERS, load_engine

    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    os.makedirs(s.out, exist_ok=True)
    t_start = time.time()
    engine = load_engine(None, s.drafters, "float32", measure_costs=False)
    lens = draft_lens(engine, s.max_draft)
    drafters = tuple(lens)
    fingerprint = {"drafters": os.path.abspath(s.drafters or SHIPPED_DRAFTERS), "lens": lens,
                   "drafter_files": _drafter_files(s.drafters or SHIPPED_DRAFTERS), "max_len": s.max_len}

    train_ex = pick_val(greedy_examples(s.data, "train", s.max_len), s.train_samples)
    val_ex = pick_val(greedy_examples(s.val_data, "val", s.max_len), s.val_samples)
    print(f"labelling {len(train_ex)} train and {len(val_ex)} val answers, drafts {lens}", flush=True)
    train_labels, train_s = build_labels(engine, train_ex, lens, os.path.join(s.out, "labels_train.pt"), fingerprint)
    val_labels, val_s = build_labels(engine, val_ex, lens, os.path.join(s.out, "labels_val.pt"), fingerprint)

    # dev: a stable slice of the train answers (by id), for choosing the best step
    dev_ids = {e.id for e in sorted(train_ex, key=lambda e: _unit(e.id))[:max(1, int(s.dev_frac * len(train_ex)))]}
    cfg = RouterMLPConfig(engine.target.cfg.hidden_size, drafters, tuple(lens.values()), dropout=s.dropout)
    t0 = time.time()
    train_rows = make_rows(engine, cfg, [x for x in train_labels if x.id not in dev_ids], s.trajectories, s.seed)
    dev_rows = make_rows(engine, cfg, [x for x in train_labels if x.id in dev_ids], 1, s.seed + 1)
    val_rows = make_rows(engine, cfg, val_labels, 1, s.seed + 2)
    rows_s = time.time() - t0
    print(f"rows: train {len(train_rows)}, dev {len(dev_rows)}, val {len(val_rows)}", flush=True)

    model = RouterMLP(cfg)
    training = fit(model, train_rows, dev_rows, s)
    metrics: dict[str, Any] = {
        "settings": asdict(s), "draft_lens": lens, "width": cfg.width,
        "features": {"hidden": cfg.hidden_size, "scalars": scalar_names(drafters)},
        "data": {"train_answers": len(train_ex) - len(dev_ids), "dev_answers": len(dev_ids), "val_answers": len(val_ex),
                 "train_sources": _count_sources(train_ex), "val_sources": _count_sources(val_ex),
                 "train_positions": sum(x.length for x in train_labels),
                 "val_positions": sum(x.length for x in val_labels),
                 "rows": {"train": len(train_rows), "dev": len(dev_rows), "val": len(val_rows)}},
        "wall_s": {"labels_train": round(train_s, 1), "labels_val": round(val_s, 1), "rows": round(rows_s, 1)},
        "training": training,
        "val": row_metrics(model, val_rows, engine),
    }
    costs = measured_costs(s.costs, s.drafters)
    metrics["costs"] = {"kind": s.costs, "round_ms": cost_summary(costs, engine)}
    metrics["replay"] = replay_metrics(engine, val_labels, model, costs)
    metrics["serving_cost"] = mlp_cost(model, engine)
    metrics["wall_s"]["total"] = round(time.time() - t_start, 1)

    path = os.path.join(s.out, FILE_NAME)
    model.save(path, summary={"val": metrics["val"], "training": {k: v for k, v in training.items() if k != "log"}})
    with open(os.path.join(s.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"wrote {path} ({os.path.getsize(path):,} bytes) and {os.path.join(s.out, 'metrics.json')}")
    if s.to:
        ship(s.out, s.to)
    return metrics


def _unit(text: str) -> float:
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2.0**64


def _count_sources(examples: list[Example]) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in examples:
        out[e.source] = out.get(e.source, 0) + 1
    return dict(sorted(out.items()))


def _drafter_files(directory: str) -> dict[str, int]:
    """Sizes of the drafter weight files the labels were made with (a retrained drafter relabels)."""
    out = {}
    for name in sorted(os.listdir(directory)):
        file = os.path.join(directory, name, "model.safetensors")
        if os.path.exists(file):
            out[name] = os.path.getsize(file)
    return out


# --------------------------------------------------------------------------- shipping

def ship(run: str, to: str) -> str:
    """Copy the run's router_mlp.safetensors into `to` and write router_mlp.md from metrics.json."""
    import shutil

    with open(os.path.join(run, "metrics.json")) as f:
        m = json.load(f)
    os.makedirs(to, exist_ok=True)
    dest = os.path.join(to, FILE_NAME)
    shutil.copyfile(os.path.join(run, FILE_NAME), dest)
    card = os.path.join(to, "router_mlp.md")
    with open(card, "w") as f:
        f.write(model_card(m, os.path.getsize(dest)))
    print(f"shipped {dest} and {card}")
    return dest


def model_card(m: dict, size: int) -> str:
    s, d, t, v = m["settings"], m["data"], m["training"], m["val"]
    lens = ", ".join(f"{k} {n}" for k, n in m["draft_lens"].items())
    lines = [
        "# Router MLP (the `learned` routing policy) for SmolLM2-135M-Instruct", "",
        "`speculation.policy: learned` (whiflash_core/router_mlp.py): per drafter, the per-position acceptance "
        "probabilities p_1..p_K of this round's draft, predicted before drafting from the target's final-norm hidden "
        f"state at the last accepted position [{m['features']['hidden']}] plus the scalars "
        + ", ".join(f"`{x}`" for x in m["features"]["scalars"]) + ". "
        "g(k) = 1 + sum_i prod_{j<=i} p_j goes into the cost router's argmax over (drafter, k) of g / t^alpha.", "",
        f"- Shape: {m['features']['hidden'] + len(m['features']['scalars'])} inputs -> {m['width']} (GELU) -> "
        f"{sum(m['draft_lens'].values())} outputs ({lens} positions); {size:,} bytes (bf16 weights, float32 input "
        "standardisation).",
        f"- Labels: `whiflash train router` teacher-forces every drafter at every round position of "
        f"{d['train_answers'] + d['dev_answers']} greedy distilled answers of `{s['data']}` (train split; "
        f"{d['train_positions']:,} positions), float32 target, the shipped drafters; rows are the round starts of "
        f"{s['trajectories']} exploring replays per answer ({d['rows']['train']:,} train rows, "
        f"{d['rows']['dev']:,} dev rows from {d['dev_answers']} held-back train answers). Spec-Bench never used.",
        "- Train sources: " + ", ".join(f"{k} {n}" for k, n in d["train_sources"].items()) + ".",
        f"- Training: {t['steps']} AdamW steps of {s['batch']} rows, lr {s['lr']} (cosine to 10 %), weight decay "
        f"{s['weight_decay']}, dropout {s['dropout']}; best dev loss {t['best_dev_loss']} at step {t['best_step']}; "
        f"{t['cpu_s']} CPU s on {s['threads']} thread. Labelling took {m['wall_s']['labels_train'] / 60:.0f} min (train) "
        f"and {m['wall_s']['labels_val'] / 60:.0f} min (val) on 1 thread of a shared 2-core machine.",
        f"- Command: `whiflash train router --out {s['out']} --data {s['data']} --val-data {s['val_data']} "
        f"--train-samples {s['train_samples']} --val-samples {s['val_samples']} --steps {s['steps']}`", "",
        f"## Held-out validation ({d['val_answers']} greedy answers of the val splits of `{s['val_data']}`, "
        f"{v['rows']:,} round rows)", "",
        f"Loss per observed draft position (masked BCE): learned {v['nll']['learned']}, the `cost` policy's running "
        f"estimates at the same rows {v['nll']['cost']}.", "",
        "| drafter | k | rows | actual accepted | learned predicted | learned MAE | learned corr | cost predicted | cost MAE | cost corr |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e in v["drafters"].items():
        lines.append(f"| {name} | {e['k']} | {e['rows']:,} | {e['actual']:.3f} | {e['learned']['predicted']:.3f} | "
                     f"{e['learned']['mae']:.3f} | {e['learned']['corr']:.3f} | {e['cost']['predicted']:.3f} | "
                     f"{e['cost']['mae']:.3f} | {e['cost']['corr']:.3f} |")
    lines += ["", f"## Replay of every policy over the val answers ({m['costs']['kind']} round times measured on the "
              "training machine)", "",
              "Tokens per round (acceptance length), estimated tokens/s from the cost model, regret against the "
              "oracle that knows each drafter's outcome (mean per round of 1 - chosen / best g/t^alpha).", "",
              "| alpha | policy | acc. len | est. tok/s | regret | rounds by drafter |", "|---|---|---:|---:|---:|---|"]
    for alpha, row in m["replay"].items():
        for policy, r in row.items():
            share = ", ".join(f"{k} {100 * x:.0f}%" for k, x in r["round_share"].items())
            lines.append(f"| {alpha.split('=')[1]} | {policy} | {r['acceptance_length']:.3f} | "
                         f"{r['est_tokens_per_s'] or 0:.1f} | {r['regret']:.3f} | {share} |")
    sc = m["serving_cost"]
    lines += ["", f"Serving cost: {sc['ms_per_round']} ms of CPU per round (the target's entropy, the features, the "
              f"forward, reading p; after evicting the caches, as a round's target forward does; "
              f"time.thread_time over {sc['calls']} calls) against round times of "
              + ", ".join(f"{k} {v}" for k, v in m["costs"]["round_ms"].items()) + " ms.", ""]
    return "\n".join(lines)

