"""The speculative decoding loop.

A `Generation` is one request's state machine: `prefill()` once, then `step()` per round until
`finished`. One round:

    router picks a drafter  ->  drafter catches up (lazily) and drafts k tokens
    ->  target verifies [pending, d1..dk] in one forward  ->  accept a drafts + 1 target token
    ->  target cache rolled back to the accepted length

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
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

import torch

from .drafters.base import Context, Drafter, DraftSampling
from .drafters.ngram import NgramDrafter
from .router import EntropyRouter, RouterCalibration
from .sampling import SamplingParams, sample, target_probs, verify_greedy, verify_sampling
from .target import TargetModel

log = logging.getLogger(__name__)

Method = Literal["none", "eagle3", "dflash", "ngram", "whiflash"]
METHODS: tuple[str, ...] = get_args(Method)
# whiflash consults prompt lookup first and takes its draft when the context's last LOOKUP_FIRST_NGRAM
# tokens occurred before (a shorter match is too often chance in free text to beat the router's pick)
LOOKUP_FIRST_NGRAM = 3


@dataclass
class SpeculationConfig:
    method: str = "whiflash"
    policy: str = "entropy"
    alpha: float = 0.5
    num_draft_tokens: int | None = None   # EAGLE-3 chain / prompt-lookup draft length (default: the drafter's)
    block_size: int | None = None         # DFlash block incl. the anchor (default: the drafter's)
    entropy_threshold: float | None = None  # explicit override of the calibrated threshold
    prompt_lookup: bool = True            # whiflash: prompt-lookup drafts first where the context repeats
    trace: bool = False
    eager_catch_up: bool = False          # naive scheme: every drafter catches up every round


class Constraint(Protocol):
    """Grammar constraint on the output (e.g. JSON for tool calls). Implementations must be able
    to look ahead along a draft without committing (xgrammar's matcher can roll back)."""

    def masks(self, draft: list[int]) -> torch.Tensor:
        """Bool [m, V] allowed-token masks for rows 0..m-1 of a verification, where row i follows
        draft[:i]; m-1 is the length of the longest draft prefix the grammar accepts."""

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


@dataclass
class RoundTimes:
    draft: float = 0.0
    verify: float = 0.0
    catch_up: float = 0.0
    router: float = 0.0
    prefill: float = 0.0

    def as_dict(self) -> dict:
        return {k: round(v, 6) for k, v in self.__dict__.items()}


class Engine:
    """A target, its drafters and the router calibration, shared by all requests."""

    def __init__(self, target: TargetModel, tokenizer=None, drafters: dict[str, Drafter] | None = None,
                 calibration: RouterCalibration | None = None, model_name: str = "target"):
        self.target = target
        self.tokenizer = tokenizer
        self.drafters = dict(drafters or {})
        self.drafters.setdefault("ngram", NgramDrafter())  # weightless: always available
        self.calibration = calibration or RouterCalibration()
        self.model_name = model_name
        taps = sorted({t for d in self.drafters.values() for t in d.tap_layers})
        self.tap_layers = tuple(taps)
        self.eos_ids = list(target.cfg.eos_token_ids)

    @property
    def methods(self) -> list[str]:
        out = ["none"] + [m for m in ("eagle3", "dflash", "ngram") if m in self.drafters]
        if "eagle3" in self.drafters and "dflash" in self.drafters:
            out.append("whiflash")
        return out

    @property
    def max_context(self) -> int:
        return self.target.cfg.max_position_embeddings

    def start(self, request: GenerationRequest) -> "Generation":
        return Generation(self, request)

    def generate(self, request: GenerationRequest) -> "Generation":
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
        self.generator = torch.Generator()
        self.generator.manual_seed(request.sampling.seed if request.sampling.seed is not None
                                   else int.from_bytes(os.urandom(4), "little"))
        self.draft_sampling = DraftSampling(request.sampling.temperature, self.generator)
        self.stop_ids = set(request.stop_token_ids if request.stop_token_ids is not None else engine.eos_ids)

        # drafters the router chooses between; whiflash may also take a prompt-lookup draft first
        self.routed = {"none": [], "eagle3": ["eagle3"], "dflash": ["dflash"], "ngram": ["ngram"],
                       "whiflash": ["eagle3", "dflash"]}[spec.method]
        self.lookup_first = spec.method == "whiflash" and spec.prompt_lookup
        self.active = self.routed + (["ngram"] if self.lookup_first else [])
        threshold = spec.entropy_threshold
        if threshold is None:
            threshold = engine.calibration.threshold(spec.alpha)
        self.router = EntropyRouter(threshold)

        p = len(request.prompt_ids)
        longest_draft = max([self._draft_len(n) for n in self.active] + [0])
        self.longest_draft = longest_draft
        # Buffers start small and grow by doubling: a request without max_tokens may run to the
        # context length, but most stop far earlier.
        capacity = p + min(request.max_new_tokens, 256) + longest_draft + 2
        self.prompt_len = p
        self.ids = torch.zeros(capacity, dtype=torch.long)
        self.ids[:p] = torch.tensor(request.prompt_ids)
        self.cache = engine.target.new_cache(capacity)
        hidden = engine.target.cfg.hidden_size
        # the target taps hidden states only for drafters that read them (not for prompt lookup)
        self.tap_layers = engine.tap_layers if any(engine.drafters[d].tap_layers for d in self.active) else ()
        n_taps = len(self.tap_layers)
        self.taps = torch.zeros(capacity, n_taps, hidden, dtype=engine.target.dtype)
        self.states = {name: engine.drafters[name].new_state(capacity) for name in self.active}

        self.output: list[int] = []      # emitted token ids (stop token excluded)
        self.round_tokens = 0            # tokens decided by rounds (a stop token counts too)
        self.sources: list[str] = []
        self.rounds_of: list[int] = []
        self.rounds = 0
        self.switches = 0
        self.per_drafter = {n: {"rounds": 0, "draft_tokens": 0, "accepted_tokens": 0} for n in self.active}
        self.accepted_at = [0] * 65        # accepted drafts per round histogram (index = count)
        self.times = RoundTimes()
        self.last_logits: torch.Tensor | None = None
        self.last_drafter: str | None = None
        self.decisions: list[tuple[str, int]] = []  # (drafter, accepted) per round
        self.entropies: list[float] = []            # router input per round (whiflash)
        self.finished = False
        self.finish_reason: str | None = None
        self.started = time.perf_counter()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    # -- helpers --------------------------------------------------------------------------------

    def _draft_len(self, name: str) -> int:
        drafter = self.engine.drafters[name]
        if name == "dflash":
            block = self.spec.block_size or drafter.cfg.block_size
            return max(0, min(block, drafter.cfg.block_size) - 1)
        k = self.spec.num_draft_tokens or getattr(drafter.cfg, "num_draft_tokens", 4)
        return max(0, min(k, drafter.max_draft_tokens))

    def _ensure_capacity(self, end: int) -> None:
        """Room for positions < end in the token and tap buffers (caches grow on their own)."""
        if end <= self.ids.shape[0]:
            return
        size = max(end, 2 * self.ids.shape[0])
        ids = torch.zeros(size, dtype=torch.long)
        ids[: self.ids.shape[0]] = self.ids
        taps = self.taps.new_zeros((size,) + self.taps.shape[1:])
        taps[: self.taps.shape[0]] = self.taps
        self.ids, self.taps = ids, taps

    def _route(self, n: int) -> str:
        """This round's drafter."""
        ngram = self.engine.drafters["ngram"]
        if self.lookup_first and ngram.match(self.states["ngram"], self.ids, n)[0] >= LOOKUP_FIRST_NGRAM:
            return "ngram"
        if len(self.routed) == 1:
            return self.routed[0]
        name, entropy = self.router.choose(self.last_logits)
        self.entropies.append(entropy)
        return name

    def _context(self) -> Context:
        return Context(self.ids, self.cache.length, self.taps, self.engine.tap_layers)

    def _choose(self, logits: torch.Tensor, masks: torch.Tensor | None, draft: torch.Tensor | None,
                draft_probs) -> tuple[int, int]:
        """Verify a draft (possibly empty) against target logits [k+1, V]."""
        if masks is not None:
            rows = masks.shape[0]
            logits = logits[:rows].masked_fill(~masks, float("-inf"))
            draft = draft[: rows - 1] if draft is not None else None
        if draft is None:
            draft = torch.zeros(0, dtype=torch.long)
        if self.sampling.greedy:
            return verify_greedy(draft, logits)
        probs = target_probs(logits, self.sampling)
        dp = None if draft_probs is None else draft_probs[: draft.shape[0]]
        return verify_sampling(draft, dp, probs, self.generator)

    def _emit(self, tokens: list[int], sources: list[str], by_round: bool = True) -> None:
        reason = None
        kept: list[int] = []
        for tok, src in zip(tokens, sources):
            if tok in self.stop_ids:
                reason = "stop"
                self.round_tokens += by_round
                break
            if len(self.output) >= self.request.max_new_tokens:
                break
            self.output.append(tok)
            self.sources.append(src)
            self.rounds_of.append(self.rounds)
            self.round_tokens += by_round
            kept.append(tok)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        constraint = self.request.constraint
        if constraint is not None and reason is None:
            constraint.advance(kept)
            if constraint.is_terminated():
                reason = "stop"
        if reason is None and (len(self.output) >= self.request.max_new_tokens
                               or self.cache.length + 2 >= self.engine.max_context):
            reason = "length"
        if reason is not None:
            self._finish(reason)

    def _finish(self, reason: str) -> None:
        if not self.finished:
            self.finished, self.finish_reason = True, reason
            self.finished_time = time.perf_counter()

    def cancel(self) -> None:
        self._finish("cancelled")

    # -- the loop -------------------------------------------------------------------------------

    def prefill(self) -> None:
        t0 = time.perf_counter()
        p = self.prompt_len
        if p + 1 >= self.engine.max_context:
            raise ValueError(f"prompt of {p} tokens exceeds the context length {self.engine.max_context}")
        out = self.engine.target(self.ids[:p], self.cache, self.tap_layers,
                                 logits_from=p - 1)
        if self.tap_layers:
            self.taps[:p] = out.taps
        masks = self.request.constraint.masks([]) if self.request.constraint else None
        _, tok = self._choose(out.logits, masks, None, None)
        self.last_logits = out.logits[-1]
        self.ids[p] = tok
        self.times.prefill += time.perf_counter() - t0
        self._emit([tok], ["target"], by_round=False)

    def step(self) -> list[tuple[int, str]]:
        """One speculation round; returns the (token, source) pairs it emitted."""
        if self.finished:
            return []
        before = len(self.output)
        n = self.cache.length
        self._ensure_capacity(n + self.longest_draft + 2)
        name, draft, draft_probs = None, None, None
        if self.active:
            t0 = time.perf_counter()
            name = self._route(n)
            t1 = time.perf_counter()
            self.times.router += t1 - t0
            remaining = self.request.max_new_tokens - len(self.output)
            k = min(self._draft_len(name), remaining - 1, self.engine.max_context - n - 2)
            ctx = self._context()
            drafter = self.engine.drafters[name]
            for other in (self.active if self.spec.eager_catch_up else [name]):
                self.engine.drafters[other].catch_up(self.states[other], ctx)
            t2 = time.perf_counter()
            self.times.catch_up += t2 - t1
            if k > 0:
                d = drafter.propose(self.states[name], ctx, k, self.draft_sampling)
                draft, draft_probs = d.tokens, d.probs
            self.times.draft += time.perf_counter() - t2
            if self.last_drafter is not None and name != self.last_drafter:
                self.switches += 1
            self.last_drafter = name
        masks = None
        if self.request.constraint is not None:
            masks = self.request.constraint.masks([] if draft is None else draft.tolist())
            if draft is not None:
                draft = draft[: masks.shape[0] - 1]
        k = 0 if draft is None else draft.shape[0]
        t3 = time.perf_counter()
        tokens = self.ids[n:n + 1] if k == 0 else torch.cat([self.ids[n:n + 1], draft])
        out = self.engine.target(tokens, self.cache, self.tap_layers)
        a, nxt = self._choose(out.logits, masks, draft, draft_probs)
        self.cache.rollback(n + a + 1)
        if self.tap_layers:
            self.taps[n:n + a + 1] = out.taps[: a + 1]
        self.times.verify += time.perf_counter() - t3
        self.rounds += 1
        emitted = ([] if k == 0 else draft[:a].tolist()) + [nxt]
        self.ids[n + 1:n + a + 2] = torch.tensor(emitted)
        self.last_logits = out.logits[a]
        if name is not None:
            st = self.per_drafter[name]
            st["rounds"] += 1
            st["draft_tokens"] += k
            st["accepted_tokens"] += a
            self.accepted_at[a] += 1
            self.decisions.append((name, a))
        self._emit(emitted, [name] * a + ["target"])
        return list(zip(self.output[before:], self.sources[before:]))

    # -- reporting ------------------------------------------------------------------------------

    def stats(self, trace: bool | None = None) -> dict:
        """Per-request stats in the shape the HTTP API returns."""
        trace = self.spec.trace if trace is None else trace
        drafts = sum(d["draft_tokens"] for d in self.per_drafter.values())
        accepted = sum(d["accepted_tokens"] for d in self.per_drafter.values())
        out = {
            "method": self.spec.method,
            "rounds": self.rounds,
            "draft_tokens": drafts,
            "accepted_tokens": accepted,
            # tokens decided per target forward after prefill (the first token comes from prefill)
            "acceptance_length": round(self.round_tokens / self.rounds, 4) if self.rounds else 0.0,
            "drafters": {k: dict(v) for k, v in self.per_drafter.items()},
            "switches": self.switches,
        }
        if trace:
            tok = self.engine.tokenizer
            out["tokens"] = [
                {"id": t, "text": tok.decode([t]) if tok is not None else "", "source": s, "round": r}
                for t, s, r in zip(self.output, self.sources, self.rounds_of)
            ]
        return out

    def timing(self) -> dict:
        end = self.finished_time or time.perf_counter()
        return {"total_s": end - self.started, **self.times.as_dict(),
                "ttft_s": (self.first_token_time - self.started) if self.first_token_time else None}
