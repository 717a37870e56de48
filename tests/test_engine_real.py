"""The real embedded target (SmolLM2-135M-Instruct) in float32 with the shipped, trained drafters:
every method equals plain decode, and plain decode equals `transformers` `generate`."""
from __future__ import annotations

import pytest
import torch

from test_engine_tiny import OracleDrafter
from whiflash_core.chat import encode_chat
from whiflash_core.engine import METHODS, Engine, GenerationRequest, SpeculationConfig
from whiflash_core.loading import SHIPPED_DRAFTERS, from_hf, load_drafters, load_hf_model

# exact identity across methods in float32: rerun with the AVX2 kernels forced (.ci/run)
pytestmark = pytest.mark.numerics

PROMPTS = [
    [{"role": "user", "content": "What is a hash table? Answer in two sentences."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [{"role": "user", "content": "Write a Python function that reverses a string, with a docstring."}],
]
MAX_NEW = 48


@pytest.fixture(scope="module")
def real():
    hf, tok = load_hf_model(None)
    target = from_hf(hf, torch.float32)
    drafters = load_drafters(SHIPPED_DRAFTERS, target)
    assert set(drafters) == {"eagle3", "dflash"}, "the trained drafters must ship under models/"
    engine = Engine(target, tok, drafters)
    return hf, tok, engine


def test_plain_decode_equals_transformers_generate(real):
    hf, tok, engine = real
    for messages in PROMPTS[:2]:
        ids = encode_chat(tok, messages)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                          pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        gen = engine.generate(GenerationRequest(ids, 32, stop_token_ids=[],
                                                speculation=SpeculationConfig(method="none")))
        assert gen.output == ref


def test_every_method_equals_plain_decode_float32(real):
    _, tok, engine = real
    switches = 0
    accepted = dict.fromkeys(METHODS[1:], 0)
    for messages in PROMPTS:
        ids = encode_chat(tok, messages)
        plain = engine.generate(GenerationRequest(ids, MAX_NEW, speculation=SpeculationConfig(method="none")))
        for method in METHODS[1:]:
            gen = engine.generate(GenerationRequest(ids, MAX_NEW, speculation=SpeculationConfig(
                method=method, entropy_threshold=1.0)))
            assert gen.output == plain.output, (method, tok.decode(gen.output), tok.decode(plain.output))
            switches += gen.stats()["switches"]
            accepted[method] += gen.stats()["accepted_tokens"]
    assert switches >= 5  # the router really switched between drafters on the real model
    # trained drafters: many tokens come from multi-token verify forwards, and each is still exact
    assert accepted["eagle3"] > 20 and accepted["dflash"] > 20, accepted


def test_multi_token_verification_is_exact_in_float32(real):
    """With drafts that are often right, k-token verify forwards decide most tokens; in float32 they
    still pick exactly plain decode's tokens."""
    _, tok, engine = real
    ids = encode_chat(tok, PROMPTS[2])
    plain = engine.generate(GenerationRequest(ids, MAX_NEW, speculation=SpeculationConfig(method="none"))).output
    oracle = OracleDrafter(plain + [0] * 8, len(ids), error_rate=0.15, seed=3)
    eng = Engine(engine.target, tok, {"eagle3": oracle})
    gen = eng.generate(GenerationRequest(ids, MAX_NEW, speculation=SpeculationConfig(method="eagle3",
                                                                                    num_draft_tokens=6)))
    assert gen.output == plain
    assert gen.stats()["acceptance_length"] > 2.5
