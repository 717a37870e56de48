"""The `learned` routing policy's model: a small MLP that predicts, before drafting, how each
drafter's draft would fare this round.

WhiFlash's neural policy (arXiv 2606.07710, Appendix A) is an MLP d -> d/8 -> 1 on the target's
final hidden state, regressing the acceptance-length gap between two drafters. Grown to several
drafters and to the cost router, it predicts per drafter d the per-position acceptance
probabilities p_1..p_K (p_i: draft token i is accepted given tokens 1..i-1 were), so that

    g(d, k) = 1 + sum_{i<=k} prod_{j<=i} p_j      (acceptance.expected_tokens_by_k)

plugs into the same argmax over (drafter, k) of g / t ** alpha as the `cost` policy; only where
g comes from differs (router.py).

Inputs, all known before drafting (`features`):
- the target's final-norm hidden state at the last accepted position (what its LM head read to
  choose the pending token) [d];
- scalars (`scalar_names`): the target's entropy and top-1 probability there, whether prompt
  lookup found a 2- or a 3-token match, and per drafter this request's acceptance so far in the
  situation at hand, as the `cost` policy sees it (acceptance.py: first-position rate, expected
  accepted fraction of a full draft, and how much of that is observed rather than prior).

Outputs: [sum K] logits, p_i = sigmoid, drafter by drafter in `config.drafters` order. The model is
trained by `whiflash train router` (training/router.py) and ships beside the drafters as
`router_mlp.safetensors` (bf16 weights, float32 input standardisation, the config in the metadata).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import decode_ops
from .acceptance import AcceptanceModel, situation

FILE_NAME = "router_mlp.safetensors"
FORMAT = "whiflash-router-mlp/1"


def scalar_names(drafters: tuple[str, ...]) -> list[str]:
    """Names of the scalar features, in input order (after the hidden state)."""
    names = ["entropy", "top1", "lookup_match_2", "lookup_match_3"]
    for d in drafters:
        names += [f"{d}_rate_1", f"{d}_accepted_fraction", f"{d}_observed"]
    return names


@dataclass
class RouterMLPConfig:
    hidden_size: int                  # d: the target's hidden size
    drafters: tuple[str, ...]         # one output head per drafter, in this order
    draft_lens: tuple[int, ...]       # K per drafter: the positions p_1..p_K it predicts
    width: int = 0                    # the hidden layer; 0: d / 8, the paper's
    dropout: float = 0.1

    def __post_init__(self):
        self.drafters, self.draft_lens = tuple(self.drafters), tuple(int(k) for k in self.draft_lens)
        if not self.width:
            self.width = max(self.hidden_size // 8, 8)

    @property
    def n_features(self) -> int:
        return self.hidden_size + len(scalar_names(self.drafters))

    @property
    def n_outputs(self) -> int:
        return sum(self.draft_lens)


def scalar_features(cfg: RouterMLPConfig, entropy: float, top1: float, match: int,
                    acceptance: AcceptanceModel) -> list[float]:
    """The scalars of `scalar_names`, from the target's distribution at the last accepted position,
    prompt lookup's match size and the request's acceptance history (the same for training rows,
    which replay a request's rounds, and for serving)."""
    out = [entropy, top1, float(match == 2), float(match >= 3)]
    for name, k in zip(cfg.drafters, cfg.draft_lens):
        out += acceptance.summary(name, situation(name, top1, match), k)
    return out


def features(cfg: RouterMLPConfig, hidden: torch.Tensor, entropy: float, top1: float, match: int,
             acceptance: AcceptanceModel) -> torch.Tensor:
    """[n_features] float32 input row: hidden state [d], then the scalars."""
    scalars = torch.tensor(scalar_features(cfg, entropy, top1, match, acceptance), device=hidden.device)
    return torch.cat([hidden.float(), scalars])


class RouterMLP(nn.Module):
    """Standardise, d -> d/8 -> sum K (GELU, dropout in training): per-position acceptance logits."""

    def __init__(self, cfg: RouterMLPConfig):
        super().__init__()
        self.cfg = cfg
        f = cfg.n_features
        # input standardisation, set from the training rows (RouterMLP.fit_scaling)
        self.register_buffer("shift", torch.zeros(f))
        self.register_buffer("scale", torch.ones(f))
        self.fc1 = nn.Linear(f, cfg.width)
        self.fc2 = nn.Linear(cfg.width, cfg.n_outputs)
        self.drop = nn.Dropout(cfg.dropout)

    def fit_scaling(self, x: torch.Tensor) -> None:
        """Standardise inputs to zero mean and unit variance over the rows x [N, F]."""
        self.shift.copy_(x.mean(0))
        self.scale.copy_(x.std(0).clamp_min(1e-4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, F] raw features -> [B, sum K] logits of p_i."""
        x = (x.to(self.shift.dtype) - self.shift) / self.scale
        return self.fc2(self.drop(F.gelu(self.fc1(x))))

    def split(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """[..., sum K] -> {drafter: [..., K]}."""
        return dict(zip(self.cfg.drafters, values.split(list(self.cfg.draft_lens), dim=-1)))

    def _folded(self) -> tuple[torch.Tensor, torch.Tensor, "decode_ops.MLP2 | None"]:
        """fc1 with the standardisation folded in (W / scale, b - (W / scale) shift) and the C call
        bound to it and fc2 (decode_ops.MLP2), remade only when a parameter changed in place
        (training, load_state_dict): a serving round reads one weight matrix, usually from a cache
        the target's forward just evicted, so fewer bytes and ops are most of its cost."""
        frozen = self.__dict__.get("_frozen")
        if frozen is not None:   # serving (`freeze`): the parameters no longer change
            return frozen
        params = self.__dict__.get("_fold_params")
        if params is None:   # the parameter objects, once: reading them through nn.Module is slow
            params = self._fold_params = (self.fc1.weight, self.fc1.bias, self.shift, self.scale,
                                          self.fc2.weight, self.fc2.bias)
        fc1_w, fc1_b, shift, scale, fc2_w, fc2_b = params   # spelled out: a generator cost ~4 us a cold round
        key = (fc1_w._version, fc1_b._version, shift._version, scale._version, fc2_w._version, fc2_b._version)
        if self.__dict__.get("_fold_key") != key:
            with torch.no_grad():
                w = self.fc1.weight / self.scale
                w1, b1 = w.contiguous(), self.fc1.bias - w @ self.shift
                call = decode_ops.MLP2.make(w1, b1, self.fc2.weight.detach().float().contiguous(),
                                            self.fc2.bias.detach().float().contiguous(), self.cfg.hidden_size)
            self._fold, self._fold_key = (w1, b1, call), key
        return self._fold

    def freeze(self) -> RouterMLP:
        """For serving: the parameters will not change from here on, so the fold is made once and
        `_folded` skips its six version reads (~18 us of a round, in-run, on the cold caches between
        target forwards). Training never freezes; changing a frozen model's parameters is an error
        of the caller's (its rounds would keep the old fold)."""
        self.requires_grad_(False)
        self._frozen = None   # so _folded makes the fold of these parameters, not an earlier freeze's
        self._frozen = self._folded()
        return self

    def _per_drafter(self, p: list[float]) -> dict[str, list[float]]:
        """[sum K] values -> {drafter: its K}, in config order."""
        out, i = {}, 0
        for name, k in zip(self.cfg.drafters, self.cfg.draft_lens):
            out[name], i = p[i:i + k], i + k
        return out

    @torch.inference_mode()
    def rates(self, x: torch.Tensor) -> dict[str, list[float]]:
        """{drafter: [p_1..p_K]} for one feature row x [F] (one host read); the same values as
        sigmoid(self(x)) in eval mode, by matrix-vector products: on the CPU in one C call
        (decode_ops.mlp2; between two target forwards, PyTorch's handful of ops on these few
        thousand weights measured ~160 us a round, dispatch and a woken thread pool included)."""
        w1, b1, _ = self._folded()
        p = decode_ops.mlp2(x.float().contiguous(), w1, b1, self.fc2.weight, self.fc2.bias)
        if p is None:
            h = F.gelu(torch.addmv(b1, w1, x.to(w1.dtype)))
            p = torch.sigmoid(torch.addmv(self.fc2.bias, self.fc2.weight, h)).tolist()
        return self._per_drafter(p)

    def rates_at(self, hidden: torch.Tensor, scalars: list[float]) -> dict[str, list[float]]:
        """rates(x) for x = [hidden, scalars] (`features` without building x): a serving round's
        call. On the CPU one C call on the weights `_folded` bound (decode_ops.MLP2: in a round,
        after the target's forward has evicted the caches, building x and checking the tensors
        measured ~350 us of the router's ~700 us at one thread)."""
        call = self._folded()[2]   # no inference_mode around the C call: entering it cost ~3 us a round
        if call is None:   # PyTorch's ops: the same ValueError as the C call's for a row of the wrong size
            if hidden.shape != (self.cfg.hidden_size,) or len(scalars) != self.cfg.n_features - self.cfg.hidden_size:
                raise ValueError(f"router MLP input of {tuple(hidden.shape)} + {len(scalars)} scalars, it takes "
                                 f"({self.cfg.hidden_size},) + {self.cfg.n_features - self.cfg.hidden_size}")
            return self.rates(torch.cat([hidden.float(), torch.tensor(scalars, device=hidden.device)]))
        return self._per_drafter(call(hidden, scalars))

    # -- the shipped file ---------------------------------------------------------------------

    def save(self, path: str, summary: dict | None = None) -> None:
        """bf16 weights, float32 standardisation; the config (and a training summary) as metadata."""
        from safetensors.torch import save_file

        tensors = {k: (v.to(torch.bfloat16) if k.startswith("fc") else v.float()).contiguous().cpu()
                   for k, v in self.state_dict().items()}
        meta = {"format": FORMAT, "config": json.dumps(asdict(self.cfg)), "summary": json.dumps(summary or {})}
        save_file(tensors, path, metadata=meta)

    @classmethod
    def load(cls, path: str, device: str | torch.device = "cpu") -> RouterMLP:
        """The model in `path`, in float32 (a few thousand multiply-adds: float32 is the fast path
        on every CPU) on `device`, in eval mode."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: not a {FORMAT} file (format {meta.get('format')!r})")
            state = {k: f.get_tensor(k).float() for k in f.keys()}
        model = cls(RouterMLPConfig(**json.loads(meta["config"])))
        model.load_state_dict(state)
        model.summary = json.loads(meta.get("summary") or "{}")
        return model.to(device).eval()
