"""Per-round routing: which drafter drafts this round, and how many tokens.

Methods. `none`, `eagle3`, `dflash` and `ngram` use one drafter (or none) every round at its full
draft length; they stay for comparison. `whiflash` routes: every round the router chooses among
every loaded drafter (EAGLE-3, DFlash, prompt lookup while `prompt_lookup` is on, any later kind)
and a plain decode step, by the request's `policy`:

- `cost` (the default): every candidate (drafter d with draft length k in 1..d's length, or no
  draft) gets the tokens it is expected to emit, g (acceptance.py: this request's per-position
  acceptance of d in the situation at hand: the target's top-1 probability at the last accepted
  position, the prompt-lookup match length), and its expected round time, t (costs.py: drafting,
  pending catch-up included, plus the verify of k + 1 rows, measured on this machine). The router
  takes argmax g / t ** alpha:
      alpha = 1: the most tokens per second for this request (lowest latency);
      alpha = 0: the most tokens per target forward (the fewest verify forwards per token, what a
                 busy server's total throughput needs once verify forwards are shared).
  The draft length is adaptive: a longer draft wins only where its extra expected tokens pay for
  its extra time (at alpha = 0 time is free, so the longest draft of the best drafter wins).
  Prompt lookup is priced apart, here and under `learned`: by its copy run (how far back the context
  agrees with the copy source, NgramDrafter.copy_run), with rates observed every round whoever
  drafted (the copy is known before drafting: `_observe_copy`), from a measured prior
  (copy_prior.json, `whiflash train copy-prior`), up to NgramConfig.routed_draft_tokens.
- `learned`: the same argmax g / t ** alpha, with g from the learned MLP (router_mlp.py) instead
  of the request's running acceptance: per drafter it predicts p_1..p_K from the target's final
  hidden state at the last accepted position, its entropy and top-1 probability there, the
  prompt-lookup match and this request's acceptance so far; trained by `whiflash train router`,
  shipped beside the drafters as `router_mlp.safetensors`. Without that file a request asking for
  `learned` is routed by `cost` (logged once); a loaded drafter the MLP has no head for keeps the
  running-acceptance g.
- `entropy`: the paper's threshold rule, kept as the baseline: a prompt-lookup draft when the
  context's last 3 tokens occurred before, else EAGLE-3 when the target's next-token entropy is
  above the threshold (uncertain text, where a chain drafter does better), DFlash below it
  (predictable text, where a block drafter commits many tokens cheaply). The threshold is
  calibrated (`whiflash bench --calibrate-router`): a sweep of thresholds keeps `threshold_al`
  (best acceptance length, alpha = 0) and `threshold_tps` (best tokens/s, alpha = 1); in between,
  alpha sets a round-latency budget interpolated between the two points' measured round times and
  takes the measured threshold with the longest rounds that fit it.

Shared steps. When several requests step together (`Engine.step_many`: one target forward over
all their verify rows), a request's draft rows are no longer priced by its own verify curve: each
row is a share of a forward whose cost grows with every request's rows. `choose_shared` then picks
one candidate per request for the whole step, argmax of (sum of g) / (t_step) ** alpha, t_step =
every request's drafting and attention over its own context (CostModel.attention) plus the shared
forward of all their rows less attention (`CostModel.shared_forward`, timed at start-up): alpha = 1
is the server's tokens per second. A request alone is routed as above.

`Router` is where methods meet drafters: it knows which drafters a method uses and decides each
round's drafter and draft length; after the round it learns from the `Round` (`observe`). The
engine never names a drafter.

A request alone under `cost` or `learned` is routed by one C call (router_native.py) that makes the
same pick as `Options.best` here, from a C copy of this request's acceptance state; this module
stays the definition (and prices shared steps).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

import torch

from .acceptance import (AcceptanceModel, copy_situation, entropy_and_top1, expected_tokens_by_k, situation,
                         top1_probability)
from .costs import MIN_SECONDS, CostModel
from .drafters.base import Context, Drafter, DrafterState
from .layers import entropy_from_logits
from .rounds import Round
from .router_mlp import RouterMLP, scalar_features
from .router_native import NativeRound

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .config import SpeculationConfig

Method = Literal["none", "eagle3", "dflash", "ngram", "whiflash"]
METHODS: tuple[str, ...] = get_args(Method)
Policy = Literal["cost", "entropy", "learned"]
POLICIES: tuple[str, ...] = get_args(Policy)
# The drafters a method needs loaded. Single-drafter methods use theirs every round; whiflash
# needs both trained kinds (the entropy rule chooses between them as (autoregressive, block)) and
# routes among every loaded drafter.
ROUTED: dict[str, tuple[str, ...]] = {"none": (), "eagle3": ("eagle3",), "dflash": ("dflash",),
                                      "ngram": ("ngram",), "whiflash": ("eagle3", "dflash")}
ROUTING_METHODS = ("whiflash",)
# the entropy policy takes a prompt-lookup draft first when the context's last LOOKUP_FIRST_NGRAM
# tokens occurred before (a shorter match is too often chance in free text to beat its pick)
LOOKUP, LOOKUP_FIRST_NGRAM = "ngram", 3
MAX_UNAPPLIED = 256   # round outcomes a router keeps before its Python acceptance models learn them


def available_methods(drafters) -> list[str]:
    """The methods whose drafters are all loaded, in METHODS order."""
    return [m for m in METHODS if all(name in drafters for name in ROUTED[m])]


@dataclass
class RouterCalibration:
    threshold_al: float = 2.0
    threshold_tps: float = 2.0
    source: str = "uncalibrated default"
    sweep: list[dict] = field(default_factory=list)  # per threshold: acceptance length, tok/s, round ms

    def threshold(self, alpha: float) -> float:
        path = self.latency_path()
        if not path:
            return (1.0 - alpha) * self.threshold_al + alpha * self.threshold_tps
        budget = (1.0 - alpha) * path[0]["round_ms"] + alpha * path[-1]["round_ms"]
        return next(p["threshold"] for p in path if p["round_ms"] <= budget + 1e-9)

    def latency_path(self) -> list[dict]:
        """Measured sweep points alpha can pick, longest rounds first: the acceptance-best point,
        then those whose round time lies between it and the tokens/s-best point (ties: faster
        first), ending at the tokens/s-best point. Empty without a sweep holding both ends."""
        by_t = {p["threshold"]: p for p in self.sweep if "round_ms" in p}
        if self.threshold_al not in by_t or self.threshold_tps not in by_t:
            return []
        hi, lo = by_t[self.threshold_al], by_t[self.threshold_tps]
        if lo["round_ms"] >= hi["round_ms"]:  # measurement noise: the fast end is the only safe pick
            return [lo]
        middle = [p for p in by_t.values() if p is not hi and p is not lo
                  and lo["round_ms"] <= p["round_ms"] <= hi["round_ms"]]
        middle.sort(key=lambda p: (-p["round_ms"], -p["tokens_per_s"]))
        # at the fast end's round time the fast end itself wins any tie (it has the best tok/s)
        middle = [p for p in middle if p["round_ms"] > lo["round_ms"]]
        return [hi, *middle, lo]

    @classmethod
    def load(cls, path: str) -> "RouterCalibration":
        with open(path) as f:
            raw = json.load(f)
        return cls(**{k: raw[k] for k in ("threshold_al", "threshold_tps", "source", "sweep") if k in raw})

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)


class EntropyRouter:
    """Chooses between an autoregressive (`ar`) and a block (`block`) drafter each round."""

    def __init__(self, threshold: float, ar: str = "eagle3", block: str = "dflash"):
        self.threshold = threshold
        self.ar, self.block = ar, block

    def choose(self, logits: torch.Tensor) -> tuple[str, float]:
        h = entropy_from_logits(logits)
        return self.pick(h), h

    def pick(self, entropy: float) -> str:
        return self.ar if entropy > self.threshold else self.block


@dataclass
class RoundInputs:
    """What the router knows before drafting, all from the verified context (`Router.inputs`; an
    offline replay of labelled rounds builds the same from its labels, training/router.py)."""
    limit: int                        # most draft tokens this round (tokens left, room in the context)
    top1: float                       # the target's top-1 probability at the last accepted position
    entropy: float | None = None      # its entropy (nats); only the entropy and learned policies read it
    match: int = 0                    # prompt lookup's suffix match size (0: none)
    lookup_room: int = 0              # tokens prompt lookup can copy after its match
    backlogs: dict[str, int] = field(default_factory=dict)   # per drafter: catch-up charged to this round
    hidden: torch.Tensor | None = None   # the target's final-norm hidden state there [d] (learned policy)
    lookup_run: int = 0               # how long its copy has run (NgramDrafter.copy_run; 0: unknown)


@dataclass
class Route:
    """This round's decision: which drafter, how long a draft, and what it was expected to do."""
    drafter: str | None              # None: no drafting (method "none", or a plain step was best)
    draft_len: int = 0
    switched: bool = False           # differs from the previous round's drafter
    entropy: float | None = None     # the entropy policy's input, when it decided
    backlog: int = 0                 # verified positions the drafter catches up on first
    situation: int = 0               # the acceptance model's bucket (acceptance.situation)
    expected_tokens: float | None = None   # cost policy: g of the chosen candidate
    expected_s: float | None = None        # cost policy: t of the chosen candidate
    predicted_accepted: float | None = None   # learned policy: the MLP's own g - 1 for it (before calibration)


@dataclass(slots=True)
class Candidate:
    drafter: str | None
    k: int
    tokens: float      # g: expected emitted tokens
    seconds: float     # t: expected round time, alone
    drafting: float = 0.0   # the part of t outside the verify forward (router, catch-up, draft)
    situation: int = 0
    predicted_accepted: float | None = None   # learned policy: the MLP's own g - 1 (Route's)
    route: Route | None = None   # a route decided by rule (a single-drafter method, the entropy policy)

    def score(self, alpha: float) -> float:
        return self.tokens / self.seconds ** alpha


def best(candidates: list[Candidate], alpha: float) -> Candidate:
    """argmax g / t ** alpha; on a tie the earlier candidate (the plain step comes first, then
    shorter drafts: equal value for less work). The definition: a request's round takes the same
    pick from its priced arrays (Options.best), a test holds the two together."""
    top, top_score = candidates[0], candidates[0].score(alpha)
    for c in candidates[1:]:
        score = c.score(alpha)
        if score > top_score:
            top, top_score = c, score
    return top


@dataclass(slots=True)
class Priced:
    """One drafter's candidates k = 1..k_max of a round, as the arrays they are computed from:
        g(k) = gains[k],   t(k) = max(drafting(k) + verify[k + 1], MIN_SECONDS),
        drafting(k) = fixed + (catch_up + (a + b k))   (the router phase, the catch-up's share, the draft line)."""
    drafter: str
    gains: list[float]          # [g(0), ..., g(k_max)]
    fixed: float
    catch_up: float
    a: float
    b: float
    situation: int
    raw: list[float] | None     # learned policy: the MLP's own g by k (before calibration)

    def drafting(self, k: int) -> float:
        return self.fixed + (self.catch_up + (self.a + self.b * k))

    def candidate(self, k: int, verify: list[float]) -> Candidate:
        d = self.drafting(k)
        return Candidate(self.drafter, k, self.gains[k], max(d + verify[k + 1], MIN_SECONDS), d, self.situation,
                         self.raw[k] - 1.0 if self.raw is not None else None)


@dataclass
class Options:
    """A round's candidates: `first` (the plain step, or the one route a rule decided), then every
    (drafter, k) of `priced` in order, k ascending, each priced on the `verify` curve. A request
    alone takes `best` straight from the arrays (a round builds ~20 candidates otherwise, each a
    microsecond or more on the cold caches between target forwards); a shared step reads them all
    (`candidates`, for choose_shared)."""
    first: Candidate
    priced: list[Priced] = field(default_factory=list)
    verify: list[float] = field(default_factory=list)

    def best(self, alpha: float) -> Candidate:
        """`best(self.candidates(), alpha)`, the same pick (ties too) without building them."""
        first, verify = self.first, self.verify
        top, top_k, top_score = None, 0, first.tokens / first.seconds ** alpha
        for p in self.priced:
            gains, fixed, catch_up, a, b = p.gains, p.fixed, p.catch_up, p.a, p.b
            for k in range(1, len(gains)):
                t = fixed + (catch_up + (a + b * k)) + verify[k + 1]
                score = gains[k] / max(t, MIN_SECONDS) ** alpha
                if score > top_score:
                    top, top_k, top_score = p, k, score
        return first if top is None else top.candidate(top_k, verify)

    def candidates(self) -> list[Candidate]:
        return [self.first, *(p.candidate(k, self.verify) for p in self.priced for k in range(1, len(p.gains)))]

    def longest(self) -> int:
        """The longest draft among the candidates."""
        return max([self.first.k, *(len(p.gains) - 1 for p in self.priced)])


def choose_shared(options: list[list[Candidate]], alphas: list[float], forward: list[float],
                  attention: list[list[float]], passes: int = 2) -> list[Candidate]:
    """One candidate per request for a shared step: argmax over the combinations of
    G / t_step ** alpha, G the sum of the picks' g, t_step = the sum of their drafting and attention
    times + forward[sum of their rows (k + 1 each)] (forward[r]: the shared forward of r rows less
    its attention, CostModel.shared_forward; it must reach the longest candidates' total;
    attention[i][r]: request i's verify of r rows over its own context, CostModel.attention). By
    coordinate ascent from every request's first option (the plain step): each request in turn
    takes its best response to the others' picks, `passes` times over (the combinations grow as
    options ** requests; two passes settle in practice). Request i weighs the step by its own
    alpha_i; alone (one request) this is `best` with the forward curve and its attention in place of
    its verify curve."""
    picks = [opts[0] for opts in options]
    own_s = [c.drafting + att[c.k + 1] for c, att in zip(picks, attention)]   # each request's own seconds
    tokens, own, rows = sum(c.tokens for c in picks), sum(own_s), sum(c.k + 1 for c in picks)
    for _ in range(passes):
        for i, opts in enumerate(options):
            att = attention[i]
            g_rest, o_rest, r_rest = tokens - picks[i].tokens, own - own_s[i], rows - picks[i].k - 1
            alpha, top, top_score = alphas[i], picks[i], -1.0
            for c in opts:
                t = o_rest + c.drafting + att[c.k + 1] + forward[r_rest + c.k + 1]
                score = (g_rest + c.tokens) / max(t, MIN_SECONDS) ** alpha
                if score > top_score:
                    top, top_score = c, score
            picks[i], own_s[i] = top, top.drafting + att[top.k + 1]
            tokens, own, rows = g_rest + top.tokens, o_rest + own_s[i], r_rest + top.k + 1
    return picks


@dataclass
class Calibration:
    """How the learned policy's predictions fared in this request, per drafter: decayed sums of
    the accepted tokens it predicted (its own g - 1 of the chosen draft) and of those accepted.
    The MLP is trained on other text; a request whose text a drafter knows less well (translation,
    humanities for EAGLE-3) would otherwise keep being routed by an optimism it never shows.
    Each drafter's predicted rates are scaled by (accepted + w) / (predicted + w), w = PRIOR
    pseudo tokens on both sides, so the first rounds trust the MLP and later ones this request."""
    predicted: float = 0.0
    accepted: float = 0.0
    PRIOR = 2.0
    DECAY = 0.9

    def add(self, predicted: float, accepted: int) -> None:
        self.predicted = self.DECAY * self.predicted + predicted
        self.accepted = self.DECAY * self.accepted + accepted

    def factor(self) -> float:
        return (self.accepted + self.PRIOR) / (self.predicted + self.PRIOR)


class Router:
    """Per-request routing: the drafters a method uses and each round's choice among them."""

    def __init__(self, drafters: dict[str, Drafter], spec: SpeculationConfig, threshold: float,
                 costs: CostModel | None = None, learned: RouterMLP | None = None,
                 copy_prior: dict[int, list[float]] | None = None):
        if spec.method in ROUTING_METHODS:
            names = tuple(n for n in drafters if n != LOOKUP or spec.prompt_lookup)
        else:
            names = ROUTED[spec.method]
        self.drafters = {name: drafters[name] for name in names}      # every drafter this request may use
        self.draft_lens = {name: d.draft_len(spec) for name, d in self.drafters.items()}
        self.routes = spec.method in ROUTING_METHODS
        # the cost and learned policies price every length up to these (prompt lookup: longer)
        self.route_lens = {name: d.routed_draft_len(spec) for name, d in self.drafters.items()} \
            if self.routes else dict(self.draft_lens)
        # the most draft tokens any route of this request may take (the engine's cache headroom)
        self.longest_draft = max([*self.draft_lens.values(), *self.route_lens.values()], default=0)
        self.policy, self.alpha = spec.policy, spec.alpha
        if self.routes and self.policy == "learned" and learned is None:
            _log_once("speculation.policy 'learned' asked for, but no router MLP is loaded (no "
                      "router_mlp.safetensors beside the drafters): routing by 'cost' instead")
            self.policy = "cost"
        self.learned = learned if self.policy == "learned" else None
        self.entropy = EntropyRouter(threshold, *ROUTED["whiflash"]) if self.routes else None
        self.costs = costs if costs is not None else CostModel()
        self._acceptance = AcceptanceModel()
        # prompt lookup's acceptance by copy run, observed every round against the tokens the round
        # emitted (its draft is a copy, known before anyone drafts): (copy situation, the copy's
        # tokens) of the round being routed, then its outcome in `observe`
        self._copying = AcceptanceModel(copy_prior)
        # the rounds' outcomes the two models have not yet learned, in order (`acceptance` and
        # `copying` apply them when read: a request routed in C reads neither)
        self._unapplied: list[tuple[AcceptanceModel, str, int, int, int]] = []
        self._copy: tuple[int, list[int]] | None = None
        self.calibration: dict[str, Calibration] = {}   # learned policy: per drafter, this request's
        self.previous: str | None = None
        # positions every drafter catches up on once per request, whichever round first picks it
        # (the prompt): charged to no round, or a long prompt would keep the drafters from ever
        # being picked (an idle drafter's backlog only grows). Set by the Generation.
        self.prompt_len = 0
        # a request alone is routed by one C call where it applies (router_native.py), else in Python
        self.native = NativeRound.make(self)

    @property
    def acceptance(self) -> AcceptanceModel:
        """This request's acceptance per drafter and situation (acceptance.py)."""
        if self._unapplied:
            self._apply()
        return self._acceptance

    @property
    def copying(self) -> AcceptanceModel:
        """Prompt lookup's acceptance per copy run (see __init__)."""
        if self._unapplied:
            self._apply()
        return self._copying

    def _apply(self) -> None:
        for model, drafter, where, k, accepted in self._unapplied:
            model.update(drafter, where, k, accepted)
        self._unapplied.clear()

    def route(self, states: dict[str, DrafterState], ctx: Context, logits: torch.Tensor,
              limit: int | None = None, hidden: torch.Tensor | None = None) -> Route:
        """Choose from the verified context, the target's logits at its last position [V] and (for
        the learned policy) its final-norm hidden state there [d]; `limit` caps the draft length
        (tokens left to emit, room in the context)."""
        return self.take(self.options(states, ctx, logits, limit, hidden, lone=True).best(self.alpha), states, ctx)

    def options(self, states: dict[str, DrafterState], ctx: Context, logits: torch.Tensor,
                limit: int | None = None, hidden: torch.Tensor | None = None, lone: bool = False) -> Options:
        """This round's candidates (`route`'s arguments), the plain step first: for the cost and
        learned policies every (drafter, k) priced; otherwise the one route the method or the
        entropy rule decides, priced by the running acceptance (for `choose_shared`). `lone`: the
        request routes alone (no shared step reads the candidates), so where the C round applies
        the options are its pick alone (router_native.py: the same pick as Options.best here)."""
        if not self.drafters:
            return Options(self._decided(Route(None)))
        limit = self.longest_draft if limit is None else max(limit, 0)
        if not self.routes:
            name = next(iter(self.drafters))
            return Options(self._decided(Route(name, min(self.draft_lens[name], limit))))
        if lone and self.native is not None:
            pick = self.native.pick(states, ctx, logits, hidden if self.learned is not None else None, limit)
            if pick is not None:
                return Options(pick)
        inputs = self.inputs(states, ctx, logits, limit, hidden)
        if self.policy == "entropy":
            return Options(self._decided(self._by_entropy(inputs)))
        return self._gain_options(inputs)

    def take(self, c: Candidate, states: dict[str, DrafterState], ctx: Context) -> Route:
        """The round's Route from the chosen candidate."""
        route = c.route if c.route is not None else Route(
            c.drafter, c.k, situation=c.situation, expected_tokens=c.tokens, expected_s=c.seconds,
            predicted_accepted=c.predicted_accepted)
        route.switched = self.previous is not None and route.drafter != self.previous
        self.previous = route.drafter
        if route.drafter is not None:
            route.backlog = max(ctx.n - states[route.drafter].n_seen, 0)
        return route

    def _decided(self, route: Route) -> Candidate:
        k = route.draft_len if route.drafter is not None else 0
        drafting = self.costs.router.value + self.costs.drafting(route.drafter, k, 0)
        tokens = expected_tokens_by_k(self.acceptance.rates(route.drafter, 0, k), k)[k] if k else 1.0
        verify = self.costs.verify.estimates(k + 1)[k + 1]
        return Candidate(route.drafter, k, tokens, max(drafting + verify, MIN_SECONDS), drafting, route=route)

    def inputs(self, states: dict[str, DrafterState], ctx: Context, logits: torch.Tensor, limit: int,
               hidden: torch.Tensor | None = None) -> RoundInputs:
        """This round's RoundInputs from the live request."""
        match, room, run = self._lookup_inputs(states, ctx)
        # the prompt is charged to no round (see __init__)
        backlogs = {name: max(ctx.n - max(states[name].n_seen, self.prompt_len), 0) for name in self.drafters}
        if self.policy == "cost":
            top1, entropy = top1_probability(logits), None
        else:
            entropy, top1 = entropy_and_top1(logits)
        return RoundInputs(limit, top1, entropy, match, room, backlogs, hidden, lookup_run=run)

    def _lookup_inputs(self, states: dict[str, DrafterState], ctx: Context) -> tuple[int, int, int]:
        """Prompt lookup's (match size, tokens it can copy, copy run) this round, all 0 without it;
        under the cost and learned policies its copy is kept for `observe` (`_observe_copy`)."""
        match, room, run = 0, 0, 0
        self._copy = None
        lookup = self.drafters.get(LOOKUP)
        if lookup is not None:   # prompt lookup drafts only what followed its match
            match, start = lookup.match(states[LOOKUP], ctx.ids, ctx.n)
            room = ctx.n + 1 - start if match else 0
            if match and self.routes and self.policy != "entropy":
                run = lookup.copy_run(states[LOOKUP], ctx.n, start)
                self._copy = (copy_situation(run), lookup.copy(ctx.ids, ctx.n, start, self.route_lens[LOOKUP]))
        return match, room, run

    def choose(self, inputs: RoundInputs) -> Route:
        """This round's drafter and draft length by the request's policy (a request alone)."""
        if self.policy == "entropy":
            return self._by_entropy(inputs)
        c = self._gain_options(inputs).best(self.alpha)
        return Route(c.drafter, c.k, situation=c.situation, expected_tokens=c.tokens, expected_s=c.seconds,
                     predicted_accepted=c.predicted_accepted)

    def observe(self, route: Route, r: Round) -> None:
        """Learn from the round `route` led to: its drafter's acceptance, the round's costs."""
        if route.drafter is not None:
            self._unapplied.append((self._acceptance, route.drafter, route.situation, r.draft_len, r.accepted))
            if self.native is not None:
                self.native.update(route.drafter, route.situation, r.draft_len, r.accepted)
            if route.predicted_accepted is not None and r.draft_len > 0:
                calibration = self.calibration.setdefault(route.drafter, Calibration())
                calibration.add(route.predicted_accepted, r.accepted)
                if self.native is not None:
                    self.native.calibrated(route.drafter, calibration.factor())
        if self._copy is not None:
            self._observe_copy(*self._copy, r.tokens)
            self._copy = None
        self.costs.observe(route.drafter, route.draft_len, r.draft_len + 1, route.backlog, r.times)
        if len(self._unapplied) > MAX_UNAPPLIED:   # a long request routed in C: learn in batches
            self._apply()

    def _observe_copy(self, where: int, copy: list[int], emitted: list[int]) -> None:
        """What prompt lookup's draft `copy` would have had accepted this round, whoever drafted:
        its leading tokens that equal the tokens the round emitted (the target's own choices, so
        exactly the acceptance of a greedy verify of that draft). Past the emitted tokens nothing
        is known: a copy that agreed with all of them says "accepted" up to there only."""
        agreed = 0
        while agreed < min(len(copy), len(emitted)) and copy[agreed] == emitted[agreed]:
            agreed += 1
        seen = len(copy) if agreed < len(emitted) else agreed   # drafted positions whose outcome is known
        self._unapplied.append((self._copying, LOOKUP, where, seen, agreed))
        if self.native is not None:
            self.native.update_copy(where, seen, agreed)

    # -- policies -------------------------------------------------------------------------------

    def _by_entropy(self, inputs: RoundInputs) -> Route:
        if LOOKUP in self.drafters and inputs.match >= LOOKUP_FIRST_NGRAM:
            return Route(LOOKUP, min(self.draft_lens[LOOKUP], inputs.limit))
        name = self.entropy.pick(inputs.entropy)
        return Route(name, min(self.draft_lens[name], inputs.limit), entropy=inputs.entropy)

    def _gain_options(self, inputs: RoundInputs) -> Options:
        """The cost and learned policies' candidates: a plain step, then every (drafter, k) with
        its g and t (argmax g / t ** alpha picks among them: Options.best, or `choose_shared`)."""
        longest = min(self.longest_draft, inputs.limit)
        verify = self.costs.verify.estimates(longest + 1)
        plain = self.costs.router.value
        options = Options(Candidate(None, 0, 1.0, max(plain + verify[1], MIN_SECONDS), plain), [], verify)
        predicted = self.predicted_rates(inputs)
        for name in self.drafters:
            k_max = min(self.route_lens[name], inputs.limit)
            if name == LOOKUP:
                k_max = min(k_max, inputs.lookup_room)
            if k_max <= 0:
                continue
            where = situation(name, inputs.top1, inputs.match)
            rates = predicted.get(name)
            raw = None   # learned: g by k from the MLP's own rates
            if name == LOOKUP and inputs.lookup_run:
                # a copy's outcome is seen every round (observe): this request's rates by copy run
                # know every draft length, where the MLP's lookup head predicts the first few
                gains = self.copying.gains(name, copy_situation(inputs.lookup_run), k_max)
            elif rates is not None:
                # a request drafting past the positions the MLP predicts: its last rate for the rest
                rates = rates + rates[-1:] * (k_max - len(rates))
                gains = raw = expected_tokens_by_k(rates, k_max)
                calibration = self.calibration.get(name)
                if calibration is not None:
                    f = calibration.factor()
                    gains = expected_tokens_by_k([min(p * f, 1.0) for p in rates], k_max)
            else:
                gains = self.acceptance.gains(name, where, k_max)
            catch_up, a, b = self.costs.drafting_line(name, inputs.backlogs[name])
            options.priced.append(Priced(name, gains, plain, catch_up, a, b, where, raw))
        return options

    def predicted_rates(self, inputs: RoundInputs) -> dict[str, list[float]]:
        """The learned policy's p_1..p_K per drafter it has a head for ({} for the cost policy)."""
        if self.learned is None or inputs.hidden is None:
            return {}
        scalars = scalar_features(self.learned.cfg, inputs.entropy, inputs.top1, inputs.match, self.acceptance)
        return self.learned.rates_at(inputs.hidden, scalars)


_logged: set[str] = set()


def _log_once(message: str) -> None:
    """A configuration warning once per process, not once per request."""
    if message not in _logged:
        _logged.add(message)
        log.warning(message)
