"""Target features for training: one frozen-target forward per sequence, cached on disk."""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..target import TargetModel
from .data import Example


@dataclass
class Features:
    """Frozen-target outputs for one sequence, teacher-forced over prompt + response."""
    taps: torch.Tensor                 # [T, n_taps, H] target dtype (HF hidden_states indices)
    argmax: torch.Tensor               # [T] long: the target's greedy next token after position p
    last_hidden: torch.Tensor | None   # [T, H] final-norm output (EAGLE's soft targets), if asked


class FeatureStore:
    """Runs the frozen target over a sequence once; caches the result on disk when `cache_dir`.

    Per token that is n_taps x H (+ H for `last_hidden`) values in the target dtype plus an int32:
    about 4.6 KB for EAGLE-3's 3 taps + final hidden, 4.6 KB for DFlash's 4 taps, in bf16.
    Keys hash the token ids, the tap set and a fingerprint of the target's weights, so a changed
    sample or target never reads stale features. The target's soft distribution is not stored:
    it is recomputed from `last_hidden` through the draft-vocab rows of the LM head (cheap).
    """

    def __init__(self, target: TargetModel, tap_layers: tuple[int, ...], need_hidden: bool,
                 cache_dir: str | None):
        self.target = target
        self.tap_layers = tuple(tap_layers)
        self.need_hidden = need_hidden
        self.cache_dir = cache_dir
        self.memory: dict[str, Features] = {}  # pinned entries (the val set)
        self.seconds = 0.0                     # time spent in the target forward
        self._prefix = self._fingerprint(target) + repr((self.tap_layers, need_hidden))

    @staticmethod
    def _fingerprint(target: TargetModel) -> str:
        h = hashlib.sha1(repr(target.cfg).encode())
        for w in (target.embed_tokens.weight[:4], target.layers[-1].mlp.down_proj.weight[:4], target.norm.weight):
            h.update(w.detach().float().numpy().tobytes())
        h.update(str(target.dtype).encode())
        return h.hexdigest()

    def _key(self, ids: torch.Tensor) -> str:
        return hashlib.sha1(self._prefix.encode() + ids.numpy().astype(np.int32).tobytes()).hexdigest()

    def __call__(self, ex: Example, pin: bool = False) -> Features:
        key = self._key(ex.ids)
        if key in self.memory:
            return self.memory[key]
        feats = self._read(key) if self.cache_dir else None
        if feats is None:
            feats = self.compute(ex.ids)
            if self.cache_dir:
                self._write(key, feats)
        if pin:
            self.memory[key] = feats
        return feats

    def compute(self, ids: torch.Tensor) -> Features:
        t0 = time.time()
        target = self.target
        with torch.inference_mode():
            out = target(ids, target.new_cache(ids.shape[0]), taps=self.tap_layers)
            argmax = out.logits.argmax(-1)
            last = out.last_hidden if self.need_hidden else None
        # clones made outside inference mode are ordinary tensors that autograd may save
        feats = Features(out.taps.clone(), argmax.clone(), None if last is None else last.clone())
        self.seconds += time.time() - t0
        return feats

    def _path(self, key: str) -> str:
        return os.path.join(self.cache_dir, key[:2], key + ".safetensors")

    def _read(self, key: str) -> Features | None:
        from safetensors.torch import load_file

        path = self._path(key)
        if not os.path.exists(path):
            return None
        d = load_file(path)
        return Features(d["taps"], d["argmax"].long(), d.get("last_hidden"))

    def _write(self, key: str, feats: Features) -> None:
        from safetensors.torch import save_file

        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        d = {"taps": feats.taps.contiguous(), "argmax": feats.argmax.int().contiguous()}
        if feats.last_hidden is not None:
            d["last_hidden"] = feats.last_hidden.contiguous()
        tmp = f"{path}.tmp{os.getpid()}"
        save_file(d, tmp)
        os.replace(tmp, path)
