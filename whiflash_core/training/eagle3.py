"""`whiflash train eagle3`: train an EAGLE-3 drafter with training-time test (TTT).

Per sequence (prompt + response, teacher-forced through the frozen target):

  * features: taps at HF hidden_states indices {2, L//2, L-3} (SmolLM2: 2, 15, 27), fused by the
    drafter's own `fuse` (per-tap RMSNorm, `fc_norm=True`: layers 15/27 carry massive activations);
  * step 0: row t is the pair (g_t, token_{t+1}) at RoPE position t and predicts token_{t+2};
  * step k >= 1: row t is (a_t^{k-1}, token_{t+1+k}) at position t+k, where a^{k-1} is the drafter's
    own pre-norm output of step k-1 (what chain drafting feeds back), tokens teacher-forced;
  * attention at step k: the step-0 keys causally (rows 0..t) plus, on the diagonal only, the
    keys row t produced at steps 1..k; exactly the cache a chain draft started at t would see;
  * loss: soft cross-entropy against the target's distribution restricted (and renormalised) to
    the draft vocabulary, on response tokens whose target argmax is in the draft vocabulary,
    per-step mean, steps weighted 0.8^k.

Rows that can only reach prompt labels are never queried: prompt rows only contribute step-0
keys (the K/V-only prefill trick of inference), which skips the MLP and head for most of a long
prompt. The layer pieces (`inputs`, q/k/v/o projections, MLP, norms, `fuse`, `logits`) are the
drafter module's own; only the attention pattern is training-specific (`ttt_attention`).
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Layer
from ..layers import apply_rope, init_linear_
from ..target import TargetModel
from ..cli_args import add_arguments, setting
from .loop import TrainSettings, train
from .task import DrafterTask, Item, chain_metrics, init_head_norm, slot_counts


@dataclass
class Eagle3Settings(TrainSettings):
    lr: float = setting(5e-4, "peak learning rate")
    clip: float = setting(0.5, "gradient-norm clip")
    ttt_steps: int = setting(5, "unrolled drafting steps (>= the chain length used)")
    step_decay: float = setting(0.8, "loss weight of step k is decay**k")
    taps: str | None = setting(None, "HF hidden_states indices, comma-separated (default 2,L//2,L-3)")
    init_layer: int | None = setting(None, "initialise the decoder layer from this target layer (o_proj, MLP, "
                                     "norms, q/k/v hidden half)")
    num_draft_tokens: int = setting(4, "chain length written into the exported config")


# --------------------------------------------------------------------------- TTT forward

def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: list[torch.Tensor],
                  diag_v: list[torch.Tensor], q_start: int) -> torch.Tensor:
    """EAGLE-3 training-time-test attention.

    q: [nh, m, hd] queries of rows q_start..q_start+m-1; k0/v0: [nkv, n, hd] step-0 keys/values of
    rows 0..n-1 (visible causally: row t sees rows <= t); diag_k/diag_v: [nkv, m, hd] per later
    step, visible only to the same row. One causal matmul plus one dot product per step, merged
    in a single softmax. Returns [m, nh*hd].
    """
    nh, m, hd = q.shape
    nkv, n, _ = k0.shape
    g = nh // nkv  # grouped-query attention: query head h reads kv head h // g
    q = q.reshape(nkv, g, m, hd) * hd ** -0.5
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in at least float32
    scores = torch.matmul(q, k0.unsqueeze(1).transpose(-1, -2)).to(acc)   # [nkv, g, m, n]
    visible = torch.arange(n).unsqueeze(0) <= (torch.arange(m) + q_start).unsqueeze(1)
    scores = scores.masked_fill(~visible, float("-inf"))
    diag = [(q * k.unsqueeze(1)).sum(-1, keepdim=True).to(acc) for k in diag_k]
    p = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
    out = torch.matmul(p[..., :n].to(v0.dtype), v0.unsqueeze(1))
    for j, v in enumerate(diag_v):
        out = out + p[..., n + j:n + j + 1].to(v.dtype) * v.unsqueeze(1)
    return out.reshape(nh, m, hd).transpose(0, 1).reshape(m, nh * hd)


def _layer_step(layer: Eagle3Layer, emb, hidden, cos, sin, k0, v0, diag_k, diag_v, q_rows: slice,
                q_start: int):
    """One decoder-layer pass: K/V of all rows, queries/MLP only for q_rows. Returns
    (pre-norm output of q_rows, this pass's keys, values)."""
    a = layer.self_attn
    x, residual = layer.inputs(emb, hidden)
    t = x.shape[0]
    k = apply_rope(a.k_proj(x).view(t, a.nkv, a.hd).transpose(0, 1), cos, sin)
    v = a.v_proj(x).view(t, a.nkv, a.hd).transpose(0, 1)
    xq = x[q_rows]
    q = apply_rope(a.q_proj(xq).view(xq.shape[0], a.nh, a.hd).transpose(0, 1), cos[q_rows], sin[q_rows])
    if k0 is None:  # step 0: these keys are the causal block
        k0, v0 = k, v
    else:           # later steps: the new keys join the diagonal
        diag_k, diag_v = diag_k + [k[q_rows]], diag_v + [v[q_rows]]
    h = residual[q_rows] + a.o_proj(ttt_attention(q, k0, v0, diag_k, diag_v, q_start))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h, k0, v0, diag_k, diag_v


def unroll(drafter: Eagle3Drafter, ids: torch.Tensor, taps: torch.Tensor, steps: int,
           first_row: int = 0) -> list[torch.Tensor]:
    """Training-time test over one sequence.

    Rows t = 0..n-1 with n = len(ids) - 2 (row t needs token t+1 and a label t+2). Returns the
    pre-norm outputs a^k of rows first_row..n-1 for k = 0..steps-1; rows before first_row only
    provide step-0 keys. Tokens past the sequence end (later steps of the last rows) are
    replaced by token 0; those rows have no label there.
    """
    if len(drafter.layers) != 1:
        raise ValueError("training-time test is implemented for one-layer EAGLE-3 drafters")
    layer = drafter.layers[0]
    T = ids.shape[0]
    n = T - 2
    rows = torch.arange(first_row, n)
    g = drafter.fuse(taps[:n])
    emb = drafter.embed_tokens(ids[1:n + 1])
    cos, sin = drafter.rotary.tables(slice(0, n), g.dtype)
    q_rows = slice(first_row, n)
    a, k0, v0, dk, dv = _layer_step(layer, emb, g, cos, sin, None, None, [], [], q_rows, first_row)
    outs = [a]
    for k in range(1, steps):
        tok = ids[(rows + 1 + k).clamp(max=T - 1)]
        tok = torch.where(rows + 1 + k <= T - 1, tok, torch.zeros_like(tok))
        hidden = drafter.norm(a) if drafter.cfg.norm_output else a
        cos, sin = drafter.rotary.tables(slice(first_row + k, n + k), a.dtype)
        a, k0, v0, dk, dv = _layer_step(layer, drafter.embed_tokens(tok), hidden, cos, sin, k0, v0, dk, dv,
                                        slice(0, n - first_row), first_row)
        outs.append(a)
    return outs


# --------------------------------------------------------------------------- the task

class Eagle3Task(DrafterTask):
    name = "eagle3"
    need_hidden = True

    def __init__(self, drafter: Eagle3Drafter, target: TargetModel, vocab_ids: torch.Tensor, s: Eagle3Settings):
        self.model = drafter
        self.tap_layers = drafter.tap_layers
        self.steps = s.ttt_steps
        self.n_slots = s.ttt_steps
        self.weights = [s.step_decay ** k for k in range(s.ttt_steps)]
        ids = torch.sort(vocab_ids).values  # draft index -> target id
        self.vocab_ids = ids
        # target id -> draft index (-1 outside the draft vocabulary)
        self.t2d_index = torch.full((drafter.cfg.vocab_size,), -1, dtype=torch.long)
        self.t2d_index[ids] = torch.arange(len(ids))
        # frozen target LM-head rows of the draft vocab: soft targets from the final hidden state
        self.target_head = target.lm_head.weight.detach()[ids]

    def config(self) -> dict[str, Any]:
        return asdict(self.model.cfg)

    def _rows(self, item: Item) -> tuple[int, int]:
        """(first queried row, n rows). A row t matters iff some step's label t+2+k is a response token."""
        e = item.example
        n = e.length - 2
        return min(max(0, e.prompt_len - self.steps - 1), n), n

    def _labels(self, item: Item, k: int, first: int, n: int):
        """Step k of rows first..n-1: (target-distribution positions, response-label mask)."""
        e = item.example
        pos = torch.arange(first, n) + 1 + k          # the target's prediction at pos is token pos+1
        in_resp = (pos + 1 <= e.length - 1) & (pos + 1 >= e.prompt_len)
        return pos.clamp(max=e.length - 1), in_resp

    def prepare(self, items: list[Item], gen: torch.Generator) -> torch.Tensor:
        counts = torch.zeros(self.steps)
        for item in items:
            first, n = self._rows(item)
            masks = []
            for k in range(self.steps):
                pos, in_resp = self._labels(item, k, first, n)
                valid = in_resp & (self.t2d_index[item.feats.argmax[pos]] >= 0)
                masks.append((pos, valid))
                counts[k] += valid.sum()
            item.data.update(first=first, n=n, masks=masks)
        return counts.clamp(min=1)

    def _soft_targets(self, item: Item, pos: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = F.linear(item.feats.last_hidden[pos], self.target_head.to(item.feats.last_hidden.dtype))
            return torch.softmax(logits.float(), dim=-1)

    def loss(self, item: Item, norm: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        d, e = item.data, item.example
        counts = slot_counts(self.steps)
        outs = unroll(self.model, e.ids, item.feats.taps, self.steps, d["first"])
        total = outs[0].new_zeros((), dtype=torch.float32)
        for k, a in enumerate(outs):
            pos, valid = d["masks"][k]
            if not valid.any():
                continue
            logp = torch.log_softmax(self.model.logits(a[valid]).float(), dim=-1)
            p = self._soft_targets(item, pos[valid])
            ce = -(p * logp).sum(-1)
            total = total + self.weights[k] * ce.sum() / norm[k]
            counts["n"][k] += int(valid.sum())
            counts["ce"][k] += float(ce.detach().sum())
            counts["correct"][k] += int((logp.argmax(-1) == self.t2d_index[item.feats.argmax[pos[valid]]]).sum())
        return total, counts

    def evaluate(self, items: list[Item]) -> dict[str, Any]:
        """Teacher-forced chains from every response position. Correct = the draft equals the
        target's greedy token (out-of-vocabulary targets count as misses)."""
        K = self.steps
        correct, avail, sources = [], [], []
        ce_sum, ce_n = torch.zeros(K), torch.zeros(K)
        for item in items:
            e = item.example
            first, n = self._rows(item)
            outs = unroll(self.model, e.ids, item.feats.taps, K, first)
            # chains start where inference starts them: from row P-1 on (the pending token is then
            # the first response token, which the target's prefill chose)
            starts = torch.arange(first, n) >= e.prompt_len - 1
            c = torch.zeros(n - first, K, dtype=torch.bool)
            av = torch.zeros(n - first, K, dtype=torch.bool)
            for k, a in enumerate(outs):
                pos, in_resp = self._labels(item, k, first, n)
                logits = self.model.logits(a).float()
                c[:, k] = (self.vocab_ids[logits.argmax(-1)] == item.feats.argmax[pos]) & in_resp
                av[:, k] = in_resp
                valid = in_resp & (self.t2d_index[item.feats.argmax[pos]] >= 0)
                if valid.any():  # the training loss, on the same positions
                    p = self._soft_targets(item, pos[valid])
                    ce_sum[k] += float(-(p * torch.log_softmax(logits[valid], -1)).sum())
                    ce_n[k] += int(valid.sum())
            correct.append(c[starts])
            avail.append(av[starts])
            sources += [e.source] * int(starts.sum())
        loss = sum(w * s / max(n, 1) for w, s, n in zip(self.weights, ce_sum.tolist(), ce_n.tolist()))
        return {"loss": round(loss, 4), **chain_metrics(torch.cat(correct), torch.cat(avail), sources)}

    def export(self, path: str, extra: dict[str, Any]) -> None:
        self.model.save(path, layout="speculators", dtype=torch.bfloat16, extra=extra)


def build_task(target: TargetModel, vocab_ids: torch.Tensor, s: Eagle3Settings,
               config: dict[str, Any] | None) -> Eagle3Task:
    """A fresh drafter (config None) or the skeleton a checkpoint's weights are loaded into."""
    c = target.cfg
    if config is None:
        taps = [int(x) for x in s.taps.split(",")] if s.taps else [2, c.num_layers // 2, c.num_layers - 3]
        cfg = Eagle3Config(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
            draft_vocab_size=len(vocab_ids), tap_layers=taps, rms_norm_eps=c.rms_norm_eps,
            fc_norm=True, num_draft_tokens=s.num_draft_tokens)
    else:
        cfg = Eagle3Config(**config)
    # the target's own embedding module: shared and frozen, never saved with the drafter
    drafter = Eagle3Drafter(cfg, target.embed_tokens)
    drafter.set_vocab(vocab_ids)
    if config is None:
        init_linear_(drafter)
        with torch.no_grad():
            # head rows = the target's LM head (tied embedding for SmolLM2) for the draft ids
            drafter.lm_head.weight.copy_(target.lm_head.weight[torch.sort(vocab_ids).values])
        init_head_norm(drafter.norm, target)
        if s.init_layer is not None:
            init_from_target_layer(drafter.layers[0], target, s.init_layer)
    return Eagle3Task(drafter, target, vocab_ids, s)


def init_from_target_layer(layer: Eagle3Layer, target: TargetModel, index: int) -> None:
    """Copy what fits from target layer `index`: o_proj, MLP and norms whole; q/k/v read [emb, hidden]
    (2H), so their hidden half takes the target's projection and the embedding half stays random."""
    src = target.layers[index]
    h = target.cfg.hidden_size
    with torch.no_grad():
        qkv = src.self_attn.qkv_proj.weight.split(src.self_attn.sizes)  # the target stacks q, k, v
        for name, w in zip(("q_proj", "k_proj", "v_proj"), qkv):
            dst = getattr(layer.self_attn, name).weight
            if dst.shape != (w.shape[0], 2 * h):
                raise ValueError(f"--init-layer: {name} shapes differ ({tuple(dst.shape)} vs {tuple(w.shape)})")
            dst[:, h:] = w
        layer.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight)
        gate, up = src.mlp.gate_up_proj.weight.chunk(2)
        layer.mlp.gate_proj.weight.copy_(gate)
        layer.mlp.up_proj.weight.copy_(up)
        layer.mlp.down_proj.weight.copy_(src.mlp.down_proj.weight)
        layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight)
        layer.hidden_norm.weight.copy_(src.input_layernorm.weight)
        layer.input_layernorm.weight.copy_(src.input_layernorm.weight)


# --------------------------------------------------------------------------- CLI

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eagle3", help="train an EAGLE-3 drafter (training-time test)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, Eagle3Settings)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    train(build_task, "eagle3", Eagle3Settings.from_args(args))
    return 0


