"""Reading and writing drafter weights: safetensors (preferred) or PyTorch .bin, sharded or not."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file


def load_state_dict(path: str) -> dict[str, torch.Tensor]:
    for name in ("model.safetensors", "pytorch_model.bin"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            return _load_one(file)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        file = os.path.join(path, index)
        if os.path.exists(file):
            with open(file) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            sd: dict[str, torch.Tensor] = {}
            for shard in shards:
                sd.update(_load_one(os.path.join(path, shard)))
            return sd
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin in {path}")


def _load_one(file: str) -> dict[str, torch.Tensor]:
    if file.endswith(".safetensors"):
        return load_file(file)
    return torch.load(file, map_location="cpu", weights_only=True)


def save_state_dict(sd: dict[str, torch.Tensor], file: str, dtype=torch.bfloat16) -> None:
    """Floating tensors in `dtype`; integer/bool buffers (d2t, t2d) keep theirs."""
    out = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    save_file(out, file, metadata={"format": "pt"})
