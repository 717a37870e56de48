"""A request's routing round in one C call (kernels/decode_ops.c, `router_round`).

router.py defines the `cost` and `learned` policies; for a request alone (no shared step) its
round is the target's entropy and top-1 probability, the learned MLP's scalars and forward, and
every (drafter, k) candidate's g and t with argmax g / t ** alpha. In Python that is ~100
interpreter calls on the cold caches a target forward leaves behind: ~125 us, 3 % of a round on
a 2-core Xeon, ~300 us on an AVX2 Zen 3. Here the Router keeps a copy of its acceptance state
(both AcceptanceModels, updated together in Router.observe) in C structs and prices the round in
one call; Router.options falls back to the Python round wherever this does not apply (no C ops,
another policy, a shared step, logits that are not one float32 row).

The two are the same function: tests/test_router_native.py draws random request states and
checks the C pick against `Options.best` field for field (the acceptance arithmetic is double, as
Python's floats are, and the C build keeps multiply-adds unfused).
"""
from __future__ import annotations

import ctypes
import math
from typing import TYPE_CHECKING

import torch

from . import acceptance, decode_ops
from .costs import MIN_SECONDS

if TYPE_CHECKING:
    from .drafters.base import Context, DrafterState
    from .router import Candidate, Router

K, S, D = 32, 8, 8   # RT_K, RT_S, RT_D: positions, situations and drafters the C structs hold
MAX_PENDING = 16     # round outcomes a round's call applies first (more: applied by a call of their own)


class _Rates(ctypes.Structure):
    _fields_ = [("rate", ctypes.c_double * K), ("weight", ctypes.c_double * K), ("n", ctypes.c_int64)]


class _Acceptance(ctypes.Structure):
    _fields_ = [("overall", _Rates * D), ("by", (_Rates * S) * D), ("prior_rate", ctypes.c_double * D),
                ("measured", (ctypes.c_double * K) * S), ("measured_n", ctypes.c_int64 * S)]


class _Config(ctypes.Structure):
    _fields_ = [("n_routed", ctypes.c_int64), ("lookup", ctypes.c_int64),
                ("min_ngram", ctypes.c_int64), ("max_ngram", ctypes.c_int64), ("longest_run", ctypes.c_int64),
                ("copy_run_bins", ctypes.c_int64 * 4),
                ("by_match", ctypes.c_int64 * D),
                ("route_len", ctypes.c_int64 * D), ("head_offset", ctypes.c_int64 * D), ("head_len", ctypes.c_int64 * D),
                ("n_feat", ctypes.c_int64), ("feat_drafter", ctypes.c_int64 * D), ("feat_k", ctypes.c_int64 * D),
                ("w1", ctypes.c_void_p), ("b1", ctypes.c_void_p), ("w2", ctypes.c_void_p), ("b2", ctypes.c_void_p),
                ("d", ctypes.c_int64), ("hidden_width", ctypes.c_int64), ("outputs", ctypes.c_int64),
                ("top1_bins", ctypes.c_double * 3), ("prior_weight", ctypes.c_double), ("decay", ctypes.c_double),
                ("min_seconds", ctypes.c_double), ("catch_up_share", ctypes.c_double), ("seen_from", ctypes.c_int64)]


class NativeRound:
    """One Router's C twin: its configuration, its two acceptance models' state, its round buffer.
    `make` returns None where the C round does not apply to this router."""

    def __init__(self, lib, router: Router):
        from .router import LOOKUP, Candidate

        self._lib, self._router, self._candidate = lib, router, Candidate
        routed = list(router.drafters)
        learned = router.learned
        feat = list(learned.cfg.drafters) if learned is not None else []
        self.names = routed + [n for n in feat if n not in routed]
        self.index = {n: i for i, n in enumerate(self.names)}
        c = self.cfg = _Config()
        c.n_routed = len(routed)
        c.lookup = self.index[LOOKUP] if LOOKUP in routed else -1
        self.lookup_name, self.copy_len = LOOKUP, router.route_lens.get(LOOKUP, 0)
        if LOOKUP in routed:
            ngram = router.drafters[LOOKUP].cfg
            c.min_ngram, c.max_ngram, c.longest_run = ngram.min_ngram, ngram.max_ngram, ngram.longest_run
        c.copy_run_bins[:] = acceptance.COPY_RUN_BINS
        for i, n in enumerate(self.names):
            c.by_match[i] = int(n == LOOKUP)   # acceptance.situation
            c.route_len[i] = router.route_lens.get(n, 0)
        if learned is not None:
            offset = 0
            for n, k in zip(learned.cfg.drafters, learned.cfg.draft_lens):
                c.head_offset[self.index[n]], c.head_len[self.index[n]] = offset, k
                offset += k
            c.n_feat = len(feat)
            for f, (n, k) in enumerate(zip(learned.cfg.drafters, learned.cfg.draft_lens)):
                c.feat_drafter[f], c.feat_k[f] = self.index[n], k
        c.top1_bins[:] = acceptance.TOP1_BINS
        c.prior_weight, c.decay, c.min_seconds = acceptance.PRIOR_WEIGHT, acceptance.RATE_DECAY, MIN_SECONDS
        self.acc, self.copying = _Acceptance(), _Acceptance()
        for i, n in enumerate(self.names):
            rate = acceptance.PRIOR_RATE.get(n, acceptance.DEFAULT_PRIOR_RATE)
            self.acc.prior_rate[i] = self.copying.prior_rate[i] = rate
        for where, rates in router.copying.priors.items():
            self.copying.measured_n[where] = min(len(rates), K)
            self.copying.measured[where][:min(len(rates), K)] = rates[:K]
        self._verify = (ctypes.c_double * (K + 2))()   # a round's inputs and output (router_round)
        # 4 per drafter (its catch-up and draft lines), then the calibration factors: the lines are
        # written when they change (every round only while the cost model adapts), the factors
        # when a round's outcome moves one (`calibrated`)
        self._line = (ctypes.c_double * (5 * D))()
        self._lines_set = False
        for i in range(c.n_routed):
            self._line[4 * c.n_routed + i] = -1.0
        self._states: list | None = None   # the request's DrafterStates, routed drafters' order
        self._seen = (ctypes.c_int64 * D)()
        self._out = (ctypes.c_double * 10)()
        # the rounds' outcomes not yet applied to the C state: 5 ints each (router_apply), passed
        # with the next round's call (observe is one list append, not a C call of its own)
        self._pending: list[int] = []
        self._updates = (ctypes.c_int64 * (5 * MAX_PENDING))()
        self._mlp = None   # the MLP's C call whose weights cfg points at (RouterMLP._folded)
        self._mlp_fixed = False   # the MLP is frozen (serving): bound once for the request
        self._ids = self._verify_list = None   # the token buffer checked, the verify curve written last
        self._args = (ctypes.byref(self.cfg), ctypes.byref(self.acc), ctypes.byref(self.copying))
        self._round_args = (self._args[0], self._args[1], self._args[2], self._updates)

    @classmethod
    def make(cls, router: Router) -> NativeRound | None:
        from .router import LOOKUP

        lib = decode_ops._library()
        if lib is None or not router.routes or router.policy not in ("cost", "learned"):
            return None
        if len(acceptance.COPY_RUN_BINS) != 4 or len(acceptance.TOP1_BINS) != 3:   # the C config's arrays
            return None
        learned = router.learned
        names = set(router.drafters) | set(learned.cfg.drafters if learned is not None else ())
        max_match = router.drafters[LOOKUP].cfg.max_ngram if LOOKUP in router.drafters else 0
        situations = max(max_match, len(acceptance.COPY_RUN_BINS), *router.copying.priors, len(acceptance.TOP1_BINS))
        if (len(names) > D or router.longest_draft > K or situations >= S
                or (learned is not None and max(learned.cfg.draft_lens, default=0) > K)):
            return None
        return cls(lib, router)

    def _bind_mlp(self) -> bool:
        """Point the config at the learned MLP's folded weights (again if they were refolded)."""
        learned = self._router.learned
        call = learned._folded()[2]
        if call is None:
            return False
        self._mlp_fixed = learned.__dict__.get("_frozen") is not None
        if call is not self._mlp:
            w1, b1, w2, b2 = call._weights
            c = self.cfg
            c.w1, c.b1, c.w2, c.b2 = w1.data_ptr(), b1.data_ptr(), w2.data_ptr(), b2.data_ptr()
            c.d, c.hidden_width, c.outputs = call.hidden_size, call.width, call.outputs
            self._mlp = call
        return True

    def pick(self, states_by_name: dict[str, DrafterState], ctx: Context, logits: torch.Tensor, hidden: torch.Tensor | None,
             limit: int) -> Candidate | None:
        """Router.options' pick for a request alone (its arguments; `limit` >= 0): Options.best of
        Router._gain_options, with Router._lookup_inputs' search (the copy kept for `observe`, the
        match for prompt lookup's propose). None where the C round does not take these inputs (the
        caller prices the round in Python)."""
        if logits.dtype is not torch.float32 or not logits.is_cpu or logits.dim() != 1 or not logits.is_contiguous():
            return None
        ids, n = ctx.ids, ctx.n
        if ids is not self._ids:   # a request's token buffer changes only when it grows
            if ids.dtype is not torch.int64 or not ids.is_cpu or not ids.is_contiguous():
                return None
            self._ids = ids
        router, c = self._router, self.cfg
        learned = router.learned is not None and hidden is not None
        if learned:
            if not (self._mlp_fixed or self._bind_mlp()) or hidden.shape != (c.d,) or not hidden.is_cpu:
                return None
            if hidden.dtype not in (torch.bfloat16, torch.float32) or not hidden.is_contiguous():
                hidden = hidden.float().contiguous()
        costs = router.costs
        verify = costs.verify.estimates(min(router.longest_draft, limit) + 1)
        if verify is not self._verify_list:   # the same list while the cost model is not adaptive
            self._verify[:len(verify)] = verify
            self._verify_list = verify
        if not self._lines_set or costs.adaptive:   # the drafters' catch-up and draft lines
            self._line[:4 * c.n_routed] = costs.drafting_coefficients(router.drafters)
            c.catch_up_share, self._lines_set = costs.catch_up_share, True
        states = self._states
        if states is None:   # the request's states, once (the objects stay; their n_seen moves)
            states = self._states = [states_by_name[name] for name in router.drafters]
        seen = self._seen
        for i, state in enumerate(states):
            seen[i] = state.n_seen
        c.seen_from = router.prompt_len   # the prompt is charged to no round (Router.__init__)
        pending = self._pending
        if len(pending) > 5 * MAX_PENDING:   # many shared steps since this request last routed alone
            self.flush()
        count = len(pending) // 5
        if count:
            self._updates[:len(pending)] = pending
            pending.clear()
        self._lib.router_round(*self._round_args, count, ids.data_ptr(), n, logits.data_ptr(), logits.shape[0],
                               hidden.data_ptr() if learned else None, learned and hidden.dtype is torch.bfloat16,
                               limit, router.alpha, costs.router.value, self._verify, self._line, seen, self._out)
        d, k, where, tokens, seconds, drafting, raw, match, start, run = self._out
        router._copy = None
        if c.lookup >= 0:   # what Router._lookup_inputs keeps: the search for propose, the copy for observe
            lookup, match, start, run = router.drafters[self.lookup_name], int(match), int(start), int(run)
            lookup.keep(states_by_name[self.lookup_name], n, (match, start, run))
            if match:
                router._copy = (acceptance.copy_situation(run), lookup.copy(ids, n, start, self.copy_len))
        if d < 0:
            return self._candidate(None, 0, 1.0, seconds, drafting)
        return self._candidate(self.names[int(d)], int(k), tokens, seconds, drafting, int(where),
                               None if math.isnan(raw) else raw)

    def calibrated(self, drafter: str, factor: float) -> None:
        """The request's calibration factor of `drafter` is now `factor` (Calibration.factor)."""
        i = self.index.get(drafter, D)
        if i < self.cfg.n_routed:
            self._line[4 * self.cfg.n_routed + i] = factor

    def update(self, drafter: str, where: int, k: int, accepted: int) -> None:
        """AcceptanceModel.update of the router's `acceptance`, on this copy (applied with the next
        round's call)."""
        self._pending += (0, self.index.get(drafter, -1), where, k, accepted)

    def update_copy(self, where: int, k: int, accepted: int) -> None:
        """AcceptanceModel.update of the router's `copying` (prompt lookup by copy run), likewise."""
        self._pending += (1, self.cfg.lookup, where, k, accepted)

    def flush(self) -> None:
        """Apply the pending outcomes now."""
        if self._pending:
            updates = (ctypes.c_int64 * len(self._pending))(*self._pending)
            self._lib.router_apply(self._args[1], self._args[2], self._args[0], updates, len(self._pending) // 5)
            self._pending.clear()

    def rates(self, which: str, drafter: str, where: int, k: int) -> list[float]:
        """p_1..p_k of this copy of `acceptance` or `copying` (tests)."""
        self.flush()
        out = (ctypes.c_double * k)()
        self._lib.router_rates(self._args[2] if which == "copying" else self._args[1], self._args[0],
                               self.index[drafter], where, k, out)
        return list(out)
