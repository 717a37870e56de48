"""OpenAI compatibility details (issue 17), in-process around the fake engine: /v1/models/{id},
unknown `model` names, strict field types, and the usage detail objects."""
from __future__ import annotations

import argparse
import json

import openai
import pytest

from test_gateway_units import HI, MODEL, FakeEngine, in_process
from test_hostile_input import assert_openai_error


def client_for(tc) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc, max_retries=0)


# --- model ids: /v1/models/{id}, aliases, unknown names ------------------------------------------


def test_model_aliases_from_environment_and_flags(monkeypatch):
    from app.serve_cli import add_parser, settings_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    monkeypatch.setenv("WHIFLASH_MODEL_ALIASES", "gpt-4o, gpt-4o-mini")
    assert settings_from_args(parser.parse_args(["serve"])).model_aliases == ["gpt-4o", "gpt-4o-mini"]
    s = settings_from_args(parser.parse_args(["serve", "--model-alias", "a", "b", "--model-alias", "c"]))
    assert s.model_aliases == ["a", "b", "c"]  # flags replace the environment's list


def test_retrieve_model_by_id_and_alias():
    app, tc = in_process(FakeEngine("ok"), model_aliases=["gpt-4o", "org/alias"])
    with tc:
        client = client_for(tc)
        card = client.models.retrieve(MODEL)
        assert card.id == MODEL and card.object == "model" and card.owned_by == "whiflash"
        assert card.model_extra["max_model_len"] == 4096
        for alias in ("gpt-4o", "org/alias"):  # ids with a slash too (HF-style names)
            assert client.models.retrieve(alias).id == alias
            assert client.models.retrieve(alias).model_extra["root"] == MODEL
        assert [m.id for m in client.models.list()] == [MODEL, "gpt-4o", "org/alias"]  # served id first
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve("gpt-5")
        error = assert_openai_error(info.value.response, 404, "model_not_found")
        assert "gpt-5" in error["message"] and error["type"] == "invalid_request_error"


def test_unknown_model_is_404_and_served_name_aliases_and_absent_are_served():
    app, tc = in_process(FakeEngine("ok"), model_aliases=["gpt-4o-mini"])
    with tc:
        client = client_for(tc)
        for stream in (False, True):
            with pytest.raises(openai.NotFoundError) as info:
                client.chat.completions.create(model="any-name", messages=HI, stream=stream)
            error = assert_openai_error(info.value.response, 404, "model_not_found")
            assert error["param"] == "model" and "any-name" in error["message"]
        for name in (MODEL, "gpt-4o-mini"):
            r = client.chat.completions.create(model=name, messages=HI)
            assert r.choices[0].message.content == "ok" and r.model == MODEL
        # no `model` at all (curl, the browser pages) means the served model, as in vLLM
        r = tc.post("/v1/chat/completions", json={"messages": HI})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_chat_page_sends_the_served_model_id():
    from pathlib import Path

    js = (Path(__file__).resolve().parent.parent / "static" / "chat.js").read_text()
    assert "models.data[0].id" in js and "model: servedModel" in js


# --- strict types -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [("temperature", "0.5"), ("stream", "yes"), ("max_tokens", "5"),
                                         ("top_p", "1"), ("max_completion_tokens", 5.0), ("stream", 1),
                                         ("seed", "7"), ("n", "1"), ("top_k", True), ("logprobs", "false"),
                                         ("parallel_tool_calls", "true")])
def test_loose_types_are_400s_naming_the_field(field, value):
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, field: value})
        error = assert_openai_error(r, 400, "invalid_value")
        assert error["param"] == field and field in error["message"]


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "true"}}]}, "tools[0].function.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"modalities": "text"}, "modalities")])
def test_loose_types_inside_objects_are_400s_naming_the_field(body, param):
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        error = assert_openai_error(tc.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, **body}),
                                    400, "invalid_value")
        assert error["param"] == param


def test_proper_json_types_stay_valid():
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        body = {"model": MODEL, "messages": HI, "temperature": 1, "top_p": 1, "max_tokens": 5, "stream": False,
                "seed": 3, "n": 1, "top_k": 0, "presence_penalty": 0, "parallel_tool_calls": False}
        r = tc.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert client_for(tc).chat.completions.create(model=MODEL, messages=HI, temperature=0.5, top_p=0.9,
                                                      max_tokens=5).choices[0].message.content == "ok"


# --- usage details ----------------------------------------------------------------------------------


def expected_details(speculation: dict) -> dict:
    drafters = speculation["drafters"].values()
    accepted = sum(d["accepted_tokens"] for d in drafters)
    return {"reasoning_tokens": 0, "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": sum(d["draft_tokens"] for d in drafters) - accepted}


def test_usage_details_in_responses_and_the_usage_chunk():
    app, tc = in_process(FakeEngine("hello world, a longer reply", chunk=4))
    with tc:
        r = client_for(tc).chat.completions.create(model=MODEL, messages=HI)
        usage = r.usage.model_dump(exclude_none=True)  # the client model adds its own None fields
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        details = usage["completion_tokens_details"]
        assert details == expected_details(r.model_extra["speculation"])
        assert details["accepted_prediction_tokens"] > 0 and details["rejected_prediction_tokens"] > 0

        body = {"model": MODEL, "messages": HI, "stream": True, "stream_options": {"include_usage": True}}
        with tc.stream("POST", "/v1/chat/completions", json=body) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        last = events[-1]
        assert last["choices"] == [] and last["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert last["usage"]["completion_tokens_details"] == expected_details(last["speculation"])
        assert last["usage"]["completion_tokens_details"] == details  # the same replay, the same counts


# --- one message, streamed or not (issue 17, findings 3-5) -------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}} for name in ("get_weather", "add")]


def message_both_ways(reply: str, **kw):
    """(content, [(name, arguments)], finish_reason) of the same request non-streamed and streamed (the
    raw chunks put together); content "" and None count the same."""
    app, tc = in_process(FakeEngine(reply, chunk=3))
    with tc:
        client = client_for(tc)
        r = client.chat.completions.create(model=MODEL, messages=HI, **kw)
        m = r.choices[0].message
        whole = (m.content or "", [(c.function.name, c.function.arguments) for c in m.tool_calls or []],
                 r.choices[0].finish_reason)
        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(model=MODEL, messages=HI, stream=True, **kw):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                assert call.id and call.function.name and call.index not in calls  # a call is sent whole, once
                calls[call.index] = (call.function.name, call.function.arguments)
            finish = chunk.choices[0].finish_reason or finish
        return whole, (content, [calls[i] for i in sorted(calls)], finish)


@pytest.mark.parametrize("reply,kw,expected", [
    # cut off by max_tokens inside the call: the text as content and finish length, never a call with {}
    pytest.param(CALL, {"max_tokens": 14}, (CALL[:14], [], "length"), id="cut-off-call"),
    # arguments that are a JSON string (not an object), and a body that is not a call: the text as content
    pytest.param('<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>', {},
                 ('<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>', [], "stop"),
                 id="string-arguments"),
    pytest.param("<tool_call>\nnot a call\n</tool_call>", {}, ("<tool_call>\nnot a call\n</tool_call>", [], "stop"),
                 id="invalid-body"),
    # stop strings apply to the content, never inside a call
    pytest.param(CALL, {"stop": ["\n"]}, ("", [("get_weather", '{"city": "Paris"}')], "tool_calls"), id="stop-in-call"),
    pytest.param("Let me see.\n" + CALL, {"stop": ["\n"]}, ("Let me see.", [], "stop"), id="stop-in-content"),
    # parallel_tool_calls: true by default (OpenAI's), false keeps one call
    pytest.param(CALL + "\n" + ADD_CALL, {}, ("", [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')],
                                              "tool_calls"), id="parallel-by-default"),
    pytest.param(CALL + "\n" + ADD_CALL, {"parallel_tool_calls": False},
                 ("", [("get_weather", '{"city": "Paris"}')], "tool_calls"), id="parallel-false"),
])
def test_streamed_and_whole_messages_are_the_same(reply, kw, expected):
    whole, streamed = message_both_ways(reply, tools=TOOLS, **kw)
    assert whole == expected
    assert streamed == expected


# --- legacy functions, modalities -------------------------------------------------------------------


def test_legacy_functions_are_served_as_tools_and_answered_in_function_call():
    functions = [t["function"] for t in TOOLS]
    app, tc = in_process(FakeEngine(CALL, chunk=4))
    with tc:
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "functions": functions}).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
        assert choice["message"]["function_call"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        body = {"model": MODEL, "messages": HI, "functions": functions, "function_call": "auto", "stream": True}
        with tc.stream("POST", "/v1/chat/completions", json=body) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert [d["function_call"] for d in deltas if "function_call" in d] == [choice["message"]["function_call"]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "function_call"
        # the history in the legacy shape: an assistant function_call, then the function's result
        history = HI + [{"role": "assistant", "content": None, "function_call": choice["message"]["function_call"]},
                        {"role": "function", "name": "get_weather", "content": "sunny"}]
        assert tc.post("/v1/chat/completions", json={"model": MODEL, "messages": history,
                                                     "functions": functions}).status_code == 200
        for body, param in [({"functions": functions, "tools": TOOLS}, "functions"),
                            ({"function_call": "auto"}, "function_call"),  # without functions
                            ({"functions": functions, "function_call": "sometimes"}, "function_call")]:
            error = assert_openai_error(tc.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, **body}),
                                        400)
            assert error["param"] == param, (body, error)


def test_legacy_function_call_maps_onto_tool_choice():
    from app.schemas import ChatCompletionRequest, NamedToolChoice
    from app.serving import ChatServing

    functions = [t["function"] for t in TOOLS]
    for function_call, tool_choice in [(None, None), ("none", "none"), ("auto", "auto"),
                                       ({"name": "add"}, NamedToolChoice.model_validate(
                                           {"type": "function", "function": {"name": "add"}}))]:
        req = ChatCompletionRequest.model_validate({"messages": HI, "functions": functions,
                                                    "function_call": function_call})
        mapped = ChatServing._map_legacy_functions(req)
        assert [t.model_dump(exclude_none=True) for t in mapped.tools] == TOOLS
        assert mapped.tool_choice == tool_choice


@pytest.mark.parametrize("body,param", [({"modalities": ["text", "audio"]}, "modalities"),
                                        ({"modalities": ["audio"], "audio": {"voice": "alloy", "format": "wav"}},
                                         "modalities"),
                                        ({"audio": {"voice": "alloy"}}, "audio")])
def test_audio_output_is_refused(body, param):
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        error = assert_openai_error(tc.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, **body}),
                                    400, "unsupported_value")
        assert error["param"] == param
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, "modalities": ["text"]})
        assert r.status_code == 200
