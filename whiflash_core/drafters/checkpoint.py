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


# a shipped weight file stays under this many bytes (the repository's budget per file); a drafter
# with more is shipped in shards (save_state_dict's max_file_bytes)
MAX_FILE_BYTES = 20_000_000
# room left in a file for its safetensors header (JSON: each tensor's name, dtype, shape, offsets)
HEADER_BYTES, HEADER_BYTES_PER_TENSOR = 1024, 256


def save_state_dict(sd: dict[str, torch.Tensor], file: str, dtype=torch.bfloat16,
                    max_file_bytes: int | None = None) -> None:
    """Floating tensors in `dtype`; integer/bool buffers (d2t, t2d) keep theirs. With
    `max_file_bytes`, a state that does not fit one file goes into shards beside `file`
    (model-00001-of-0000N.safetensors and model.safetensors.index.json, Hugging Face's layout,
    which load_state_dict reads), tensors in order, each shard under the limit."""
    out = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
    directory = os.path.dirname(file) or "."
    stem = os.path.basename(file).removesuffix(".safetensors")
    for name in weight_files(directory, stem) if os.path.isdir(directory) else []:   # no stale shard or file
        os.remove(os.path.join(directory, name))
    nbytes = {k: v.numel() * v.element_size() for k, v in out.items()}
    file_bytes = lambda keys: HEADER_BYTES + sum(nbytes[k] + HEADER_BYTES_PER_TENSOR for k in keys)  # noqa: E731
    if max_file_bytes is None or file_bytes(out) <= max_file_bytes:
        save_file(out, file, metadata={"format": "pt"})
        return
    shards: list[list[str]] = [[]]
    for k in out:
        if file_bytes([k]) > max_file_bytes:
            raise ValueError(f"{k} alone ({nbytes[k]:,} bytes) is over the {max_file_bytes:,}-byte file limit")
        if shards[-1] and file_bytes(shards[-1] + [k]) > max_file_bytes:
            shards.append([])
        shards[-1].append(k)
    names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in zip(names, shards):
        save_file({k: out[k] for k in keys}, os.path.join(directory, name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(nbytes.values())},
             "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
    with open(os.path.join(directory, f"{stem}.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def weight_files(path: str, stem: str = "model") -> list[str]:
    """The names of the weight files in drafter directory `path`: model.safetensors, or the shards
    and index of a sharded one (`stem` in place of "model" for other names)."""
    return sorted(f for f in os.listdir(path) if f in (f"{stem}.safetensors", f"{stem}.safetensors.index.json")
                  or (f.startswith(f"{stem}-") and f.endswith(".safetensors")))
