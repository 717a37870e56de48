"""Legacy `/v1/completions` and several choices (`n`, prompt lists), in-process around the fake engine
of test_gateway_units (it replays a fixed reply several tokens per round), with the official client.
The real model behind them is covered in test_sampling_fields_live.py."""
from __future__ import annotations

import json

import openai
import pytest

from test_compat import client_for
from test_gateway_units import HI, MODEL, FakeEngine, in_process
from test_hostile_input import assert_openai_error

REPLY = "Hello there STOP and the rest"


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_completion_text_stream_and_stop(chunk):
    app, tc = in_process(FakeEngine(REPLY, chunk=chunk))
    with tc:
        client = client_for(tc)
        r = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=100)
        assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
        (choice,) = r.choices
        assert choice.text == REPLY and choice.finish_reason == "stop" and choice.index == 0
        assert r.usage.prompt_tokens == len("Say hi") and r.usage.completion_tokens == len(REPLY)

        r = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=100, stop=["STOP"])
        assert r.choices[0].text == "Hello there " and r.choices[0].finish_reason == "stop"
        chunks = list(client.completions.create(model=MODEL, prompt="Say hi", max_tokens=100, stop=["STOP"],
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello there "
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len("Hello there STOP")  # up to the token completing the stop string


def test_completion_default_max_tokens_is_16_and_length():
    app, tc = in_process(FakeEngine("x" * 40))
    with tc:
        r = client_for(tc).completions.create(model=MODEL, prompt="go")
        assert r.choices[0].text == "x" * 16 and r.choices[0].finish_reason == "length"


def test_completion_prompt_forms_and_n():
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        client = client_for(tc)
        r = client.completions.create(model=MODEL, prompt=["a", "bcd"], n=2)
        assert [c.index for c in r.choices] == [0, 1, 2, 3] and all(c.text == "ok" for c in r.choices)
        assert r.usage.prompt_tokens == 1 + 3 and r.usage.completion_tokens == 4 * 2  # each prompt once
        r = client.completions.create(model=MODEL, prompt=[104, 105])  # token ids
        assert r.choices[0].text == "ok" and r.usage.prompt_tokens == 2
        r = client.completions.create(model=MODEL, prompt=[[104], [105, 106]])
        assert len(r.choices) == 2 and r.usage.prompt_tokens == 3
        chunks = list(client.completions.create(model=MODEL, prompt=["a", "b"], n=2, stream=True))
        texts: dict[int, str] = {}
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        assert texts == dict.fromkeys(range(4), "ok")


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"), ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"), ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": {"a": 1}}, "prompt"), ({}, "prompt"), ({"prompt": "x", "n": 0}, "n"),
])
def test_completion_bad_input_is_a_400_naming_the_field(body, param):
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        r = tc.post("/v1/completions", json={"model": MODEL, **body})
        error = assert_openai_error(r, 400)
        assert error["param"] == param, error


def test_completion_unknown_model_is_404():
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        with pytest.raises(openai.NotFoundError):
            client_for(tc).completions.create(model="nope", prompt="x")


def test_chat_n_choices_streamed_and_not():
    app, tc = in_process(FakeEngine(REPLY, chunk=3))
    with tc:
        client = client_for(tc)
        r = client.chat.completions.create(model=MODEL, messages=HI, n=3)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert all(c.message.content == REPLY and c.finish_reason == "stop" for c in r.choices)
        assert r.usage.completion_tokens == 3 * len(REPLY)
        assert len(r.model_extra["speculation"]["choices"]) == 3
        body = {"model": MODEL, "messages": HI, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
        with tc.stream("POST", "/v1/chat/completions", json=body) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        texts, reasons = {}, {}
        for e in events:
            for ch in e["choices"]:
                texts[ch["index"]] = texts.get(ch["index"], "") + (ch["delta"].get("content") or "")
                if ch["finish_reason"]:
                    reasons[ch["index"]] = ch["finish_reason"]
        assert texts == {0: REPLY, 1: REPLY} and reasons == {0: "stop", 1: "stop"}
        assert events[-1]["usage"]["completion_tokens"] == 2 * len(REPLY)


def test_chat_n_beyond_the_bound_and_top_logprobs_without_logprobs_are_400s():
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "n": 17})
        assert assert_openai_error(r, 400)["param"] == "n"
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "top_logprobs": 2})
        assert assert_openai_error(r, 400)["param"] == "top_logprobs"
        for bad in ({"x": 1.0}, {"5": 101}, {"5": "1"}):
            r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "logit_bias": bad})
            assert assert_openai_error(r, 400)["param"].startswith("logit_bias"), bad
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "presence_penalty": 3})
        assert assert_openai_error(r, 400)["param"] == "presence_penalty"
