"""The GGUF's Q4_1 blocks run through the CPU int4 matmul as the same weights."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from whiflash_core import decode_ops
from whiflash_core.embedded import EMBEDDED_GGUF, embedded_model_dir
from whiflash_core.loading import from_hf, load_hf_model
from whiflash_core.quant import (HEAD_KINDS, Int4Linear, Int8Linear, decode_q4_1, dynamic_int8_available,
                                 quantize_head, quantize_target_int4)

# agreement rates of int4/int8 kernels with the dense ones: rerun with the AVX2 kernels forced (.ci/run)
pytestmark = pytest.mark.numerics


def _encode_q4_1(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """ggml's Q4_1 byte layout, written independently of the decoder under test."""
    rows, cols = q.shape
    out = np.zeros((rows, cols // 32, 20), dtype=np.uint8)
    out[..., 0:2] = d.astype(np.float16).reshape(rows, -1, 1).view(np.uint8)
    out[..., 2:4] = m.astype(np.float16).reshape(rows, -1, 1).view(np.uint8)
    blocks = q.reshape(rows, cols // 32, 32)
    out[..., 4:] = blocks[..., :16] | (blocks[..., 16:] << 4)
    return out.reshape(rows, -1)


def test_q4_1_blocks_roundtrip_and_int4_matmul_matches_dense():
    rng = np.random.default_rng(0)
    rows, cols = 64, 96
    q = rng.integers(0, 16, size=(rows, cols), dtype=np.uint8)
    d = rng.uniform(0.01, 0.1, size=(rows, cols // 32)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.5, 0.0, size=(rows, cols // 32)).astype(np.float16).astype(np.float32)
    q2, d2, m2 = decode_q4_1(_encode_q4_1(q, d, m), cols)
    assert (q2 == q).all() and (d2 == d).all() and (m2 == m).all()
    w = torch.from_numpy((q.reshape(rows, -1, 32) * d[..., None] + m[..., None]).reshape(rows, cols))
    lin = Int4Linear(q, d, m)
    x = torch.randn(5, cols, dtype=torch.bfloat16)
    ref = x.float() @ w.T
    torch.testing.assert_close(lin(x).float(), ref, rtol=0.02, atol=0.05 * float(ref.abs().max()))


def test_embedded_model_runs_on_its_own_q4_1_weights():
    """Through PyTorch's int4 kernel (Int4Linear) and, where it builds, the Q4_1 x Q8 kernel
    (Q41Linear: the same blocks, activations quantized to int8): 64 rows, all through the kernel."""
    from whiflash_core import q4_1_kernel
    from whiflash_core.quant import Q41Linear

    hf, _ = load_hf_model(None)
    dense = from_hf(hf, torch.bfloat16)
    ids = torch.randint(0, 49152, (64,), generator=torch.Generator().manual_seed(0))
    a = dense(ids, dense.new_cache(64)).logits
    for kind in (Int4Linear,) + ((Q41Linear,) if q4_1_kernel.available() else ()):
        light = from_hf(hf, torch.bfloat16)
        # raises if any packed block differs from the weights transformers dequantised
        assert quantize_target_int4(light, os.path.join(embedded_model_dir(), EMBEDDED_GGUF), kind=kind) == 30 * 4
        assert isinstance(light.layers[0].self_attn.qkv_proj, kind)
        b = light(ids, light.new_cache(64)).logits
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.98, kind
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8, kind


def test_int8_linear_matches_dense_and_switches_to_dense_for_many_rows():
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    lin = Int8Linear(w, dense_from_rows=8)
    assert lin.weight is w  # the dense tensor is shared, not copied
    few, many = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)
    ref = few.float() @ w.float().T
    torch.testing.assert_close(lin(few).float(), ref, rtol=0.02, atol=0.02 * float(ref.abs().max()))
    assert torch.equal(lin(many), torch.nn.functional.linear(many, w))


def test_light_formats_keep_the_greedy_choice_of_the_dense_target():
    """int4 (Q4_1 layers + int8 head), q4_1 (the same blocks through the Q4_1 x Q8 kernel) and int8
    on the real model: the float32-refined top-8 keeps
    the dense target's greedy token at (almost) every position of a real chat prompt."""
    from whiflash_core.chat import encode_chat
    from whiflash_core.loading import load_target

    dense, tok = load_target(None, "bfloat16")
    ids = torch.tensor(encode_chat(tok, [{"role": "user", "content": "Explain what a CPU cache is."}]))
    ref = dense(ids, dense.new_cache(len(ids)), logits_from=0).logits.argmax(-1)
    from whiflash_core import q4_1_kernel

    for weights in ("int8", "int4") + (("q4_1",) if q4_1_kernel.available() else ()):
        model, _ = load_target(None, "bfloat16", weights)
        got = torch.cat([model(ids[i:i + 16], cache, logits_from=0).logits.argmax(-1)
                         for cache in [model.new_cache(len(ids))] for i in range(0, len(ids), 16)])
        assert (got == ref).float().mean() > 0.9, weights


def test_int8_drafters_propose_what_the_dense_ones_do_on_a_real_context():
    """A light target (--weights int4/int8) gets int8 drafters; they must still draft (nearly) the
    same tokens, since acceptance is all a drafter's numerics can change (the target verifies).
    Pooled over four prompts: one prompt's 29 drafting positions agree within a few points of 0.9
    either way as the drafter is retrained (EAGLE-3 rounds thirteen and fifteen, bf16 on a Xeon:
    0.87-0.94 a prompt, 0.911 and 0.906 pooled), while a broken quantization agrees near 0."""
    import copy

    from whiflash_core.chat import encode_chat
    from whiflash_core.drafters.base import Context, DraftSampling
    from whiflash_core.loading import load_engine
    from whiflash_core.quant import quantize_int8

    engine = load_engine(dtype="bfloat16", measure_costs=False)   # nothing here routes a round
    target, tok = engine.target, engine.tokenizer
    taps = engine.tap_layers
    prompts = ["List three uses of a hash map in Python.", "Write a short poem about autumn leaves.",
               "Explain how vaccines train the immune system.", "Translate 'good morning, how are you' into French."]
    contexts = []
    for prompt in prompts:
        ids = encode_chat(tok, [{"role": "user", "content": prompt}])
        with torch.inference_mode():
            out = target(torch.tensor(ids), target.new_cache(len(ids) + 8), taps=taps)
        # draft from each of the last 29 prompt positions
        contexts += [(len(ids), Context(torch.tensor(ids), n, out.taps, taps)) for n in range(len(ids) - 30, len(ids) - 1)]
    for name in ("eagle3", "dflash"):
        dense = engine.drafters[name]
        light = copy.deepcopy(dense)
        assert quantize_int8(light) > 5
        assert all(not isinstance(m, torch.nn.Linear) for m in light.modules())
        agree = total = 0
        for length, ctx in contexts:
            a = dense.propose(dense.new_state(length + 16), ctx, 3, DraftSampling()).tokens
            b = light.propose(light.new_state(length + 16), ctx, 3, DraftSampling()).tokens
            agree += int((a == b).sum())
            total += a.numel()
        assert agree / total > 0.85, (name, agree, total)


@pytest.mark.parametrize("kind", list(HEAD_KINDS))
def test_light_heads_give_candidates_and_the_float32_refinement_the_values(kind):
    """A light LM head (int8 or 4-bit weights, or the dynamic int8 GEMM that quantizes activations
    too) only ranks candidates: the target's top-8 logits are recomputed in float32 from the dense
    weights."""
    from tiny import tiny_target

    if kind == "dynint8" and not dynamic_int8_available():
        pytest.skip("this PyTorch build has no dynamic int8 GEMM")
    model = tiny_target(torch.bfloat16, vocab=512)
    dense_head = model.lm_head.weight
    quantize_head(model, kind)
    assert not isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight is dense_head
    h = torch.randn(6, model.cfg.hidden_size, dtype=torch.bfloat16)
    exact = h.float() @ dense_head.float().T
    got = model.logits(h)
    approx = model.lm_head(h).float()
    # the candidates: the top 8 (equal coarse logits rank by the lower index, as the C pass does)
    refined = decode_ops.topk_indices(approx, model.refine_top)
    if refined is None:
        refined = approx.topk(model.refine_top, dim=-1).indices
    torch.testing.assert_close(got.gather(-1, refined), exact.gather(-1, refined), rtol=1e-5, atol=1e-5)
    assert (refined == exact.argmax(-1, keepdim=True)).any(-1).all()  # the true argmax is a candidate...
    assert (got.argmax(-1) == exact.argmax(-1)).all()  # ...so the greedy choice is exact
    assert torch.nn.functional.cosine_similarity(approx, exact, dim=-1).min() > 0.98
