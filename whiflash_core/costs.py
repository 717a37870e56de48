"""What a speculation round costs on this machine: the router's time model.

The expected time of a round that drafts k tokens with drafter d is

    t(d, k) = router + catch_up_d(backlog) + draft_d(k) + verify(k + 1)

- `verify(rows)`: one target forward over `rows` tokens in the loaded weight format. It is not
  linear in rows (the CPU int4 kernel works in blocks of 4 rows, bf16 and CPU generations differ
  widely), so it is a table timed at start-up on the loaded target (`machine.verify_table`, a
  few seconds, cached per machine and format), interpolated between the timed row counts.
- `catch_up_d(backlog)` and `draft_d(k)`: per drafter, a straight line a + b x through phase
  times (`RoundTimes.catch_up`, `.draft`), by least squares: at start-up `measure` times each
  drafter at a few backlogs and every draft length (well under a second; cached per machine,
  target and drafters like the verify table, `drafter_lines`). `backlog` is the
  verified positions the drafter has not seen yet (Lazy Catch-up: an idle drafter pays for its
  backlog when next picked).
- `router`: the router phase itself (the same for every candidate).

The catch-up is priced at CATCH_UP_SHARE of its time: it is paid once, for every round after it
that keeps the drafter (see CATCH_UP_SHARE).

A shared step (several requests' verify rows in one forward, router.choose_shared) is priced by a
second table, `shared`: the forward's time by its total rows, timed at start-up over requests of a
few rows each (`machine.verify_tables`), less those requests' attention (`shared_forward`), plus
each request's own attention over its context:

    t_step = shared(sum of rows) + sum over requests of per_position(rows_i) c_i

`per_position[rows]` (machine.context_table) is what a verify of `rows` rows spends per cached
position, reading their K/V; c_i is request i's cached positions. Agent requests sit at 1-2k
positions, where attention costs a step as much as the linears do: priced at the table's 256
positions, eight requests' steps were all plain decode (their extra rows looked dear against a
step that looked cheap); priced by their contexts, they draft where it pays: 8 streams 5.6 % more
tokens per CPU-second (bench/results/shared_step_context_ab_xeon.json, Xeon, one thread; 8-14 % in
two exploratory runs). A request alone keeps
the tables as timed: priced by its context too (verify and drafting, tried in one-process A/Bs), it
routed differently without a gain (agentic workload 1.003x, Spec-Bench 0.997x, the shared_step
bench's single stream 0.94-1.00x).

Adaptive (`adaptive=True`): the engine's observed rounds keep it current: each verify row count
keeps a running average (an unobserved one is the table scaled by the observed / table ratio of
those seen), the drafter lines become exponentially weighted fits that forget the start-up points
within a few dozen rounds, and the router phase a running average. It is off by default for a
reason: routing then depends on the machine's momentary load, so the same request can draft
differently twice, and in bf16/int4 (where a k-row verify rounds differently from a 1-row one)
give a different answer at a near-tie; with the start-up model the same request always runs the
same forwards. A model with nothing measured (an `Engine` built without `measure`) prices every
round alike, so the router maximises expected tokens whatever alpha is.

One `CostModel` lives on the `Engine`, shared by all requests (the machine, not the request,
sets these costs); only the thread that steps generations touches it.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from .machine import CONTEXT, SHARED_SEGMENT_ROWS   # the tables' context and shared requests' rows
from .rounds import RoundTimes

DECAY = 0.95         # weight of the past per observation: about the last 20 rounds count
# The share of a drafter's pending catch-up (Lazy Catch-up: the verified positions it has not seen)
# charged to the round that picks it. The catch-up is paid once and serves every round after it
# that keeps the drafter, so charging all of it to one round overprices the drafter, and more with
# every round it sits out (its backlog only grows): after a run of plain steps EAGLE-3 priced itself
# out for the rest of a request (Spec-Bench math on a Zen 3: 1 % EAGLE-3 rounds, 0.77x EAGLE-3
# alone). A quarter, against all of it, one process, A B B A, AMD EPYC Zen 3, 2 threads
# (bench/router_ab.py --b-catch-up-share 1; bench/results/catch_up_share_ab{,_agentic}_zen3.json):
# Spec-Bench 1.018x the tokens/s (acceptance 1.40 -> 1.52), the agentic workload 1.029x (2.21 ->
# 2.44); three runs before it landed 1.027x, 1.006x and 1.031x; none of it (0) 1.059x in one run.
CATCH_UP_SHARE = 0.25
MIN_SECONDS = 1e-6   # floor for a round time, so g / t ** alpha is always defined


@dataclass
class RunningMean:
    """Exponentially weighted mean; the first observation sets it."""
    value: float = 0.0
    count: int = 0

    def add(self, x: float, decay: float = DECAY) -> None:
        self.value = x if self.count == 0 else decay * self.value + (1.0 - decay) * x
        self.count += 1


@dataclass
class LinearCost:
    """seconds = a + b * x, by exponentially weighted least squares over the observations.

    With a single x seen so far the slope is unidentifiable and taken as 0 (the mean for every x):
    optimistic for other x, which the router then tries and so measures."""
    s0: float = 0.0   # decayed sums of 1, x, x^2, y, x*y
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0
    _fit: tuple[float, float] | None = field(default=None, repr=False, compare=False)  # until the next add

    def add(self, x: float, y: float, decay: float = DECAY) -> None:
        self.s0, self.sx, self.sxx = decay * self.s0 + 1.0, decay * self.sx + x, decay * self.sxx + x * x
        self.sy, self.sxy = decay * self.sy + y, decay * self.sxy + x * y
        self._fit = None

    @property
    def observed(self) -> bool:
        return self.s0 > 0.0

    def coefficients(self) -> tuple[float, float]:
        if self._fit is None:   # the router prices ~20 candidates a round from the same line
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> tuple[float, float]:
        if not self.observed:
            return 0.0, 0.0
        var = self.s0 * self.sxx - self.sx * self.sx
        slope = (self.s0 * self.sxy - self.sx * self.sy) / var if var > 1e-9 * max(self.s0 * self.sxx, 1.0) else 0.0
        slope = max(slope, 0.0)   # more tokens never cost less; a negative fit is noise
        return max((self.sy - slope * self.sx) / self.s0, 0.0), slope

    def __call__(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


def _interpolate(points: dict[int, float], x: int) -> float:
    """Piecewise linear through points {x: y}; linear extrapolation from the last two beyond."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    if x <= xs[0]:
        return points[xs[0]]
    lo, hi = (xs[-2], xs[-1]) if x >= xs[-1] else next((a, b) for a, b in zip(xs, xs[1:]) if a <= x <= b)
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


@dataclass
class VerifyCost:
    """T(rows) of the loaded target format: a measured table's shape, observations' level."""
    table: dict[int, float] = field(default_factory=dict)   # rows -> seconds, timed at start-up
    observed: dict[int, RunningMean] = field(default_factory=dict)
    # estimates() per max_rows while nothing is observed (the table alone: the same every round)
    _memo: dict[int, list[float]] = field(default_factory=dict, repr=False, compare=False)

    def add(self, rows: int, seconds: float) -> None:
        self.observed.setdefault(rows, RunningMean()).add(seconds)
        self._memo.clear()

    def scale(self) -> float:
        """Observed / table time over the row counts seen (the real model, context and load vs
        random weights at a fixed context): weighted by how often each was seen."""
        seen = [(m.count, m.value / _interpolate(self.table, r)) for r, m in self.observed.items()]
        total = sum(c for c, _ in seen)
        return sum(c * s for c, s in seen) / total if total else 1.0

    def estimates(self, max_rows: int) -> list[float]:
        """[T(0) = 0, T(1), ..., T(max_rows)]: one call per round, so the scale is computed once.
        The list may be shared between calls: read it, do not change it."""
        if not self.observed:
            memo = self._memo.get(max_rows)
            if memo is None:
                memo = self._memo[max_rows] = self._estimates(max_rows)
            return memo
        return self._estimates(max_rows)

    def _estimates(self, max_rows: int) -> list[float]:
        out = [0.0]
        scale = self.scale() if self.table and self.observed else 1.0
        means = {r: m.value for r, m in self.observed.items()}
        for rows in range(1, max_rows + 1):
            if rows in means:
                out.append(means[rows])
            elif self.table:
                out.append(scale * _interpolate(self.table, rows))
            elif means:
                out.append(_interpolate(means, rows))
            else:
                out.append(0.0)   # nothing known: every candidate costs the same
        return out


@dataclass
class CostModel:
    """Expected round time per (drafter, k); see the module docstring."""
    verify: VerifyCost = field(default_factory=VerifyCost)
    shared: VerifyCost = field(default_factory=VerifyCost)   # a shared forward by its total rows
    catch_up: dict[str, LinearCost] = field(default_factory=dict)   # seconds vs backlog positions
    draft: dict[str, LinearCost] = field(default_factory=dict)      # seconds vs draft tokens k
    router: RunningMean = field(default_factory=RunningMean)
    adaptive: bool = False   # learn from observed rounds (see the module docstring)
    # a shared step's context term (module docstring): verify rows -> seconds per cached
    # position; empty: a shared step priced by the table alone
    per_position: dict[int, float] = field(default_factory=dict)
    # the share of a drafter's pending catch-up charged to the round that picks it (CATCH_UP_SHARE)
    catch_up_share: float = CATCH_UP_SHARE
    _per_row: dict[int, list[float]] = field(default_factory=dict, repr=False, compare=False)   # memo

    @classmethod
    def with_table(cls, table: dict[int, float], adaptive: bool = False,
                   shared: dict[int, float] | None = None) -> CostModel:
        return cls(verify=VerifyCost(table=dict(table)), shared=VerifyCost(table=dict(shared or {})),
                   adaptive=adaptive)

    def set_per_position(self, per_position: dict[int, float]) -> None:
        """Replace the context term (measure sets it; an A/B turns it off with an empty one)."""
        self.per_position = per_position
        self._per_row.clear()

    def shared_forward(self, max_rows: int) -> list[float]:
        """[T(0) = 0, ..., T(max_rows)] of a shared forward by its total rows, without its
        requests' attention over their contexts (choose_shared adds each request's own, `attention`);
        without a shared table, the verify table's (one request's) curve."""
        if not self.shared.table:
            return self.verify.estimates(max_rows)
        curve = self.shared.estimates(max_rows)
        if not self.per_position:
            return curve
        seg, per_row = SHARED_SEGMENT_ROWS, self.per_position_by_rows(SHARED_SEGMENT_ROWS)
        return [0.0] + [max(curve[r] - CONTEXT * ((r // seg) * per_row[seg] + per_row[r % seg]), MIN_SECONDS)
                        for r in range(1, max_rows + 1)]

    def per_position_by_rows(self, max_rows: int) -> list[float]:
        """[per_position(rows) for rows in 0..max_rows] (0 for 0 rows or with no context table),
        interpolated between the timed row counts. Shared between calls: read it, do not change it."""
        memo = self._per_row.get(max_rows)
        if memo is None:
            memo = self._per_row[max_rows] = [0.0] + [
                _interpolate(self.per_position, r) if self.per_position else 0.0 for r in range(1, max_rows + 1)]
        return memo

    def attention(self, max_rows: int, context: int) -> list[float]:
        """[seconds a verify of `rows` rows spends on `context` cached positions, rows 0..max_rows]."""
        return [p * context for p in self.per_position_by_rows(max_rows)]

    def drafting(self, drafter: str | None, k: int, backlog: int) -> float:
        """Seconds to catch `drafter` up on `backlog` positions and draft k tokens (0 without one)."""
        if drafter is None or k <= 0:
            return 0.0
        catch_up, a, b = self.drafting_line(drafter, backlog)
        return catch_up + (a + b * k)

    def drafting_line(self, drafter: str, backlog: int) -> tuple[float, float, float]:
        """(catch-up seconds for `backlog`, a, b) with drafting k tokens = catch-up + (a + b k): the
        router prices every draft length of every drafter each round from these three numbers."""
        ca, cb, a, b = self.drafting_coefficients((drafter,))
        return (self.catch_up_share * (ca + cb * backlog) if backlog > 0 else 0.0), a, b

    def drafting_coefficients(self, drafters) -> list[float]:
        """Per drafter its catch-up line's a and b and its draft line's a and b, flattened (0, 0
        for a line not measured): `drafting_line`'s numbers before the backlog, which the C round
        reads as one array and prices each round's backlogs from (router_native.py)."""
        out = []
        for drafter in drafters:
            catch_up, draft = self.catch_up.get(drafter), self.draft.get(drafter)
            out += catch_up.coefficients() if catch_up else (0.0, 0.0)
            out += draft.coefficients() if draft else (0.0, 0.0)
        return out

    def round_time(self, drafter: str | None, k: int, backlog: int, verify: list[float] | None = None) -> float:
        """Expected seconds of a round; `verify` = `self.verify.estimates(...)` when the caller
        prices many candidates in one round."""
        verify = verify if verify is not None else self.verify.estimates(k + 1)
        return max(self.router.value + self.drafting(drafter, k, backlog) + verify[k + 1], MIN_SECONDS)

    def observe(self, drafter: str | None, draft_len: int, verified_rows: int, backlog: int,
                times: RoundTimes) -> None:
        """Learn from a finished round: the drafter asked for `draft_len` tokens after catching
        up on `backlog` positions, and the target verified `verified_rows` rows."""
        if not self.adaptive:
            return
        self.router.add(times.router)
        if drafter is not None and draft_len > 0:
            if backlog > 0:
                self.catch_up.setdefault(drafter, LinearCost()).add(backlog, times.catch_up)
            self.draft.setdefault(drafter, LinearCost()).add(draft_len, times.draft)
        self.verify.add(verified_rows, times.verify)


# --------------------------------------------------------------------------- start-up measurement

BACKLOGS = (1, 8, 32)        # catch-up sizes timed per drafter
MAX_TIMED_DRAFT = 16         # draft lengths timed: 1..min(this, the drafter's longest)


# A start reads each drafter's lines back from the cache where it finds them (drafter_lines),
# after timing SPOT_DRAFTS of each again: lines reading more than DRAFTER_SPOT_SLACK slower than
# this start runs are timed again (timed beside other work, or by slower kernels), as machine.py
# does with a cached verify table. The absolute part covers prompt lookup's microseconds.
DRAFTER_CACHE_VERSION = 1
SPOT_DRAFTS = (1, 3)
WARMUP_DRAFTS = 3
DRAFTER_SPOT_SLACK = (1.15, 2e-5)


def measure(engine, adaptive: bool = False, reps: int = 3, use_cache: bool = True) -> CostModel:
    """The cost model of `engine` on this machine: the verify and context tables and each
    drafter's catch-up and draft lines (all cached per machine; timed again with `use_cache` off),
    each point the best of `reps` runs (interference only adds time)."""
    from .machine import context_table, verify_tables

    table, shared = verify_tables(engine.target, engine.tap_layers, use_cache)
    model = CostModel.with_table(table, adaptive=adaptive, shared=shared)
    model.set_per_position(context_table(engine.target, engine.tap_layers, use_cache))
    for name, (catch_up, draft) in drafter_lines(engine, reps, use_cache).items():
        model.catch_up[name], model.draft[name] = catch_up, draft
    return model


def drafter_lines(engine, reps: int = 3, use_cache: bool = True) -> dict[str, tuple[LinearCost, LinearCost]]:
    """Each drafter's (catch-up, draft) lines: least squares through `_time_drafters`' points,
    cached per machine, target and drafters like the verify tables. The round mix follows these
    lines, and timed anew at every start they swung it: four starts on one Xeon timed EAGLE-3's
    draft at 0.163-0.209 ms + 0.135-0.178 ms a token and sent 98-151 of 200 rounds to plain decode.
    Cached, every start on a machine routes a request alike."""
    from .machine import _cache_path, _cached, _lower, _target_key, _write_json, contended, others_load

    if not engine.drafters:
        return {}
    key = {"v": DRAFTER_CACHE_VERSION, "target": _target_key(engine.target, engine.tap_layers),
           "drafters": {name: drafter_fingerprint(d) for name, d in engine.drafters.items()},
           "context": CONTEXT, "backlogs": list(BACKLOGS), "max_timed": MAX_TIMED_DRAFT}
    path = _cache_path(key, "drafters")
    saved = _cached(path, use_cache)
    cached = _points_from_json(saved["drafters"]) if saved is not None else None
    if cached is not None and not _drafters_stale(cached, _time_drafters(engine, reps, backlogs=(), ks=SPOT_DRAFTS)):
        return _lines(cached)
    points, others = others_load(lambda: _time_drafters(engine, reps))
    if cached is not None:   # each point at its best (interference only adds time); the key fixes the points
        points = {name: _lower(cached[name], d) for name, d in points.items()}
    _write_json(path, {"machine": key["target"]["machine"], "drafters": points,
                       **({"contended": round(others, 2)} if contended(others) else {})})
    return _lines(points)


def _lines(points: dict) -> dict[str, tuple[LinearCost, LinearCost]]:
    return {name: (_fit(p["catch_up"]), _fit(p["draft"])) for name, p in points.items()}


def drafter_fingerprint(drafter) -> str:
    """What a drafter's timings depend on besides the machine and the target: its kind, its
    configuration and its tensors' names, shapes and dtypes (another checkpoint of the same shape
    times the same)."""
    import dataclasses
    import hashlib
    import json

    cfg = getattr(drafter, "cfg", None)
    parts = [type(drafter).__name__, json.dumps(dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None,
                                                sort_keys=True, default=str)]
    if hasattr(drafter, "state_dict"):
        parts += [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in drafter.state_dict().items()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _fit(points: dict[int, float]) -> LinearCost:
    """The line through {x: seconds}, added in ascending x as the timing made them."""
    line = LinearCost()
    for x in sorted(points):
        line.add(x, points[x], decay=1.0)
    return line


def _points_from_json(saved: dict) -> dict[str, dict[str, dict[int, float]]]:
    return {name: {part: {int(x): y for x, y in p.items()} for part, p in d.items()} for name, d in saved.items()}


def _drafters_stale(cached: dict, now: dict, slack: tuple[float, float] = DRAFTER_SPOT_SLACK) -> bool:
    """Does a cached draft time read more than `slack` slower than this start runs it?"""
    for name, p in now.items():
        old = cached.get(name, {}).get("draft", {})
        for k, t in p["draft"].items():
            if k not in old or old[k] > slack[0] * t + slack[1]:
                print(f"whiflash: the cached draft time of {name} (k = {k}) reads "
                      f"{old.get(k, float('nan')) * 1e3:.3f} ms where this start ran {t * 1e3:.3f} ms; timing the "
                      "drafters again", file=sys.stderr, flush=True)
                return True
    return False


def _time_drafters(engine, reps: int, backlogs: tuple[int, ...] = BACKLOGS,
                   ks: tuple[int, ...] | None = None) -> dict[str, dict[str, dict[int, float]]]:
    """{drafter: {"catch_up": {backlog: s}, "draft": {k: s}}}: the best of `reps` timings of a
    catch-up on each backlog and of a draft of each k (1..min(its longest, MAX_TIMED_DRAFT), or
    those of `ks` it can draft) after CONTEXT random positions and taps (uncached)."""
    import torch

    from .drafters.base import Context, DraftSampling

    longest = min(max((d.max_draft_tokens for d in engine.drafters.values()), default=1), MAX_TIMED_DRAFT)
    capacity = CONTEXT + longest + 2
    device = engine.target.device
    ids = torch.randint(0, engine.target.cfg.vocab_size, (capacity,), generator=torch.Generator().manual_seed(0)).to(device)
    taps = torch.randn(capacity, len(engine.tap_layers), engine.target.cfg.hidden_size,
                       generator=torch.Generator().manual_seed(0)).to(device, engine.target.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)   # time the work, not its launch
    greedy = DraftSampling()
    points = {}
    for name, drafter in engine.drafters.items():
        # untimed first: a drafter's first calls in a process run slow (an EAGLE-3 draft of one
        # token timed 0.41 ms at a start's first timing and 0.33 ms at the next start's)
        drafting = drafter.new_state(capacity)   # caught up on the context: the drafts' state
        ctx = Context(ids, CONTEXT, taps, engine.tap_layers)
        drafter.catch_up(drafting, ctx)
        most = min(drafter.max_draft_tokens, MAX_TIMED_DRAFT)
        for _ in range(WARMUP_DRAFTS):
            drafter.propose(drafting, ctx, most, greedy)
        catch_up, draft = {}, {}
        for backlog in backlogs:
            seconds = []
            for _ in range(reps):
                state = drafter.new_state(capacity)
                drafter.catch_up(state, Context(ids, CONTEXT - backlog, taps, engine.tap_layers))
                t0 = time.perf_counter()
                drafter.catch_up(state, Context(ids, CONTEXT, taps, engine.tap_layers))
                sync()
                seconds.append(time.perf_counter() - t0)
            catch_up[backlog] = min(seconds)
        for k in (range(1, most + 1) if ks is None else [k for k in ks if k <= most]):
            seconds = []
            for _ in range(reps):
                t0 = time.perf_counter()
                drafter.propose(drafting, ctx, k, greedy)
                sync()
                seconds.append(time.perf_counter() - t0)
            draft[k] = min(seconds)
        points[name] = {"catch_up": catch_up, "draft": draft}
    return points
