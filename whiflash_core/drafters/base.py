"""One small interface for every drafter, in the spirit of vLLM v1's proposers.

A drafter holds weights shared by all requests; everything per request lives in a
`DrafterState` it creates. Per round the engine calls `propose`, which first catches the
drafter up on verified context it has not seen (lazily: a drafter that sat idle for several
rounds catches up in one batched pass), then drafts. Drafts never enter the drafter's
persistent cache, so nothing needs undoing after verification.

The interface, all a router and the engine know of a drafter:

    tap_layers          target hidden states it reads (the target taps only those)
    draft_len(spec)     how many tokens one proposal makes under a request's settings
    new_state(capacity) its per-request cache
    catch_up(state, ctx), propose(state, ctx, k, sampling) -> Draft
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..sampling import MIN_TEMPERATURE

if TYPE_CHECKING:
    from ..config import SpeculationConfig
    from ..target import KVCache


@dataclass
class Draft:
    tokens: torch.Tensor               # [k] target token ids
    probs: torch.Tensor | None = None  # [k, vocab] proposal distributions; None = greedy point masses


@dataclass
class Context:
    """What the engine shows a drafter: verified tokens and the target's tapped hidden states.

    `ids[:n]` are verified tokens whose target K/V and taps exist; `ids[n]` is the pending token
    (chosen by the target, not yet run through it). `taps[p, j]` is tap layer `tap_layers[j]` at
    position p, valid for p < n.
    """
    ids: torch.Tensor          # [>= n+1] long
    n: int
    taps: torch.Tensor         # [capacity, n_taps, hidden]
    tap_layers: tuple[int, ...]

    def features(self, layers: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        """[end-start, len(layers), hidden] taps for positions start..end-1."""
        cols = [self.tap_layers.index(layer) for layer in layers]
        block = self.taps[start:end]
        if cols == list(range(len(self.tap_layers))):
            return block
        return block[:, cols]


@dataclass
class DraftSampling:
    temperature: float = 0.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE  # see whiflash_core.sampling


class DrafterState:
    """Per-request drafter cache. `n_seen` = verified positions already in the cache."""

    n_seen: int = 0
    # The drafter's K/V over verified positions 0..n_seen-1, for drafters that keep one (EAGLE-3,
    # DFlash). The prefix cache stores it next to the target's, so a request that reuses a cached
    # prefix starts with its drafters caught up on it instead of re-running the whole prompt.
    cache: KVCache | None = None


def to_sharing(module: torch.nn.Module, shared: tuple[torch.nn.Module | None, ...], device,
               dtype: torch.dtype) -> torch.nn.Module:
    """module.to(device, dtype), except the target's modules it shares (its embedding, LM head):
    those stay as the target has them. A plain `.to()` would convert the shared parameters in
    place and change the target too (e.g. a float32 copy of a drafter for training would turn a
    bf16 target's embedding into float32)."""
    saved = [(p, p.data) for m in shared if m is not None for p in m.parameters()]
    module.to(device, dtype)
    for p, data in saved:
        p.data = data
    return module


class Drafter(ABC):
    name: str = "drafter"
    # tap indices (Hugging Face hidden_states convention) this drafter reads from the target
    tap_layers: tuple[int, ...] = ()
    # most tokens one proposal can contain
    max_draft_tokens: int = 1
    # tokens one proposal makes when the request does not say
    default_draft_len: int = 4
    # tokens past a position that its `state.cache` entry depends on: EAGLE-3 pairs position t
    # with token t + 1, so a reused prefix of m tokens determines its cache at positions < m - 1
    cache_lookahead: int = 0
    # weights of this drafter beside a q4_1 target (loading.load_engine; any other light target:
    # int8): "q4_1" where its steps then run in C (EAGLE-3: layer_stack.DraftLayer), else "int8"
    q4_1_weights: str = "int8"

    def draft_len(self, spec: SpeculationConfig) -> int:
        """Tokens this drafter proposes per round: the request's num_draft_tokens, else its default."""
        return self.capped_len(spec, self.default_draft_len)

    def capped_len(self, spec: SpeculationConfig, default: int) -> int:
        """The request's num_draft_tokens, else `default`, within 0..max_draft_tokens."""
        return max(0, min(spec.num_draft_tokens or default, self.max_draft_tokens))

    def routed_draft_len(self, spec: SpeculationConfig) -> int:
        """The longest draft a router that prices every length (the cost and learned policies) may
        choose for this drafter; draft_len unless the drafter says otherwise."""
        return self.draft_len(spec)

    @abstractmethod
    def new_state(self, capacity: int) -> DrafterState: ...

    def catch_up(self, state: DrafterState, ctx: Context) -> None:
        """Bring the drafter's cache up to the verified context (Lazy Catch-up: called only for
        the drafter picked this round, so an idle drafter's backlog is processed in one pass)."""

    @abstractmethod
    def propose(self, state: DrafterState, ctx: Context, num_tokens: int, sampling: DraftSampling) -> Draft: ...

    def catch_up_many(self, states: list[DrafterState], ctxs: list[Context]) -> None:
        """`catch_up` for several requests; drafters with weights override it to run all the
        requests' unseen positions through their weights together."""
        for state, ctx in zip(states, ctxs):
            self.catch_up(state, ctx)

    def propose_many(self, states: list[DrafterState], ctxs: list[Context], num_tokens: list[int],
                     samplings: list[DraftSampling]) -> list[Draft]:
        """`propose` for several requests (the server's requests that picked this drafter in one
        pass). Drafters with weights override it to run the requests' rows through their weights
        together; each request's draft must be the one `propose` alone would make."""
        return [self.propose(*args) for args in zip(states, ctxs, num_tokens, samplings)]


def pick_tokens(logits: torch.Tensor, sampling: DraftSampling, d2t: torch.Tensor | None,
                vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose draft tokens from drafter logits [k, draft_vocab].

    Greedy: argmax, no distribution (the verifier treats drafts as point masses).
    Sampling: draw from softmax(logits / T) and return that distribution over the full target
    vocabulary, which the rejection sampler needs.
    """
    logits = logits.float()
    if sampling.greedy:
        idx = logits.argmax(-1)
        return _to_target(idx, d2t), None
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    idx = torch.multinomial(probs, 1, generator=sampling.generator).squeeze(-1)
    full = probs.new_zeros(probs.shape[0], vocab_size)
    cols = _to_target(torch.arange(probs.shape[1], device=probs.device), d2t)
    full[:, cols] = probs
    return _to_target(idx, d2t), full


def pick_tokens_many(logits: torch.Tensor, counts: list[int], samplings: list[DraftSampling],
                     d2t: torch.Tensor | None, vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """`pick_tokens` for several requests' rows at once: logits [sum(counts), draft_vocab], request i's
    rows next in order. The greedy requests share one argmax; each sampled one draws with its own
    generator (in request order, as each would alone)."""
    greedy = logits.float().argmax(-1) if any(s.greedy for s in samplings) else None
    out, row = [], 0
    for count, sampling in zip(counts, samplings):
        rows = slice(row, row + count)
        out.append((_to_target(greedy[rows], d2t), None) if sampling.greedy
                   else pick_tokens(logits[rows], sampling, d2t, vocab_size))
        row += count
    return out


def _to_target(idx: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    # EAGLE-3 convention: target id of draft index i is i + d2t[i] (an offset, not an id).
    return idx if d2t is None else idx + d2t[idx]
