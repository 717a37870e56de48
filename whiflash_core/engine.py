"""The speculative decoding loop.

A `Generation` is one request's state machine: `prefill()` once, then `step()` per round until
`finished`. Each `step()` is one round and returns its `Round` record (whiflash_core/rounds.py):

    route    the router picks a drafter and a draft length k        (router.py)
    propose  the drafter catches up on verified context, drafts d1..dk   (drafters/)
    verify   one target forward over [pending, d1..dk]; accept a drafts + 1 target token
    commit   keep K/V and taps of the accepted prefix, emit the tokens

Every emitted token is the target's own choice (greedy argmax of the verifying forward, or
rejection sampling that preserves the target distribution), so all methods produce the output of
plain decoding. Each token records its source (a drafter name, or "target" for the
bonus/correction token) and its round.

Stepping requests round by round lets a server interleave many of them fairly and stop one
within a round when its client goes away.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from .buffers import BufferPool
from .config import SpeculationConfig
from .costs import CostModel
from .drafters.base import Context, Draft, Drafter, DraftSampling
from .drafters.ngram import NgramDrafter
from .logits import LogitAdjustments, Penalizer, TokenLogprob, token_logprobs
from .prefix_cache import PrefixCache
from .rounds import Round, RoundTimes, Tally
from .router import (LOOKUP, METHODS, Candidate, Method, Options, Route, Router, RouterCalibration, available_methods,
                     choose_shared)
from .router_mlp import RouterMLP
from .sampling import SamplingParams, mask_logits, target_probs, verify_greedy, verify_sampling
from .target import TargetModel, TargetOutput

log = logging.getLogger(__name__)

# A target forward of this many rows or more (a prefill, a new agent turn, the verify rows of
# several requests stepped together, a long draft) runs on Engine.large_threads where that is set;
# smaller ones (one request's plain step or short verify) keep the caller's thread count. Of the
# thresholds 4 to 128 measured under the agent load test on a 2-core Xeon, 8 gave 8 streams the
# most tokens/s and one stream as many as 4 did (README "Threads",
# bench/results/load_pool_threads_xeon.json). See Engine.threads_for.
LARGE_FORWARD_ROWS = 8
# the most prompt rows that ride in a shared step (Engine.prefill_rides) where the target has no
# layer stack (whose own limit, layer_stack.STACK_ROWS, applies where it has one)
SHARED_PREFILL_MAX_ROWS = 64

__all__ = ["METHODS", "Method", "SpeculationConfig", "GenerationRequest", "Engine", "Generation", "Round"]


class Constraint(Protocol):
    """Grammar constraint on the output (e.g. JSON for tool calls). Implementations must be able
    to look ahead along a draft without committing (xgrammar's matcher can roll back)."""

    def bitmasks(self, draft: list[int]) -> torch.Tensor:
        """Allowed-token masks for rows 0..m-1 of a verification, where row i follows draft[:i];
        m-1 is the length of the longest draft prefix the grammar accepts. Packed as xgrammar packs
        them: int32 [m, ceil(V / 32)], bit b of word w allows token 32 w + b; ids past the last word
        (a padded LM head's) are never allowed (decode_ops.argmax_rows and
        sampling.mask_logits read them)."""

    def advance(self, tokens: list[int]) -> None:
        """Commit emitted tokens."""

    def is_terminated(self) -> bool: ...


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    stop_token_ids: list[int] | None = None   # default: the model's EOS ids
    constraint: Constraint | None = None
    adjustments: LogitAdjustments = field(default_factory=LogitAdjustments)  # penalties, logit_bias
    logprobs: int | None = None   # report each token's log-probability and this many alternatives (None: off)
    cache_namespace: str = ""   # prefix-cache tenant: a request only reuses its own namespace's prefixes


@dataclass
class RoundPlan:
    """A round up to its verification (Generation.plan -> target forward -> commit). Built in three
    steps: routed (n, route, k), drafted (draft, failed), finished (masks, rows)."""
    n: int                       # verified positions before the round
    route: Route
    k: int                       # draft length asked for (the route's, capped by max_tokens and the context)
    clock: _Clock
    draft: Draft | None = None
    failed: str | None = None    # the drafter that raised this round, if any
    masks: torch.Tensor | None = None   # grammar masks for the verify rows (Constraint.bitmasks)
    rows: torch.Tensor | None = None    # [k' + 1] token ids to verify: pending, d1..dk'


@dataclass
class RoundOptions:
    """A round before its route is chosen (Generation.round_options): the router's candidates."""
    n: int                       # verified positions before the round
    limit: int                   # most draft tokens (max_tokens, the context)
    clock: _Clock
    priced: Options              # the router's candidates: the plain step (or a route decided by rule) first


class Engine:
    """A target, its drafters, the router calibration, the learned policy's MLP and the round-cost
    model, shared by all requests."""

    def __init__(self, target: TargetModel, tokenizer=None, drafters: dict[str, Drafter] | None = None,
                 calibration: RouterCalibration | None = None, model_name: str = "target",
                 costs: CostModel | None = None, prefix_cache: PrefixCache | None = None,
                 router_mlp: RouterMLP | None = None, copy_prior: dict[int, list[float]] | None = None):
        self.target = target
        self.tokenizer = tokenizer
        self.drafters = dict(drafters or {})
        self.drafters.setdefault(LOOKUP, NgramDrafter())  # weightless: always available
        self.calibration = calibration or RouterCalibration()
        self.router_mlp = router_mlp   # speculation.policy "learned" (None: such requests route by cost)
        self.copy_prior = copy_prior   # prompt lookup's acceptance by copy run, measured (acceptance.py)
        # what rounds cost on this machine: learned from every request's rounds (costs.py)
        self.costs = costs or CostModel()
        self.model_name = model_name
        taps = sorted({t for d in self.drafters.values() for t in d.tap_layers})
        self.tap_layers = tuple(taps)
        self.eos_ids = list(target.cfg.eos_token_ids)
        self.prefix_cache = prefix_cache or PrefixCache(0)   # budget 0: off
        self.buffers = BufferPool()   # the requests' KV caches and taps, recycled between requests
        # torch threads for forwards of large_from_rows rows or more (None: the caller's count)
        self.large_threads: int | None = None
        self.large_from_rows = LARGE_FORWARD_ROWS

    @contextmanager
    def threads_for(self, rows: int):
        """Run a target forward of `rows` rows on `large_threads` threads when it is that large and
        they are set, else on the caller's. A server steps its requests on one core fewer than the
        machine has (app.settings.step_threads): with every core in OpenMP's team, each of a small
        forward's ~150 parallel regions waits whenever the HTTP loop, the tokenizer or a client takes
        a core, and a 2-core Xeon served one agent stream at 100 tokens/s with every forward on 2
        threads against 124-133 on 1. Forwards of large_from_rows rows or more have regions long
        enough to gain from every core (alone, 8 rows after 750 cached positions: 16.4 ms on 1
        thread, 9.6 ms on 2)."""
        if self.large_threads is None or rows < self.large_from_rows:
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(self.large_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    @property
    def methods(self) -> list[str]:
        return available_methods(self.drafters)

    @property
    def max_context(self) -> int:
        return self.target.cfg.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.target.cfg.vocab_size

    def start(self, request: GenerationRequest) -> Generation:
        return Generation(self, request)

    def step_many(self, gens: list[Generation], prefills: list[tuple[Generation, torch.Tensor]] = ()
                  ) -> list[Round | None | Exception]:
        """One round of each generation, with one target forward shared by all of them.

        The requests plan their rounds together (`plan_many`: each routes on its own, then each
        drafter drafts for all the requests that picked it in one pass); their verify rows
        [pending, d1..dk] then go through the target together: the linears (where the weights are
        read, most of a CPU forward's cost) see all rows at once, attention stays per request (its
        own cache and positions). Each request then accepts and rolls back on its own, so its tokens
        do not depend on what it was batched with (float32: the same as stepping it alone,
        tests/test_shared_forward.py).

        `prefills`: starting requests and their prompt rows (`Generation.begin_prefill`). Those that
        fit (`prefill_rides`) ride in the same forward, logits of their last row only, and then emit
        their first token (`finish_prefill`): an agent turn's few new tokens otherwise cost a forward
        of their own while the others wait. The rest run their own forward first (`run_prefill`).

        Returns, per generation of `gens` and then of `prefills`, its Round (None for a prefill, and
        once finished) or the exception that ended its round: one request's failure is its own."""
        results, planned = self.plan_many(gens)
        results += [None] * len(prefills)
        room = self.shared_rows_limit() - sum(plan.rows.shape[0] for _, _, plan in planned)
        riding = []
        for j, (gen, rows) in enumerate(prefills):
            if planned and self.prefill_rides(rows.shape[0]) and rows.shape[0] <= room:
                riding.append((len(gens) + j, gen, rows))
                room -= rows.shape[0]
                continue
            try:
                gen.run_prefill(rows)
            except Exception as exc:
                results[len(gens) + j] = exc
        segments = [(i, gen, plan.rows, 0) for i, gen, plan in planned] + \
            [(i, gen, rows, rows.shape[0] - 1) for i, gen, rows in riding]
        if not segments:
            return results
        taps = self.tap_layers if any(gen.tap_layers for _, gen, _, _ in segments) else ()
        try:
            with self.threads_for(sum(rows.shape[0] for _, _, rows, _ in segments)):
                if len(segments) == 1 and not riding:   # alone: the plain forward (and the same bits as step())
                    (_, gen, plan), = planned
                    outs = [self.target(plan.rows, gen.cache, gen.tap_layers)]
                else:
                    outs = self.target.forward_many([rows for _, _, rows, _ in segments],
                                                    [gen.cache for _, gen, _, _ in segments], taps,
                                                    [first for _, _, _, first in segments])
        except Exception as exc:
            for i, gen, plan in planned:
                gen.cache.rollback(min(plan.n, gen.cache.length))
            for _, gen, _ in riding:
                gen.cache.rollback(gen.cached_tokens)
            for i, _, _, _ in segments:
                results[i] = exc
            return results
        for (i, gen, plan), out in zip(planned, outs):
            try:
                results[i] = gen.commit(plan, out)
            except Exception as exc:
                results[i] = exc
        for (i, gen, _), out in zip(riding, outs[len(planned):]):
            try:
                gen.finish_prefill(out)
            except Exception as exc:
                results[i] = exc
        return results

    def prefill_rides(self, rows: int) -> bool:
        """Whether a prefill of `rows` rows may ride in a shared step (`step_many`): where the target
        runs its forwards on one thread, and the prefill is a few tens of rows, as an agent turn's
        new tokens after the cached conversation (at most what one call of the layer stack takes of
        a request), not a prompt long enough for the prefill twin (its own dtype and weights).

        One thread only, by measurement (8-stream agent load, bench/results/
        load_prefill_rides_zen3.json, AMD EPYC Zen 3): a server of one thread served 1.17x the
        tokens/s with the turns' prefills riding (the prefills had been a third of its engine
        thread's time), while the default two-core server (steps on one thread, forwards of 8 rows
        or more on two) served 0.91x, and its first tokens came later (TTFT p50 0.18 -> 0.27 s), as
        an AMX Xeon's had at two threads (README)."""
        if not self.rides_prefills():
            return False
        stack = self.target.layer_stack
        limit = stack.max_rows if stack is not None else SHARED_PREFILL_MAX_ROWS
        return rows <= limit and rows < self.target.prefill_from_rows

    def rides_prefills(self) -> bool:
        """Whether prefills ride in shared steps at all here: where the target's forwards run on
        one thread (`prefill_rides`)."""
        return (self.large_threads or torch.get_num_threads()) == 1

    def shared_rows_limit(self) -> int:
        """The most rows a shared step takes with prefills riding in it: what one call of the layer
        stack takes (beyond, the forward leaves it for the module path and, past the target's
        prefill_from_rows, the linears' dense copies: the formats measured fastest for long
        prompts, not for many short requests); without a stack, SHARED_PREFILL_MAX_ROWS."""
        stack = self.target.layer_stack
        return stack.max_total_rows if stack is not None else SHARED_PREFILL_MAX_ROWS

    def plan_many(self, gens: list[Generation]) -> tuple[list, list[tuple[int, Generation, RoundPlan]]]:
        """`Generation.plan` for several requests: each routes on its own, then each drafter
        catches up and proposes for all the requests that picked it at once
        (`Drafter.catch_up_many`, `Drafter.propose_many`: one pass of its weights per catch-up,
        chain step or block for all of them). Returns (results, planned): results[i] is the
        exception that ended request i's planning (else None: finished, or planned), planned the
        (i, generation, plan) of those with a round to verify."""
        results: list[Round | None | Exception] = [None] * len(gens)
        options: list[tuple[int, Generation, RoundOptions]] = []
        for i, gen in enumerate(gens):
            try:
                o = gen.round_options(lone=len(gens) == 1)
            except Exception as exc:
                results[i] = exc
                continue
            if o is not None:
                options.append((i, gen, o))
        # several requests: one choice for the whole step, its rows priced by the shared forward
        # (router.choose_shared); alone, a request routes on its own verify curve
        picks: list[Candidate | None] = [None] * len(options)
        if len(options) > 1:
            t0 = time.perf_counter()
            rows = [o.priced.longest() + 1 for _, _, o in options]   # each request's most verify rows
            picks = choose_shared([o.priced.candidates() for _, _, o in options],
                                  [g.router.alpha for _, g, _ in options], self.costs.shared_forward(sum(rows)),
                                  [self.costs.attention(r, o.n) for r, (_, _, o) in zip(rows, options)])
            share = (time.perf_counter() - t0) / len(options)
            for _, _, o in options:
                o.clock.charge("router", share)
        routed: list[tuple[int, Generation, RoundPlan]] = []
        for (i, gen, o), pick in zip(options, picks):
            try:
                routed.append((i, gen, gen.route_round(o, pick)))
            except Exception as exc:
                results[i] = exc
        by_drafter: dict[str, list[tuple[Generation, RoundPlan]]] = {}
        for _, gen, plan in routed:
            if plan.route.drafter is not None:
                by_drafter.setdefault(plan.route.drafter, []).append((gen, plan))
        for name, group in by_drafter.items():
            self._catch_up_together(name, group)
            self._propose_together(name, [(gen, plan) for gen, plan in group if plan.k > 0 and plan.failed is None])
        planned = []
        for i, gen, plan in routed:
            try:
                gen.finish_plan(plan)
            except Exception as exc:
                results[i] = exc
                continue
            planned.append((i, gen, plan))
        return results, planned

    def _catch_up_together(self, name: str, group: list[tuple[Generation, RoundPlan]]) -> None:
        """Drafter `name` catches up for every request of `group` in one call (each charged an equal
        share); if that raises, each request catches up alone (its failure is its own)."""
        if len(group) > 1:
            t0 = time.perf_counter()
            try:
                self.drafters[name].catch_up_many([gen.states[name] for gen, _ in group],
                                                  [gen._context() for gen, _ in group])
                share = (time.perf_counter() - t0) / len(group)
                for _, plan in group:
                    plan.clock.charge("catch_up", share)
                return
            except Exception:
                pass
        for gen, plan in group:
            gen._catch_up_round(plan)

    def _propose_together(self, name: str, group: list[tuple[Generation, RoundPlan]]) -> None:
        """Drafter `name` drafts for every request of `group` in one call, each request charged an
        equal share of its time. If it raises, each request drafts alone, so only the request whose
        draft fails falls back to plain decoding."""
        if len(group) <= 1:
            for gen, plan in group:
                gen._draft_round(plan)
            return
        t0 = time.perf_counter()
        try:
            drafts = self.drafters[name].propose_many(
                [gen.states[name] for gen, _ in group], [gen._context() for gen, _ in group],
                [plan.k for _, plan in group], [gen.draft_sampling for gen, _ in group])
        except Exception:
            for gen, plan in group:
                gen._draft_round(plan)
            return
        share = (time.perf_counter() - t0) / len(group)
        for (gen, plan), draft in zip(group, drafts):
            plan.draft = draft
            plan.clock.charge("draft", share)

    def generate(self, request: GenerationRequest) -> Generation:
        gen = self.start(request)
        gen.prefill()
        while not gen.finished:
            gen.step()
        return gen


class Generation:
    def __init__(self, engine: Engine, request: GenerationRequest):
        spec = request.speculation
        if spec.method not in engine.methods:
            raise ValueError(f"speculation method {spec.method!r} is not available; choose from {engine.methods}")
        if len(request.prompt_ids) == 0:
            raise ValueError("empty prompt")
        self.engine, self.request, self.spec = engine, request, spec
        self.sampling = request.sampling
        # every tensor of the request lives on the target's device (the generator too: sampling
        # draws on the device that holds the distributions)
        self.device = device = engine.target.device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(request.sampling.seed if request.sampling.seed is not None
                                   else int.from_bytes(os.urandom(4), "little"))
        self.draft_sampling = DraftSampling(request.sampling.temperature, self.generator)
        self.stop_ids = set(request.stop_token_ids if request.stop_token_ids is not None else engine.eos_ids)
        threshold = spec.entropy_threshold
        if threshold is None:
            threshold = engine.calibration.threshold(spec.alpha)
        self.router = Router(engine.drafters, spec, threshold, engine.costs, engine.router_mlp, engine.copy_prior)
        self.router.prompt_len = len(request.prompt_ids)

        p = self.prompt_len = len(request.prompt_ids)
        # Buffers start small and grow by doubling: a request without max_tokens may run to the
        # context length, but most stop far earlier.
        capacity = p + min(request.max_new_tokens, 256) + self.router.longest_draft + 2
        self.ids = torch.zeros(capacity, dtype=torch.long, device=device)  # prompt, emitted, then the pending one
        self.ids[:p] = torch.tensor(request.prompt_ids, device=device)
        # the large buffers come from the engine's pool (recycled, not zeroed: whiflash_core/buffers.py)
        self.cache = engine.target.new_cache(capacity, engine.buffers.empty)
        # the target taps hidden states only for drafters that read them (not for prompt lookup)
        drafters = self.router.drafters
        self.tap_layers = engine.tap_layers if any(d.tap_layers for d in drafters.values()) else ()
        self.taps = engine.buffers.empty((capacity, len(self.tap_layers), engine.target.cfg.hidden_size),
                                         engine.target.dtype, device)
        self.states = {name: d.new_state(capacity) for name, d in drafters.items()}

        self.output: list[int] = []      # emitted token ids (stop token excluded)
        self.sources: list[str] = []     # per emitted token: its drafter or "target"
        self.rounds_of: list[int] = []   # per emitted token: its round (0 = prefill)
        self.tally = Tally.over(drafters)
        self.penalizer = Penalizer(request.adjustments, engine.target.cfg.vocab_size) \
            if request.adjustments.active else None
        self.logprobs: list[TokenLogprob] = []   # per emitted token, when the request asks for them
        self.last_logits: torch.Tensor | None = None   # target logits [V] at the last verified position
        self.last_hidden: torch.Tensor | None = None   # its final-norm hidden state [d] (the learned router's input)
        self.finished = False
        self.finish_reason: str | None = None
        self.fallback_from: str | None = None   # a drafter that raised: plain decoding since then
        self.started = time.perf_counter()
        self.prefill_s = 0.0
        self.cached_tokens = 0           # prompt tokens whose K/V came from the prefix cache
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def rounds(self) -> int:
        return self.tally.rounds

    # -- the loop -------------------------------------------------------------------------------

    def prefill(self) -> None:
        """Run the prompt through the target (after the longest prefix the prefix cache holds) and
        emit the first token."""
        self.run_prefill(self.begin_prefill())

    def run_prefill(self, rows: torch.Tensor) -> None:
        """`begin_prefill`'s rows through the target in a forward of their own, then `finish_prefill`."""
        with self.engine.threads_for(rows.shape[0]):
            out = self.engine.target(rows, self.cache, self.tap_layers, logits_from=rows.shape[0] - 1)
        self.finish_prefill(out)

    def begin_prefill(self) -> torch.Tensor:
        """The prompt tokens the target still has to run after the longest prefix the prefix cache
        holds (copied into this request's cache): at least the last one, whose logits choose the
        first token. Their forward (alone: `prefill`; beside other requests' rounds:
        `Engine.step_many`) goes to `finish_prefill`."""
        self._prefill_t0 = time.perf_counter()
        p = self.prompt_len
        if p + 1 >= self.engine.max_context:
            raise ValueError(f"prompt of {p} tokens exceeds the context length {self.engine.max_context}")
        m = self.cached_tokens = self._reuse_cached_prefix()
        return self.ids[m:p]

    def finish_prefill(self, out: TargetOutput) -> None:
        """Keep the forward of `begin_prefill`'s rows (its taps, the prefix cache entry) and emit the
        first token: the argmax (or sample) of the last row's logits (`out.logits[-1]`)."""
        m, p = self.cached_tokens, self.prompt_len
        if self.tap_layers:
            self.taps[m:p] = out.taps
        self._store_prefix()
        masks = self.request.constraint.bitmasks([]) if self.request.constraint else None
        logits = self._target_logits(out.logits[-1:], None)
        _, tok = self._verify(logits, None, masks)
        self.last_logits = out.logits[-1]
        self.last_hidden = out.last_hidden[-1].clone()   # a copy: the prompt's hidden states can go
        self.ids[p] = tok
        self.prefill_s += time.perf_counter() - self._prefill_t0
        self._emit([tok], ["target"], round_index=0, logits=logits)

    def _reuse_cached_prefix(self) -> int:
        """Copy the longest cached prefix of the prompt (at most p - 1 tokens) into this request's
        cache and taps; returns its length (0: nothing cached)."""
        cache = self.engine.prefix_cache
        if not cache.enabled:
            return 0
        p, ns = self.prompt_len, self.request.cache_namespace
        # a request that taps no layers can also use an entry stored with taps (it ignores them);
        # one that taps needs an entry with its taps
        options = (self.tap_layers,) if self.tap_layers else tuple(dict.fromkeys(((), self.engine.tap_layers)))
        hit = cache.lookup(ns, options, self.ids[:p], limit=p - 1)
        if hit is None:
            return 0
        m, entry = hit.length, hit.entry
        # tens of MB for an agent conversation (SmolLM2, 1k positions: 11.5 MB of K, as much of V):
        # copied on every core, as a forward of many rows runs (measured, 1 -> 2 threads: 0.80 ->
        # 0.41 ms per 11.5 MB in cache)
        with self.engine.threads_for(m):
            self.cache.load_prefix(entry.k, entry.v, m)
            if self.tap_layers:
                self.taps[:m] = entry.taps[:m]
        self.cache.lineage, self.cache.lineage_len = entry.lineage, min(entry.lineage_len, m)
        # the drafters' caches over the prefix, as far as the prefix determines them
        for name, (k, v) in entry.drafters.items():
            state = self.states.get(name)
            if state is None or state.cache is None:
                continue
            s = min(k.shape[2], m - self.router.drafters[name].cache_lookahead)
            if s > 0:
                state.cache.ensure(s)
                state.cache.k[:, :, :s] = k[:, :, :s]
                state.cache.v[:, :, :s] = v[:, :, :s]
                state.n_seen = state.cache.length = s
        return m

    def _store_prefix(self) -> None:
        """Offer the verified sequence (positions 0..cache.length-1) to the prefix cache."""
        cache = self.engine.prefix_cache
        if cache.enabled:
            n = self.cache.length
            drafters = {name: (state.cache.k, state.cache.v, state.n_seen) for name, state in self.states.items()
                        if state.cache is not None and state.n_seen > 0}
            cache.store(self.request.cache_namespace, self.tap_layers, self.ids[:n], self.cache.k, self.cache.v,
                        self.taps[:n] if self.tap_layers else None, drafters,
                        (self.cache.lineage, self.cache.lineage_len))

    def step(self) -> Round | None:
        """One speculation round (None once finished)."""
        plan = self.plan()
        if plan is None:
            return None
        with self.engine.threads_for(plan.rows.shape[0]):
            out = self.engine.target(plan.rows, self.cache, self.tap_layers)
        return self.commit(plan, out)

    def plan(self) -> RoundPlan | None:
        """The first half of a round, up to the verify forward: route and draft. Returns the rows
        the target must verify ([pending, d1..dk]), or None once finished. `step()` runs the forward
        for this request alone; `Engine.step_many` plans several requests' rounds together
        (`Engine.plan_many`) and runs one forward for all of them."""
        plan = self.route_round()
        if plan is None:
            return None
        if plan.route.drafter is not None:
            self._catch_up_round(plan)
            self._draft_round(plan)
        self.finish_plan(plan)
        return plan

    def round_options(self, lone: bool = True) -> RoundOptions | None:
        """A round's first step: the router's candidates for this round's drafter and draft
        length (never past max_tokens or the context); `lone`: no shared step will read them, the
        router may return its pick alone (Router.options). None once finished."""
        if self.finished:
            return None
        n = self.cache.length  # ids[:n] verified (K/V cached), ids[n] = pending token the target chose
        self._ensure_capacity(n + self.router.longest_draft + 2)
        clock = _Clock()
        limit = min(self.request.max_new_tokens - len(self.output) - 1, self.engine.max_context - n - 2)
        candidates = self.router.options(self.states, self._context(), self.last_logits, limit, self.last_hidden,
                                         lone=lone)
        clock.lap("router")
        return RoundOptions(n, limit, clock, candidates)

    def route_round(self, options: RoundOptions | None = None, pick: Candidate | None = None) -> RoundPlan | None:
        """The round's route: `pick` among `options` (chosen for a shared step, Engine.plan_many),
        else the request's own best. None once finished."""
        options = options if options is not None else self.round_options()
        if options is None:
            return None
        route = self.router.take(pick if pick is not None else options.priced.best(self.router.alpha),
                                 self.states, self._context())
        options.clock.lap("router")   # choosing among the candidates is the router's work too
        return RoundPlan(options.n, route, min(route.draft_len, options.limit), options.clock)

    def _catch_up_round(self, plan: RoundPlan) -> None:
        """The round's drafter catches up on verified context it has not seen (lazily: only the
        drafter chosen this round, so an idle one's backlog is processed in one batched pass)."""
        t0 = time.perf_counter()
        try:
            self._catch_up(plan.route.drafter, self._context())
        except Exception as exc:
            self._drafter_failed(plan, exc)
        plan.clock.charge("catch_up", time.perf_counter() - t0)

    def _draft_round(self, plan: RoundPlan) -> None:
        """This request's draft d1..dk alone (with its proposal distributions q [k, V] when sampling)."""
        if plan.failed is not None or plan.route.drafter is None or plan.k <= 0:
            return
        name, t0 = plan.route.drafter, time.perf_counter()
        try:
            plan.draft = self.router.drafters[name].propose(self.states[name], self._context(), plan.k,
                                                             self.draft_sampling)
        except Exception as exc:
            self._drafter_failed(plan, exc)
        plan.clock.charge("draft", time.perf_counter() - t0)

    def _drafter_failed(self, plan: RoundPlan, exc: Exception) -> None:
        # a draft is only a proposal: without it this round (and the rest) is plain decoding,
        # still the target's own tokens, so the request goes on instead of failing
        plan.failed = plan.route.drafter
        self._fall_back(plan.failed, exc)
        plan.route, plan.draft = Route(None), None

    def finish_plan(self, plan: RoundPlan) -> None:
        """The round's last step before verification: a grammar constraint cuts the draft before the
        first token it forbids; the rows to verify are [pending, d1..dk]."""
        draft = plan.draft if plan.draft is not None else Draft(self.ids[:0])
        masks = self.request.constraint.bitmasks(draft.tokens.tolist()) if self.request.constraint else None
        if masks is not None:
            draft = Draft(draft.tokens[: masks.shape[0] - 1], draft.probs)
        plan.draft, plan.masks = draft, masks
        plan.rows = torch.cat([self.ids[plan.n:plan.n + 1], draft.tokens])

    def commit(self, plan: RoundPlan, out) -> Round:
        """The second half of a round, given the target's forward over `plan.rows` (this request's
        K/V already appended to its cache): accept, roll back, emit."""
        n, route, draft, masks, clock = plan.n, plan.route, plan.draft, plan.masks, plan.clock
        k = draft.tokens.shape[0]
        # verify: the forward over [pending, d1..dk] gave logits p [k+1, V]; keep the longest
        # prefix d1..da the target agrees with (greedy: d_i = argmax p_i; sampling: accept d_i with
        # prob min(1, p_i(d_i) / q_i(d_i))) plus one token of its own from row a+1: the correction
        # (sampled from the residual max(0, p - q), renormalised) or, when a = k, the bonus.
        logits = self._target_logits(out.logits, draft)   # penalties and logit_bias, row by row
        a, nxt = self._verify(logits, draft, masks)
        self.last_logits, self.last_hidden = out.logits[a], out.last_hidden[a]   # where the next round routes from
        # commit: the cache keeps pending + d1..da (positions n..n+a); nxt becomes the new pending token
        self.cache.rollback(n + a + 1)
        if self.tap_layers:
            self.taps[n:n + a + 1] = out.taps[: a + 1]
        emitted = draft.tokens[:a].tolist() + [nxt]
        self.ids[n + 1:n + a + 2] = torch.tensor(emitted, device=self.device)
        clock.lap("verify")
        r = Round(self.rounds + 1, route.drafter, k, a, switched=route.switched, entropy=route.entropy,
                  times=clock.times, fallback_from=plan.failed)
        r.decided, r.tokens, r.sources = self._emit(emitted, [route.drafter] * a + ["target"], r.index, logits)
        t0 = time.perf_counter()
        self.router.observe(route, r)   # the router learning from the round is router time too
        clock.charge("router", time.perf_counter() - t0)
        self.tally.add(r)
        return r

    # -- helpers --------------------------------------------------------------------------------

    def _fall_back(self, drafter: str, exc: Exception) -> None:
        """Plain decoding (method none) for the rest of this request after `drafter` raised."""
        log.warning("drafter %s failed (%s: %s); plain decoding for the rest of this request",
                    drafter, type(exc).__name__, exc, exc_info=exc)
        self.fallback_from = drafter
        self.router = Router(self.engine.drafters, replace(self.spec, method="none"), threshold=0.0)

    def _catch_up(self, name: str, ctx: Context) -> None:
        self.router.drafters[name].catch_up(self.states[name], ctx)

    def _context(self) -> Context:
        return Context(self.ids, self.cache.length, self.taps, self.engine.tap_layers)

    def _ensure_capacity(self, end: int) -> None:
        """Room for positions < end in the token and tap buffers (caches grow on their own)."""
        if end <= self.ids.shape[0]:
            return
        size = max(end, 2 * self.ids.shape[0])
        ids = torch.zeros(size, dtype=torch.long, device=self.device)
        ids[: self.ids.shape[0]] = self.ids
        taps = self.engine.buffers.empty((size,) + self.taps.shape[1:], self.taps.dtype, self.device)
        taps[: self.taps.shape[0]] = self.taps
        self.ids, self.taps = ids, taps

    def _target_logits(self, logits: torch.Tensor, draft: Draft | None) -> torch.Tensor:
        """The request's target distribution (penalties, logit_bias) at each verified row."""
        if self.penalizer is None:
            return logits
        return self.penalizer.apply(logits, draft.tokens if draft is not None else self.ids[:0])

    def _verify(self, logits: torch.Tensor, draft: Draft | None, masks: torch.Tensor | None) -> tuple[int, int]:
        """(accepted a, next token) for a draft (None: no draft) against target logits [k+1, V];
        grammar masks (Constraint.bitmasks, m rows) cut the rows to those the grammar allows."""
        tokens = draft.tokens if draft is not None else torch.zeros(0, dtype=torch.long, device=self.device)
        if masks is not None:
            logits, tokens = logits[: masks.shape[0]], tokens[: masks.shape[0] - 1]
        if self.sampling.greedy:
            return verify_greedy(tokens, logits, masks)
        probs = target_probs(logits if masks is None else mask_logits(logits, masks), self.sampling)
        q = None if draft is None or draft.probs is None else draft.probs[: tokens.shape[0]]
        return verify_sampling(tokens, q, probs, self.generator)

    def _emit(self, tokens: list[int], sources: list[str], round_index: int,
              logits: torch.Tensor) -> tuple[int, list[int], list[str]]:
        """Append tokens up to a stop token or max_tokens; finish the request when it is done.
        `logits` [>= len(tokens), V]: the target rows that chose them (for penalties and logprobs).
        Returns (tokens decided: the kept ones plus a stop token, kept tokens, their sources)."""
        reason = None
        kept = len(self.output)
        decided = 0
        for tok, src in zip(tokens, sources):
            if tok in self.stop_ids:
                reason = "stop"
                decided += 1
                break
            if len(self.output) >= self.request.max_new_tokens:
                break
            self.output.append(tok)
            self.sources.append(src)
            self.rounds_of.append(round_index)
            decided += 1
        new, new_sources = self.output[kept:], self.sources[kept:]
        if self.penalizer is not None:
            self.penalizer.add(new)
        if self.request.logprobs is not None and new:
            self.logprobs += token_logprobs(logits, new, self.request.logprobs)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        constraint = self.request.constraint
        if constraint is not None and reason is None:
            constraint.advance(new)
            if constraint.is_terminated():
                reason = "stop"
        if reason is None and (len(self.output) >= self.request.max_new_tokens
                               or self.cache.length + 2 >= self.engine.max_context):
            reason = "length"
        if reason is not None:
            self._finish(reason)
        return decided, new, new_sources

    def _finish(self, reason: str) -> None:
        if not self.finished:
            self.finished, self.finish_reason = True, reason
            self.finished_time = time.perf_counter()
            self._store_prefix()   # the next turn of this conversation starts with all of it

    def cancel(self) -> None:
        self._finish("cancelled")

    # -- reporting ------------------------------------------------------------------------------

    def stats(self, trace: bool | None = None) -> dict:
        """Per-request stats in the shape the HTTP API returns."""
        trace = self.spec.trace if trace is None else trace
        t = self.tally
        out = {
            "method": self.spec.method,
            "rounds": t.rounds,
            "draft_tokens": t.draft_tokens,
            "accepted_tokens": t.accepted_tokens,
            "acceptance_length": t.acceptance_length or 0.0,
            "drafters": {name: d.as_dict() for name, d in t.drafters.items()},
            "switches": t.switches,
        }
        if self.router.routes:   # the policy that routed (a request asking for `learned` without its MLP: cost)
            out["policy"] = self.router.policy
        if self.fallback_from is not None:
            out["fallback_from"] = self.fallback_from
        if trace:
            tok = self.engine.tokenizer
            out["tokens"] = [
                {"id": t, "text": tok.decode([t]) if tok is not None else "", "source": s, "round": r}
                for t, s, r in zip(self.output, self.sources, self.rounds_of)
            ]
        return out

    def timing(self) -> dict:
        end = self.finished_time or time.perf_counter()
        return {"total_s": end - self.started, **self.tally.times.as_dict(), "prefill": round(self.prefill_s, 6),
                "ttft_s": (self.first_token_time - self.started) if self.first_token_time else None}


class _Clock:
    """Splits a round's wall time into its phases: each lap() charges the time since the last."""

    def __init__(self):
        self.times = RoundTimes()
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        setattr(self.times, phase, getattr(self.times, phase) + now - self.last)
        self.last = now

    def charge(self, phase: str, seconds: float) -> None:
        """Charge `seconds` (this request's share of work done for several) to `phase`; the next
        lap starts now."""
        setattr(self.times, phase, getattr(self.times, phase) + seconds)
        self.last = time.perf_counter()
