"""Penalties, logit_bias, logprobs, `n` and legacy completions on the real model (conftest's float32
live server, where every method equals plain decoding), through the official `openai` client."""
from __future__ import annotations

import math

import pytest

from test_gateway import CAPITAL, METHODS, MODEL

pytestmark = [pytest.mark.timeout(600), pytest.mark.numerics]

PENALTIES = {"presence_penalty": 1.2, "frequency_penalty": 0.8}
STORY = [{"role": "user", "content": "Write the word 'yes' ten times."}]


@pytest.fixture(scope="module")
def client(live_server):
    return live_server.client()


def chat(client, messages, method, max_tokens=24, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body={"speculation": {"method": method}}, **kw)


def test_penalties_change_the_output_and_every_method_equals_penalised_plain_decode(client):
    plain = chat(client, STORY, "none").choices[0].message.content
    penalised = chat(client, STORY, "none", **PENALTIES).choices[0].message.content
    assert penalised != plain
    for method in METHODS[1:]:
        r = chat(client, STORY, method, **PENALTIES)
        assert r.choices[0].message.content == penalised, method
    assert r.model_extra["speculation"]["rounds"] >= 1


def test_logit_bias_bans_a_token_for_every_method(client):
    first = chat(client, CAPITAL, "none", max_tokens=8, logprobs=True).choices[0].logprobs.content[0]
    banned = _token_id(first.token)
    for method in ("none", "whiflash"):
        r = chat(client, CAPITAL, method, max_tokens=8, logprobs=True, top_logprobs=5,
                 logit_bias={str(banned): -100})
        assert r.choices[0].logprobs.content[0].token != first.token, method
        # the reported distribution is the biased one: the banned token is (almost) impossible
        assert all(x.token != first.token for x in r.choices[0].logprobs.content[0].top_logprobs)


def _token_id(text: str) -> int:
    from transformers import AutoTokenizer

    from whiflash_core.loading import model_location

    path, gguf = model_location(None)
    tok = AutoTokenizer.from_pretrained(path, **({"gguf_file": gguf} if gguf else {}))
    (tid,) = tok(text, add_special_tokens=False)["input_ids"]
    return tid


def test_logprobs_streamed_and_not_agree_and_describe_the_answer(client):
    r = chat(client, CAPITAL, "whiflash", logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert bytes(b for t in content for b in t.bytes).decode() == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True) and sum(math.exp(v) for v in values) <= 1 + 1e-6
    plain = chat(client, CAPITAL, "none", logprobs=True, top_logprobs=3).choices[0].logprobs.content
    assert [(t.token, round(t.logprob, 4)) for t in plain] == [(t.token, round(t.logprob, 4)) for t in content]
    streamed = []
    for chunk in chat(client, CAPITAL, "whiflash", logprobs=True, top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(t.token, t.logprob, [x.token for x in t.top_logprobs]) for t in streamed] == \
        [(t.token, t.logprob, [x.token for x in t.top_logprobs]) for t in content]


def test_n_choices_sample_independently_with_a_seed(client):
    kw = dict(model=MODEL, messages=CAPITAL, max_tokens=12, temperature=1.0, seed=11, n=3)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # reproducible
    assert len({c.message.content for c in a.choices}) > 1  # seed + i: the choices differ


def test_completions_on_the_real_model_stream_and_methods_agree(client):
    prompt = "The three primary colours are"
    texts = []
    for method in ("none", "whiflash"):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"speculation": {"method": method}})
        texts.append(r.choices[0].text)
        assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert texts[0] == texts[1] == streamed and texts[0].strip()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 6
    assert lp.text_offset[0] == 0 and all(len(d) == 2 for d in lp.top_logprobs)
