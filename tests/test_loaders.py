"""Drafter checkpoints in the published layouts load, and save -> load reproduces outputs exactly.

The synthetic checkpoints are written by hand here (config fields and tensor names as the
published SafeAILab, vLLM `speculators` and z-lab files have them), not by our own saver.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from tiny import VOCAB, tiny_target
from whiflash_core.drafters.base import Context, DraftSampling
from whiflash_core.drafters.dflash import DFlashDrafter
from whiflash_core.drafters.eagle3 import Eagle3Drafter

H, NH, NKV, HD, I = 32, 4, 2, 8, 48
DV = 40  # reduced draft vocabulary


def _context(target, taps, n=12, seed=0):
    ids = torch.randint(0, VOCAB, (n + 1,), generator=torch.Generator().manual_seed(seed))
    cache = target.new_cache(64)
    out = target(ids[:n], cache, taps=taps)
    buf = torch.zeros(64, len(taps), H, dtype=target.dtype)
    buf[:n] = out.taps
    return Context(torch.cat([ids, torch.zeros(40, dtype=torch.long)]), n, buf, taps)


def _rand(*shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float32) * 0.2


def _eagle_layer(prefix: str, g) -> dict:
    return {
        f"{prefix}self_attn.q_proj.weight": _rand(NH * HD, 2 * H, g=g),
        f"{prefix}self_attn.k_proj.weight": _rand(NKV * HD, 2 * H, g=g),
        f"{prefix}self_attn.v_proj.weight": _rand(NKV * HD, 2 * H, g=g),
        f"{prefix}self_attn.o_proj.weight": _rand(H, NH * HD, g=g),
        f"{prefix}mlp.gate_proj.weight": _rand(I, H, g=g),
        f"{prefix}mlp.up_proj.weight": _rand(I, H, g=g),
        f"{prefix}mlp.down_proj.weight": _rand(H, I, g=g),
        f"{prefix}input_layernorm.weight": 1 + _rand(H, g=g),
        f"{prefix}hidden_norm.weight": 1 + _rand(H, g=g),
        f"{prefix}post_attention_layernorm.weight": 1 + _rand(H, g=g),
    }


def _vocab_buffers(g):
    ids = torch.sort(torch.randperm(VOCAB, generator=g)[:DV]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    return {"d2t": ids - torch.arange(DV), "t2d": t2d}


def write_safeailab(path: str, weights_file: str = "model.safetensors") -> None:
    """Flat Llama-style config, `midlayer.*` tensors, no rope_theta, no embedding (as published)."""
    os.makedirs(path)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV,
              "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5,
              "max_position_embeddings": 2048, "vocab_size": VOCAB, "draft_vocab_size": DV,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
              "torch_dtype": "float16", "initializer_range": 0.02, "use_cache": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(11)
    sd = {"fc.weight": _rand(H, 3 * H, g=g), **_eagle_layer("midlayer.", g), "norm.weight": 1 + _rand(H, g=g),
          "lm_head.weight": _rand(DV, H, g=g), **_vocab_buffers(g)}
    if weights_file.endswith(".bin"):
        torch.save(sd, os.path.join(path, weights_file))
    else:
        save_file(sd, os.path.join(path, weights_file))


def write_speculators(path: str, with_flags: bool = True) -> None:
    """`speculators` layout: nested transformer_layer_config, `layers.0.*`, norm flags, fc_norm tensors."""
    os.makedirs(path)
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "speculators_version": "0.9.0",
        "transformer_layer_config": {"model_type": "llama", "hidden_size": H, "intermediate_size": I,
                                     "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
                                     "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                                     "max_position_embeddings": 2048, "attention_bias": False,
                                     "mlp_bias": False, "vocab_size": VOCAB},
        "draft_vocab_size": DV, "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                     "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                               "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}},
    }
    if with_flags:
        config.update({"norm_before_residual": False, "fc_norm": True, "norm_output": True})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(12)
    sd = {"fc.weight": _rand(H, 3 * H, g=g), **_eagle_layer("layers.0.", g), "norm.weight": 1 + _rand(H, g=g),
          "lm_head.weight": _rand(DV, H, g=g), **_vocab_buffers(g)}
    if with_flags:
        sd.update({f"fc_norm.{i}.weight": 1 + _rand(H, g=g) for i in range(3)})
    save_file(sd, os.path.join(path, "model.safetensors"))


def write_zlab(path: str, schema: str) -> None:
    """z-lab DFlash: `layers.N.*` with q_norm/k_norm, fc + hidden_norm + norm, no embedding/head."""
    os.makedirs(path)
    config = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
              "model_type": "qwen3", "num_target_layers": 6, "num_hidden_layers": 2, "hidden_size": H,
              "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
              "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
              "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False,
              "layer_types": ["full_attention"] * 2, "dtype": "bfloat16"}
    dflash = {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 2, 3]}
    if schema == "top_level_block":  # Qwen3-8B-b16 head: block_size top level
        config["block_size"] = 5
        config["dflash_config"] = dflash
    else:  # newer heads: everything under dflash_config
        config["dflash_config"] = {**dflash, "block_size": 5}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(13)
    sd = {"fc.weight": _rand(H, 3 * H, g=g), "hidden_norm.weight": 1 + _rand(H, g=g), "norm.weight": 1 + _rand(H, g=g)}
    for n in range(2):
        p = f"layers.{n}."
        sd.update({
            p + "self_attn.q_proj.weight": _rand(NH * HD, H, g=g), p + "self_attn.k_proj.weight": _rand(NKV * HD, H, g=g),
            p + "self_attn.v_proj.weight": _rand(NKV * HD, H, g=g), p + "self_attn.o_proj.weight": _rand(H, NH * HD, g=g),
            p + "self_attn.q_norm.weight": 1 + _rand(HD, g=g), p + "self_attn.k_norm.weight": 1 + _rand(HD, g=g),
            p + "mlp.gate_proj.weight": _rand(I, H, g=g), p + "mlp.up_proj.weight": _rand(I, H, g=g),
            p + "mlp.down_proj.weight": _rand(H, I, g=g), p + "input_layernorm.weight": 1 + _rand(H, g=g),
            p + "post_attention_layernorm.weight": 1 + _rand(H, g=g)})
    if schema == "all_in_dflash_config":  # some uploads carry the target's tensors: must be ignored
        sd["embed_tokens.weight"] = _rand(VOCAB, H, g=g)
        sd["lm_head.weight"] = _rand(VOCAB, H, g=g)
    save_file(sd, os.path.join(path, "model.safetensors"))


def _propose(drafter, target, k):
    ctx = _context(target, drafter.tap_layers)
    state = drafter.new_state(64)
    logits_draft = drafter.propose(state, ctx, k, DraftSampling())
    sampled = drafter.propose(drafter.new_state(64), ctx, k,
                              DraftSampling(1.0, torch.Generator().manual_seed(0)))
    return logits_draft.tokens, sampled.probs


@pytest.mark.parametrize("weights_file", ["model.safetensors", "pytorch_model.bin"])
def test_safeailab_eagle3_loads_and_roundtrips(tmp_path, weights_file):
    target = tiny_target(torch.float32)
    write_safeailab(str(tmp_path / "ea"), weights_file)
    d = Eagle3Drafter.load(str(tmp_path / "ea"), target, torch.float32)
    c = d.cfg
    assert c.rope_theta == 10000.0 and c.tap_layers == [2, 3, 3]  # {2, L//2, L-3} for L = 6
    assert not (c.norm_before_residual or c.fc_norm or c.norm_output) and c.draft_vocab_size == DV
    assert d.embed_tokens is target.embed_tokens  # the target's embedding, not a copy
    tokens, probs = _propose(d, target, 4)
    assert bool(d.t2d[tokens].all())  # drafts are mapped into the target vocabulary via d2t
    d.save(str(tmp_path / "again"), layout="safeailab", dtype=torch.float32)
    with open(tmp_path / "again" / "config.json") as f:
        assert "rope_theta" in json.load(f)
    d2 = Eagle3Drafter.load(str(tmp_path / "again"), target, torch.float32)
    tokens2, probs2 = _propose(d2, target, 4)
    assert torch.equal(tokens, tokens2) and torch.equal(probs, probs2)


def test_speculators_eagle3_honours_flags_and_roundtrips(tmp_path):
    target = tiny_target(torch.float32)
    write_speculators(str(tmp_path / "sp"))
    d = Eagle3Drafter.load(str(tmp_path / "sp"), target, torch.float32)
    c = d.cfg
    assert c.tap_layers == [1, 3, 4] and c.fc_norm and c.norm_output and not c.norm_before_residual
    assert c.num_draft_tokens == 3
    tokens, probs = _propose(d, target, 4)
    d.save(str(tmp_path / "again"), layout="speculators", dtype=torch.float32)
    d2 = Eagle3Drafter.load(str(tmp_path / "again"), target, torch.float32)
    tokens2, probs2 = _propose(d2, target, 4)
    assert torch.equal(tokens, tokens2) and torch.equal(probs, probs2)
    # a flag changes the computation: flipping norm_output changes the chain's later drafts
    d2.cfg.norm_output = False
    _, probs3 = _propose(d2, target, 4)
    assert torch.equal(probs[0], probs3[0]) and not torch.equal(probs[1:], probs3[1:])


def test_speculators_missing_norm_before_residual_defaults_like_vllm(tmp_path):
    target = tiny_target(torch.float32)
    write_speculators(str(tmp_path / "sp"), with_flags=False)
    d = Eagle3Drafter.load(str(tmp_path / "sp"), target, torch.float32)
    assert d.cfg.norm_before_residual is True


@pytest.mark.parametrize("schema", ["top_level_block", "all_in_dflash_config"])
def test_zlab_dflash_loads_and_roundtrips(tmp_path, schema):
    target = tiny_target(torch.float32)
    write_zlab(str(tmp_path / "df"), schema)
    d = DFlashDrafter.load(str(tmp_path / "df"), target, torch.float32)
    c = d.cfg
    assert c.block_size == 5 and c.mask_token_id == VOCAB - 1 and c.rope_theta == 1e6
    assert d.tap_layers == (1, 3, 4)  # z-lab ids name layer outputs: hidden_states[id + 1]
    assert d.max_draft_tokens == 4
    tokens, probs = _propose(d, target, 4)
    assert tokens.shape == (4,)
    d.save(str(tmp_path / "again"), dtype=torch.float32)
    d2 = DFlashDrafter.load(str(tmp_path / "again"), target, torch.float32)
    tokens2, probs2 = _propose(d2, target, 4)
    assert torch.equal(tokens, tokens2) and torch.equal(probs, probs2)


def test_a_gguf_is_converted_once_and_then_loads_the_same_model(tmp_path, monkeypatch):
    """load_hf_model keeps transformers' conversion of a GGUF as a plain Hugging Face directory in
    the cache; the next load reads that instead, with the same weights, config and tokenizer."""
    from whiflash_core.embedded import EMBEDDED_GGUF, embedded_model_dir
    from whiflash_core.loading import converted_gguf_dir, load_hf_model

    monkeypatch.setenv("WHIFLASH_CACHE_DIR", str(tmp_path))
    gguf = os.path.join(embedded_model_dir(), EMBEDDED_GGUF)
    kept = converted_gguf_dir(gguf)
    assert not kept.exists()
    stale, unrelated = tmp_path / "converted" / "older", tmp_path / "converted" / "other-model"
    for d, source in ((stale, os.path.realpath(gguf)), (unrelated, "/elsewhere/model.gguf")):
        d.mkdir(parents=True)
        (d / "whiflash_source.json").write_text(json.dumps({"gguf": source}))
    first, tok1 = load_hf_model(None)  # from the GGUF, then kept
    assert not stale.exists() and unrelated.exists()  # an older conversion of the same file is dropped
    assert (kept / "config.json").exists() and (kept / "model.safetensors").exists()
    assert not list(tmp_path.glob("converted/*.tmp-*"))  # written aside, renamed whole
    second, tok2 = load_hf_model(None)  # from the kept directory
    assert os.path.samefile(second.config._name_or_path, kept)
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.lm_head.weight.data_ptr() == second.model.embed_tokens.weight.data_ptr()  # still tied
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    assert tok1.apply_chat_template(chat, add_generation_prompt=True) == tok2.apply_chat_template(
        chat, add_generation_prompt=True)
    assert tok1.eos_token_id == tok2.eos_token_id and len(tok1) == len(tok2)
