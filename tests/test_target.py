"""Our plain target reproduces Hugging Face Llama and Qwen3 logits (float64), incl. rollback."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from whiflash_core.loading import from_hf, from_safetensors

# float64 logits against transformers: rerun with the AVX2 kernels forced (.ci/run)
pytestmark = pytest.mark.numerics


def _hf(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, tie_word_embeddings=False, **common))
    elif kind == "llama3_rope":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common))
    return model.double().eval()


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "qwen3"])
def test_logits_and_taps_match_transformers(kind):
    hf = _hf(kind)
    ours = from_hf(hf, torch.float64)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    cache = ours.new_cache(8)  # small on purpose: the cache must grow
    # prompt in one chunk, then 1-token and 5-token steps, with a rollback in between
    out1 = ours(ids[0, :20], cache, taps=(0, 2, 4))
    out2 = ours(ids[0, 20:25], cache, taps=(0, 2, 4))
    ours(ids[0, 25:30].flip(0), cache)  # a rejected draft ...
    cache.rollback(25)                   # ... rolled back
    out3 = ours(ids[0, 25:40], cache, taps=(0, 2, 4))
    logits = torch.cat([out1.logits, out2.logits, out3.logits])
    taps = torch.cat([out1.taps, out2.taps, out3.taps])
    torch.testing.assert_close(logits, ref.logits[0].float(), rtol=1e-5, atol=1e-5)
    for j, layer in enumerate((0, 2, 4)):
        torch.testing.assert_close(taps[:, j], ref.hidden_states[layer][0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["llama3_rope", "qwen3"])
def test_from_safetensors_equals_from_hf(tmp_path, kind):
    """The direct loader (tensors straight onto the device, used off the CPU) builds the same model
    as the transformers path: same weights and RoPE, so bit-identical logits."""
    hf = _hf(kind)
    hf.save_pretrained(tmp_path)
    direct = from_safetensors(str(tmp_path), torch.float64)
    via_hf = from_hf(hf, torch.float64)
    assert direct.state_dict().keys() == via_hf.state_dict().keys()
    for name, tensor in via_hf.state_dict().items():
        assert torch.equal(direct.state_dict()[name], tensor), name
    assert (direct.lm_head.weight is direct.embed_tokens.weight) == hf.config.tie_word_embeddings
    ids = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(2))
    assert torch.equal(direct(ids, direct.new_cache(31)).logits, via_hf(ids, via_hf.new_cache(31)).logits)
