"""Grammar-constrained decoding (`whiflash_core.constraints`) on the real SmolLM2 in float32:
constrained speculative decoding must equal constrained plain decoding token for token, also when
drafts are mostly right and the grammar masks are applied along many accepted draft tokens."""
from __future__ import annotations

import json

import pytest
import torch

from test_engine_tiny import OracleDrafter
from whiflash_core.chat import encode_chat
from whiflash_core.constraints import GrammarFactory
from whiflash_core.engine import Engine, GenerationRequest, SpeculationConfig
from whiflash_core.loading import from_hf, load_hf_model, random_drafters
from whiflash_core.sampling import SamplingParams

# exact identity across methods in float32: rerun with the AVX2 kernels forced (.ci/run)
pytestmark = pytest.mark.numerics

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}

CASES = {
    "tool-required": ([{"role": "user", "content": "What's the weather like in Paris today?"}], [WEATHER, ADD],
                      lambda g: g.tool_calls([WEATHER, ADD], parallel=False)),
    "tool-parallel": ([{"role": "user", "content": "What is 2 plus 3?"}], [WEATHER, ADD],
                      lambda g: g.tool_calls([WEATHER, ADD], parallel=True)),
    "json-object": ([{"role": "user", "content": "Give me a JSON object describing a cat with name and age."}],
                    None, lambda g: g.json_object()),
    "json-schema": ([{"role": "user", "content": "Is it sunny in Paris? Answer in JSON."}], None,
                    lambda g: g.json_schema(SCHEMA)),
}
MAX_NEW = 32


@pytest.fixture(scope="module")
def real():
    hf, tok = load_hf_model(None)
    target = from_hf(hf, torch.float32)
    engine = Engine(target, tok, random_drafters(target, seed=0))
    return engine, GrammarFactory(tok, target.cfg.vocab_size, engine.eos_ids)


def run(engine, grammars, case, method="none", **spec):
    messages, tools, make = CASES[case]
    ids = encode_chat(engine.tokenizer, messages, tools)
    return engine.generate(GenerationRequest(ids, MAX_NEW, speculation=SpeculationConfig(method=method, **spec),
                                             constraint=make(grammars)))


# json-object parts from plain decode in bf16 at a near-tie (see README); float32 must agree exactly
@pytest.mark.parametrize("case,method", [("tool-parallel", "whiflash"), ("json-object", "whiflash"),
                                         ("json-schema", "dflash")])
def test_constrained_methods_equal_constrained_plain_decode(real, case, method):
    engine, grammars = real
    plain = run(engine, grammars, case)
    text = engine.tokenizer.decode(plain.output)
    if case.startswith("tool"):
        assert text.startswith('<tool_call>\n{"name": "'), text
    elif plain.finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    # a low router threshold makes whiflash switch drafters often
    gen = run(engine, grammars, case, method, entropy_threshold=1.0)
    assert gen.output == plain.output, (method, engine.tokenizer.decode(gen.output), text)


@pytest.mark.parametrize("case", ["tool-required", "json-schema"])
def test_masks_along_mostly_right_drafts(real, case):
    """An oracle drafter (plain output with 15% of tokens corrupted) gets long drafts accepted, so
    the grammar masks of later draft rows decide tokens too."""
    engine, grammars = real
    plain = run(engine, grammars, case).output
    messages, tools, make = CASES[case]
    ids = encode_chat(engine.tokenizer, messages, tools)
    oracle = OracleDrafter(plain + [0] * 8, len(ids), error_rate=0.15, seed=5)
    eng = Engine(engine.target, engine.tokenizer, {"eagle3": oracle})
    gen = eng.generate(GenerationRequest(ids, MAX_NEW, constraint=make(grammars),
                                         speculation=SpeculationConfig(method="eagle3", num_draft_tokens=6)))
    assert gen.output == plain
    assert gen.stats()["acceptance_length"] > 1.5 and gen.stats()["accepted_tokens"] >= len(plain) // 3


def test_masks_look_ahead_without_committing(real):
    engine, grammars = real
    tok = engine.tokenizer
    c = grammars.json_schema(SCHEMA)
    good = tok('{"city": "Paris", "sunny": true}', add_special_tokens=False)["input_ids"]
    bad_at = 3
    draft = good[:bad_at] + tok("}", add_special_tokens=False)["input_ids"] + good[bad_at + 1:]
    masks = c.masks(draft)
    assert masks.shape == (bad_at + 1, engine.target.cfg.vocab_size)  # rows up to the first violation
    assert all(bool(masks[i, draft[i]]) for i in range(bad_at))
    assert not bool(masks[bad_at, draft[bad_at]])
    assert torch.equal(c.masks(draft), masks)  # nothing was committed
    c.advance(good)
    assert masks.dtype == torch.bool
    end = c.masks([])
    assert end.shape[0] == 1 and end[0].nonzero().flatten().tolist() == engine.eos_ids  # only EOS left
    with pytest.raises(RuntimeError):
        grammars.json_schema(SCHEMA).advance(tok("nope", add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("method", ["none", "whiflash"])
def test_sampled_output_keeps_to_the_grammar(real, method):
    """At temperature > 0 the rows are masked into a copy (sampling.mask_logits) before the
    rejection sampler: every sampled answer is a complete JSON object of the schema, whatever the
    seed, and the drafts' rows are masked too (whiflash)."""
    engine, grammars = real
    messages, tools, make = CASES["json-schema"]
    ids = encode_chat(engine.tokenizer, messages, tools)
    stopped = 0
    for seed in range(3):
        gen = engine.generate(GenerationRequest(ids, 64, sampling=SamplingParams(temperature=1.0, seed=seed),
                                                speculation=SpeculationConfig(method=method),
                                                constraint=make(grammars)))
        text = engine.tokenizer.decode(gen.output)
        make(grammars).advance(gen.output)   # raises on a token the grammar forbids
        if gen.finish_reason == "stop":      # a long sampled string may run to max_tokens instead
            answer = json.loads(text)
            assert set(answer) == {"city", "sunny"} and isinstance(answer["sunny"], bool), text
            stopped += 1
    assert stopped, "no sampled answer finished: the JSON check never ran"
