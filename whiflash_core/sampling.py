"""Turning target logits into tokens, and verifying drafts against them without loss.

Greedy: accept the longest prefix of the draft that equals the target's argmax at each row,
then emit the target's argmax at the first mismatch (or after the last draft token).

Sampling: standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).
Draft token x at row i is accepted with probability min(1, p(x)/q(x)); on the first rejection
the output is drawn from the residual max(p - q, 0) normalised; if every draft is accepted the
bonus token is drawn from p at the last row. Temperature, top-k and top-p shape p (the target
side) only, so the emitted sequence is distributed exactly as sampling the target alone with
those settings. A greedy drafter is a point mass q = 1{x}.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import decode_ops

# Temperatures below this are greedy. Dividing logits by a tinier one (1e-300 fits a float) overflows
# to inf, and softmax of inf - inf is NaN; at 1e-5 the distribution is already a point mass.
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[rows, V] float32 logits -> the distribution the target samples from."""
    if params.greedy:  # a point mass on the argmax: what sampling tends to as the temperature falls
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A copy of logits [m, V] with every token a grammar forbids at -inf: `allowed` is its packed
    masks (engine.Constraint.bitmasks; ids past them, a padded LM head's, are never allowed).
    xgrammar's kernels apply them (its CPU one took ~60 us a row where unpacking to bool and masked_fill took ~240).
    Imported here: masks come from a grammar, so xgrammar is loaded by then, and the engine core
    alone (bench/gpu_check.py) stays without it."""
    import xgrammar

    out = logits.clone()
    covered = min(out.shape[-1], 32 * allowed.shape[-1])
    on_cpu = out.device.type == "cpu" and out.dtype in (torch.float32, torch.bfloat16, torch.float16)
    xgrammar.apply_token_bitmask_inplace(out, allowed.to(out.device), vocab_size=covered,
                                         backend="cpu" if on_cpu else "torch_native")
    out[:, covered:] = float("-inf")
    return out


def verify_greedy(draft: torch.Tensor, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> tuple[int, int]:
    """(number of accepted draft tokens, next token) for draft [k] and target logits [k+1, V], the
    target's choice at each row among the tokens a grammar's packed masks `allowed` (k+1 rows,
    engine.Constraint.bitmasks) permit (None: every token).

    The target's choices and the draft are read to the host together: on a GPU that is the
    round's one wait for the device."""
    k = draft.shape[0]
    # on the CPU one C pass a row (torch.argmax's ~80 us a row), reading the grammar's mask in place
    choice = decode_ops.argmax_rows(logits, allowed)
    if choice is None:
        if allowed is not None:
            logits = mask_logits(logits, allowed)
        both = torch.cat([logits.argmax(-1), draft]).tolist()
        choice, drafted = both[:k + 1], both[k + 1:]
    else:
        drafted = draft.tolist()
    a = next((i for i in range(k) if drafted[i] != choice[i]), k)
    return a, choice[a]


def verify_sampling(draft: torch.Tensor, draft_probs: torch.Tensor | None, probs: torch.Tensor,
                    generator: torch.Generator | None) -> tuple[int, int]:
    """Rejection sampling. draft [k]; draft_probs [k, V] or None (point masses); probs [k+1, V]."""
    k = draft.shape[0]
    device = generator.device if generator is not None else probs.device
    u = torch.rand(k, generator=generator, dtype=torch.float64, device=device).tolist() if k else []
    # p(x_i) and q(x_i) of every draft token, read to the host at once (not one read per token)
    rows = torch.arange(k, device=probs.device)
    p_x = probs[rows, draft].tolist()
    q_x = [1.0] * k if draft_probs is None else draft_probs[rows, draft].tolist()
    for i, x in enumerate(draft.tolist()):
        p, q = p_x[i], q_x[i]
        if q > 0 and u[i] * q < p:
            continue
        if draft_probs is None:
            residual = probs[i].clone()
            residual[x] = 0.0
        else:
            residual = (probs[i] - draft_probs[i]).clamp_min(0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q everywhere: the rejection above cannot happen, but stay safe
            residual, total = probs[i], 1.0
        return i, sample(residual / total, generator)
    return k, sample(probs[k], generator)
