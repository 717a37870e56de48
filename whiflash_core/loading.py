"""Loading: the target from Hugging Face / GGUF weights (or the embedded default), the drafters
from their checkpoints, and an Engine assembled from both plus the router calibration.

Drafter directory layout (what `whiflash train` writes and what ships under models/):

    DIR/eagle3/{config.json, model.safetensors}   SafeAILab or speculators format
    DIR/dflash/{config.json, model.safetensors}   z-lab format
    DIR/router.json                               entropy thresholds from `whiflash bench`
    DIR/copy_prior.json                           prompt lookup's acceptance by copy run (`whiflash train copy-prior`)
    DIR/router_mlp.safetensors                    the learned policy's MLP (`whiflash train router`)

A drafter's weights may instead be shards, model-0000i-of-0000N.safetensors with Hugging Face's
model.safetensors.index.json (`whiflash train ship` writes them for weights over the per-file
budget, drafters/checkpoint.MAX_FILE_BYTES, e.g. EAGLE-3 with a wide draft vocabulary).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from .drafters.dflash import SMOLLM2_MASK_TOKEN_ID, DFlashConfig, DFlashDrafter, default_target_layer_ids
from .drafters.eagle3 import Eagle3Config, Eagle3Drafter
from .embedded import EMBEDDED_GGUF, EMBEDDED_NAME, embedded_model_dir
from . import costs, decode_ops, tiles
from .acceptance import load_copy_prior
from .cache import cache_root
from .engine import Engine
from .machine import Formats, formats_from, light_formats, measure
from .quant import DENSE_FROM_ROWS, apply_weight_format, quantize_int8, quantize_linears_q4_1
from .router import RouterCalibration
from .router_mlp import FILE_NAME as ROUTER_MLP_FILE, RouterMLP
from .target import STACKED, Rotary, TargetConfig, TargetModel

log = logging.getLogger(__name__)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED_DRAFTERS = os.path.join(REPO_ROOT, "models", "smollm2-135m-instruct")
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float64": torch.float64, "float16": torch.float16}
# each drafter kind: its subdirectory in a drafter directory, and its loader
DRAFTER_KINDS = {"eagle3": Eagle3Drafter, "dflash": DFlashDrafter}


def default_device() -> str:
    """`--device` when not given: the GPU when there is one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# --- the target ----------------------------------------------------------------------------------


def model_location(path: str | None) -> tuple[str, str | None]:
    """(directory, GGUF file name or None) of an HF directory, a .gguf path or None (the embedded
    default)."""
    if path is None:
        return embedded_model_dir(), EMBEDDED_GGUF
    if path.endswith(".gguf"):
        return os.path.dirname(path) or ".", os.path.basename(path)
    return path, None


def load_hf_model(path: str | None, gguf_file: str | None = None):
    """The Hugging Face model and tokenizer (fp32). `path=None` means the embedded default.

    A GGUF is converted by transformers once (dequantised to float32: 11 s for the embedded
    model's 98 MB, most of every server start and test before) and the result kept as a plain
    Hugging Face directory under the cache (`converted_gguf_dir`), which then loads in about a
    second with the same weights, config and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf_file is None:
        path, gguf_file = model_location(path)
    if gguf_file:
        converted = converted_gguf_dir(os.path.join(path, gguf_file))
        if (converted / "config.json").exists():
            path, gguf_file = str(converted), None
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    model.eval()
    if gguf_file:
        _keep_converted(model, tok, converted, os.path.join(path, gguf_file))
    return model, tok


GGUF_CONVERSION_VERSION = 1


def converted_gguf_dir(gguf_path: str) -> Path:
    """Where the Hugging Face conversion of this GGUF file is kept: keyed by the file (path, size,
    modification time) and the transformers version that converted it."""
    import transformers

    st = os.stat(gguf_path)
    key = json.dumps([GGUF_CONVERSION_VERSION, os.path.realpath(gguf_path), st.st_size, st.st_mtime_ns,
                      transformers.__version__])
    return cache_root() / "converted" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _keep_converted(model, tok, directory: Path, gguf_path: str) -> None:
    """Save a converted model and tokenizer to `directory` atomically (written beside it, then
    renamed: a process loading at the same time sees all of it or none), and drop older
    conversions of the same file (another size, time or transformers version: 520 MB each for the
    embedded model). Best effort: a full disk or a read-only cache only costs the next start the
    conversion again."""
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    try:
        from safetensors.torch import save_file

        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        # transformers will not save_pretrained a model it loaded from a GGUF ("quantized with gguf"):
        # the weights are plain float32 by now, so write them and the config without that mark
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        state = model.state_dict()
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # the tied copy: safetensors stores a tensor once
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        source = os.path.realpath(gguf_path)
        (tmp / "whiflash_source.json").write_text(json.dumps({"gguf": source}))
        os.rename(tmp, directory)
        for other in directory.parent.iterdir():
            marker = other / "whiflash_source.json"
            if other != directory and marker.exists() and json.loads(marker.read_text()).get("gguf") == source:
                shutil.rmtree(other, ignore_errors=True)
    except (OSError, ValueError, RuntimeError) as e:
        if not (directory / "config.json").exists():  # else another process kept it first
            log.warning("could not keep the converted GGUF under %s (%s); the next start converts it again",
                        directory, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def from_hf(hf_model, dtype: torch.dtype = torch.bfloat16) -> TargetModel:
    """Build our TargetModel from a loaded transformers Llama/Qwen3 model (weights copied)."""
    cfg = TargetConfig.from_hf(hf_model.config)
    rot = hf_model.model.rotary_emb
    rotary = Rotary(rot.inv_freq.detach().clone(), min(cfg.max_position_embeddings, 4096),
                    float(getattr(rot, "attention_scaling", 1.0)))
    state = {}
    for name, tensor in hf_model.state_dict().items():
        key = name[len("model."):] if name.startswith("model.") else name
        state[key] = tensor
    return _assemble(cfg, rotary, state).to(dtype)


def _assemble(cfg: TargetConfig, rotary: Rotary, state: dict[str, torch.Tensor]) -> TargetModel:
    """A TargetModel that takes over Hugging Face-named tensors (linears stacked, ties restored)."""
    with torch.device("meta"):
        model = TargetModel(cfg, rotary)
    state = stack_linears(state, cfg.num_layers)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = rotary
    return model.eval()


def from_safetensors(directory: str, dtype: torch.dtype = torch.bfloat16,
                     device: str | torch.device = "cpu") -> TargetModel:
    """Our TargetModel straight from a Hugging Face directory (config.json + safetensors shards),
    each tensor read onto `device` and cast to `dtype` there: no transformers model and no float32
    copy on the host (an 8B model through `from_hf` holds tens of GB of host memory on the way).
    Same weights and RoPE as `from_hf` (transformers computes the inverse frequencies, any rope type)."""
    from safetensors import safe_open
    from transformers import AutoConfig
    # Qwen3's rotary embedding is a copy of Llama's: both compute inv_freq from the config alone
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = AutoConfig.from_pretrained(directory)
    cfg = TargetConfig.from_hf(hf_cfg)
    rot = LlamaRotaryEmbedding(hf_cfg)
    rotary = Rotary(rot.inv_freq.detach().clone(), min(cfg.max_position_embeddings, 4096),
                    float(getattr(rot, "attention_scaling", 1.0)))
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        with safe_open(os.path.join(directory, name), framework="pt", device=str(device)) as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq"):  # some older uploads saved this buffer
                    continue
                ours = key[len("model."):] if key.startswith("model.") else key
                state[ours] = f.get_tensor(key).to(dtype)
    return _assemble(cfg, rotary, state)


def _has_safetensors(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, f))
               for f in ("model.safetensors", "model.safetensors.index.json"))


def stack_linears(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Hugging Face per-projection weights (and biases) -> our stacked ones (see STACKED)."""
    for i in range(num_layers):
        for stacked, parts in STACKED.items():
            for kind in ("weight", "bias"):
                keys = [f"layers.{i}.{p}.{kind}" for p in parts]
                if keys[0] in state:
                    state[f"layers.{i}.{stacked}.{kind}"] = torch.cat([state.pop(k) for k in keys])
    return state


def load_target(path: str | None = None, dtype: str | torch.dtype = "bfloat16", weights: str = "dense",
                formats: Formats | None = None, device: str | None = None):
    """(TargetModel, tokenizer) for an HF directory / GGUF path, or the embedded default, in weight
    format `weights` (dense, int8, int4: see quant.py), on `device` (default: cuda when available).

    weights="auto" lets `whiflash_core.machine` time the formats on this CPU and pick per phase
    (bf16 activations only: an explicit float32 is the exact reference path and stays dense);
    `formats` imposes such a choice instead. The choice is kept as `model.formats`.
    On a GPU the target is dense in `dtype`: the light formats are PyTorch's CPU kernels.
    """
    dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
    device = torch.device(device or default_device())
    if device.type != "cpu":
        if weights not in ("dense", "auto") or formats is not None:
            print(f"warning: --weights {formats.weights if formats else weights} runs through CPU kernels only; "
                  f"on {device} the target loads dense {str(dt).replace('torch.', '')} weights", file=sys.stderr)
        return _load_dense_on(device, path, dt)
    hf_model, tok = load_hf_model(path)
    directory, gguf_file = model_location(path)
    gguf = os.path.join(directory, gguf_file) if gguf_file else None
    if weights == "auto" and formats is None:
        if dt == torch.bfloat16:
            formats = formats_from(measure(TargetConfig.from_hf(hf_model.config), light_formats(gguf)))
            log.info("--weights auto chose %s (whiflash info shows the timings)", formats)
        else:
            weights = "dense"
    prefill_dt, prefill_from = dt, DENSE_FROM_ROWS
    if formats is not None:
        dt, weights = DTYPES[formats.dtype], formats.weights
        prefill_dt, prefill_from = DTYPES[formats.prefill_dtype], formats.prefill_from_rows
    model = from_hf(hf_model, dt)
    # long inputs through a twin in the prefill dtype (see TargetModel.set_prefill_twin), else
    # through this model's own dense weights from `prefill_from` rows on
    twin = from_hf(hf_model, prefill_dt) if prefill_dt != dt and prefill_from < 10**9 else None
    del hf_model
    apply_weight_format(model, weights, gguf, dense_from_rows=10**9 if twin is not None else prefill_from,
                        head=formats.head if formats is not None else "int8")
    if twin is not None:
        model.set_prefill_twin(twin, prefill_from)
    if weights == "q4_1":   # the C kernels' AMX paths, where they win on this machine
        model.tiles, model.tile_timings = tiles.choose(model.cfg)
    model.formats = formats
    return model, tok


def _load_dense_on(device: torch.device, path: str | None, dtype: torch.dtype):
    """(TargetModel, tokenizer) dense in `dtype` on a device other than the CPU: safetensors are
    read straight onto it; a .gguf (the embedded default) goes through transformers on the CPU."""
    directory, gguf_file = model_location(path)
    if gguf_file is None and _has_safetensors(directory):
        from transformers import AutoTokenizer
        return from_safetensors(directory, dtype, device), AutoTokenizer.from_pretrained(directory)
    hf_model, tok = load_hf_model(path)
    return from_hf(hf_model, dtype).to(device), tok


# --- drafters and the engine ------------------------------------------------------------------


def random_drafters(target: TargetModel, seed: int = 0, draft_vocab: int = 8192,
                    block_size: int = 8, dflash_layers: int = 2) -> dict:
    """Untrained drafters shaped for `target` (tests, and a fallback with a warning)."""
    c = target.cfg
    dv = min(draft_vocab, c.vocab_size)
    eagle_cfg = Eagle3Config(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size, draft_vocab_size=dv,
        tap_layers=[2, c.num_layers // 2, c.num_layers - 3], rms_norm_eps=c.rms_norm_eps, fc_norm=True,
        num_draft_tokens=4)
    dflash_cfg = DFlashConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_layers=dflash_layers,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
        block_size=block_size, mask_token_id=SMOLLM2_MASK_TOKEN_ID if c.vocab_size > 16 else c.vocab_size - 1,
        target_layer_ids=default_target_layer_ids(c.num_layers, 4), num_target_layers=c.num_layers,
        rms_norm_eps=c.rms_norm_eps, draft_vocab_size=dv if dv < c.vocab_size else None)
    return {
        "eagle3": Eagle3Drafter.random(eagle_cfg, target.embed_tokens, seed=seed,
                                       dtype=target.dtype).to(target.device),
        "dflash": DFlashDrafter.random(dflash_cfg, target.embed_tokens, target.lm_head, seed=seed + 1,
                                       dtype=target.dtype).to(target.device),
    }


def drafter_dense_from_rows(formats: Formats | None) -> int:
    """From how many rows an int8 drafter's linears use their dense weights (the drafters' dtype is
    the target's). Where --weights auto found dense GEMMs fast in that dtype, from DENSE_FROM_ROWS
    (catch-ups over a prompt, several requests' blocks drafted together); where it prefills in
    another dtype (float32 where bf16 is emulated, AVX2) dense bf16 is the slow path: 24 rows of
    EAGLE-3's fc took 2.4 ms dense against 0.8 ms for 23 through the int8 kernel (forced AVX2), so
    the int8 kernel serves every row count."""
    if formats is not None and formats.prefill_dtype != formats.dtype:
        return 10**9
    return DENSE_FROM_ROWS


def load_drafters(path: str, target: TargetModel) -> dict:
    """Every drafter kind with a checkpoint under `path` (DIR/eagle3, DIR/dflash)."""
    return {name: kind.load(os.path.join(path, name), target) for name, kind in DRAFTER_KINDS.items()
            if os.path.exists(os.path.join(path, name, "config.json"))}


def load_router_mlp(directory: str | None, target: TargetModel, drafters: dict) -> RouterMLP | None:
    """DIR/router_mlp.safetensors when present and made for this target (its hidden size) and these
    drafters (at least one head for a loaded one); otherwise None, logged: requests asking for the
    learned policy then route by cost."""
    path = os.path.join(directory, ROUTER_MLP_FILE) if directory else None
    if path is None or not os.path.exists(path):
        return None
    mlp = RouterMLP.load(path, target.device)
    if mlp.cfg.hidden_size != target.cfg.hidden_size:
        log.warning("%s was trained on a target of hidden size %d, not %d: not loaded", path,
                    mlp.cfg.hidden_size, target.cfg.hidden_size)
        return None
    if not set(mlp.cfg.drafters) & (set(drafters) | {"ngram"}):
        log.warning("%s predicts drafters %s, none of which is loaded: not loaded", path, list(mlp.cfg.drafters))
        return None
    return mlp.freeze()


def load_engine(model: str | None = None, drafters: str | None = None, dtype: str = "bfloat16",
                eagle3: str | None = None, dflash: str | None = None, threads: int | None = None,
                weights: str = "dense", measure_costs: bool = True, device: str | None = None) -> Engine:
    """The engine for `model` (None = embedded SmolLM2) with drafters from `drafters` (a directory
    in the layout above), or explicit `eagle3` / `dflash` checkpoint directories, on `device`
    (default: cuda when available; the drafters load onto the target's device); with
    `measure_costs`, the router's round-cost model timed on this machine (costs.measure)."""
    if threads:
        torch.set_num_threads(threads)
    target, tokenizer = load_target(model, DTYPES[dtype], weights, device=device)
    found: dict = {}
    directory = drafters or (SHIPPED_DRAFTERS if model is None else None)
    if directory and os.path.isdir(directory):
        found = load_drafters(directory, target)
    for name, checkpoint in (("eagle3", eagle3), ("dflash", dflash)):
        if checkpoint:
            found[name] = DRAFTER_KINDS[name].load(checkpoint, target)
    if not found:
        print("warning: no trained drafters found; using randomly initialised drafters "
              "(output stays exact, but almost no draft token will be accepted)", file=sys.stderr)
        found = random_drafters(target)
    chosen = target.formats.weights if target.formats is not None else weights
    if chosen != "dense":  # a light target gets light drafters (see quantize_int8)
        for drafter in found.values():
            if chosen == "q4_1" and drafter.q4_1_weights == "q4_1":
                quantize_linears_q4_1(drafter, drafter_dense_from_rows(target.formats))
            else:
                quantize_int8(drafter, drafter_dense_from_rows(target.formats))
            if chosen == "q4_1":  # the target's C ops for the drafters too (decode_ops)
                decode_ops.use_for(drafter)
    calibration = RouterCalibration()
    if directory and os.path.exists(os.path.join(directory, "router.json")):
        calibration = RouterCalibration.load(os.path.join(directory, "router.json"))
    name = EMBEDDED_NAME if model is None else os.path.basename(os.path.normpath(model))
    copy_prior = load_copy_prior(os.path.join(directory, "copy_prior.json")) if directory else None
    engine = Engine(target, tokenizer, found, calibration, model_name=name,
                    router_mlp=load_router_mlp(directory, target, found), copy_prior=copy_prior)
    if measure_costs:
        engine.costs = costs.measure(engine)
    return engine
