"""`/v1/responses` in-process around the fake engine, through the official client: the response
object, the streaming event sequence (and that it adds up to the non-streamed response), input
items as the prompt, and the fields refused. The real model behind it, and the OpenAI Agents SDK's
default Responses path, are tested in test_frameworks.py."""
from __future__ import annotations

import json

import openai
import pytest

from test_compat import CALL, client_for
from test_gateway_units import MODEL, TOOL_REPLY, FakeEngine, ReplayGeneration, in_process
from test_hostile_input import assert_openai_error

WEATHER = [{"type": "function", "name": "get_weather", "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]

MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def items(response) -> list[tuple]:
    """The output items without their ids (which differ between two requests)."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", item.status, "".join(c.text for c in item.content)))
        else:
            out.append(("function_call", item.status, item.name, item.arguments, item.call_id.startswith("call_")))
    return out


def events_of(client, **kw) -> list:
    return list(client.responses.create(model=MODEL, stream=True, **kw))


def collapse(types: list[str]) -> list[str]:
    """Runs of text deltas as one."""
    return [t for i, t in enumerate(types) if not (t == "response.output_text.delta" and types[i - 1] == t)]


def test_plain_response_and_its_stream():
    app, tc = in_process(FakeEngine("Paris is the capital.", chunk=4))
    with tc:
        client = client_for(tc)
        r = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0)
        assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
        assert r.status == "completed" and r.error is None and r.incomplete_details is None
        assert r.output_text == "Paris is the capital." and items(r) == [("message", "completed", r.output_text)]
        assert r.output[0].id.startswith("msg_") and r.output[0].role == "assistant"
        assert r.usage.output_tokens == len(r.output_text) and r.usage.input_tokens > 0
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
        assert r.temperature == 0 and r.tool_choice == "auto" and r.parallel_tool_calls is True
        assert r.model_extra["speculation"]["method"] == "dflash"

        events = events_of(client, input="What is the capital of France?")
        assert [e.sequence_number for e in events] == list(range(len(events)))
        types = [e.type for e in events]
        assert collapse(types) == ["response.created", "response.in_progress", *MESSAGE_EVENTS, "response.completed"]
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        assert len(deltas) > 1 and "".join(e.delta for e in deltas) == r.output_text
        assert {e.item_id for e in deltas} == {events[2].item.id}
        final = events[-1].response
        assert items(final) == items(r) and final.usage.output_tokens == r.usage.output_tokens
        assert final.model_extra["speculation"]["rounds"] >= 1

        with client.responses.stream(model=MODEL, input="What is the capital of France?") as stream:
            text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            helper = stream.get_final_response()
        assert text == helper.output_text == r.output_text


@pytest.mark.parametrize("chunk", [1, 5, 40])
def test_tool_calls_streamed_add_up_to_the_response(chunk):
    app, tc = in_process(FakeEngine(TOOL_REPLY, chunk=chunk))
    with tc:
        client = client_for(tc)
        r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=WEATHER)
        assert items(r) == [("message", "completed", "Let me check."),
                            ("function_call", "completed", "get_weather", '{"city": "Paris", "unit": "celsius"}', True)]
        events = events_of(client, input="Weather in Paris?", tools=WEATHER)
        assert collapse([e.type for e in events]) == ["response.created", "response.in_progress", *MESSAGE_EVENTS,
                                                       *CALL_EVENTS, "response.completed"]
        added = [e for e in events if e.type == "response.output_item.added"]
        assert [e.output_index for e in added] == [0, 1] and added[1].item.arguments == ""
        (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert (args_done.name, args_done.arguments) == ("get_weather", r.output[1].arguments)
        assert items(events[-1].response) == items(r)
        with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=WEATHER) as stream:
            for _ in stream:
                pass
            assert items(stream.get_final_response()) == items(r)


def test_only_a_call_and_an_empty_answer():
    app, tc = in_process(FakeEngine(CALL, chunk=6))
    with tc:
        client = client_for(tc)
        r = client.responses.create(model=MODEL, input="Weather?", tools=WEATHER, parallel_tool_calls=False)
        assert [i[0] for i in items(r)] == ["function_call"] and r.parallel_tool_calls is False
        types = collapse([e.type for e in events_of(client, input="Weather?", tools=WEATHER)])
        assert types == ["response.created", "response.in_progress", *CALL_EVENTS, "response.completed"]
    app, tc = in_process(FakeEngine(""))
    with tc:
        client = client_for(tc)
        assert items(client.responses.create(model=MODEL, input="Say nothing.")) == [("message", "completed", "")]
        final = events_of(client, input="Say nothing.")[-1].response
        assert items(final) == [("message", "completed", "")]


def test_max_output_tokens_makes_an_incomplete_response():
    app, tc = in_process(FakeEngine(CALL, chunk=3))
    with tc:
        client = client_for(tc)
        r = client.responses.create(model=MODEL, input="Weather?", tools=WEATHER, max_output_tokens=14)
        # cut off inside the call: the text, never a call with {} arguments
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert items(r) == [("message", "incomplete", CALL[:14])] and r.max_output_tokens == 14
        events = events_of(client, input="Weather?", tools=WEATHER, max_output_tokens=14)
        assert events[-1].type == "response.incomplete" and items(events[-1].response) == items(r)


def test_input_items_become_the_conversation():
    engine = FakeEngine("It is sunny.")
    prompts = []
    engine.start = lambda request: prompts.append(request.prompt_ids) or ReplayGeneration(engine, request)
    app, tc = in_process(engine)
    with tc:
        client = client_for(tc)
        first = client.responses.create(model=MODEL, instructions="Be brief.", input="Weather?", tools=WEATHER)
        call = {"type": "function_call", "call_id": "call_abc123def456", "name": "get_weather",
                "arguments": '{"city": "Paris"}'}
        r = client.responses.create(model=MODEL, instructions="Be brief.", tools=WEATHER, input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": []},  # another model's: skipped
            {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
             "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
            call,
            {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
            first.output[0].model_dump(exclude_none=True),  # an output item sent back as it came
            {"role": "user", "content": [{"type": "input_text", "text": "And "}, {"type": "input_text", "text": "Rome?"}]},
        ])
        assert r.output_text == "It is sunny." and r.instructions == "Be brief."
    prompt = "".join(chr(i) for i in prompts[-1])  # the fake tokenizer: one token per character
    expected = ["<system>Be brief.\n\nYou are a function calling AI model.", "<user>Weather in Paris?\n",
                '<assistant>Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                "</tool_call>\n", "<tool><tool_response>\nsunny\n</tool_response>\n", "<assistant>It is sunny.\n",
                "<user>And Rome?\n<assistant>"]
    positions = [prompt.find(part) for part in expected]
    assert -1 not in positions and positions == sorted(positions), prompt


def test_text_format_and_tools_map_onto_the_chat_request():
    from app.responses import to_chat
    from app.responses_schemas import ResponsesRequest

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    req = ResponsesRequest.model_validate({
        "model": MODEL, "input": "hi", "tools": WEATHER, "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "final_output", "schema": schema, "strict": True}},
        "max_output_tokens": 32, "temperature": 0.5, "top_p": 0.9, "parallel_tool_calls": False,
        "include": ["message.output_text.logprobs"], "top_logprobs": 2, "store": True, "metadata": {"k": "v"}})
    chat = to_chat(req)
    assert chat.response_format.model_dump(by_alias=True, exclude_none=True) == {
        "type": "json_schema", "json_schema": {"name": "final_output", "schema": schema, "strict": True}}
    assert [t.model_dump(exclude_none=True) for t in chat.tools] == [
        {"type": "function", "function": {k: v for k, v in WEATHER[0].items() if k != "type"}}]
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls is False
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.logprobs, chat.top_logprobs) == (32, 0.5, 0.9, True, 2)
    assert to_chat(ResponsesRequest.model_validate(
        {"input": "hi", "text": {"format": {"type": "json_object"}}})).response_format.type == "json_object"


REFUSED = [
    pytest.param({"previous_response_id": "resp_1"}, "previous_response_id", id="previous-response-id"),
    pytest.param({"previous_response_id": "resp_1", "store": True}, "previous_response_id", id="store-and-previous"),
    pytest.param({"conversation": "conv_1"}, "conversation", id="conversation"),
    pytest.param({"background": True}, "background", id="background"),
    pytest.param({"prompt": {"id": "pmpt_1"}}, "prompt", id="prompt-template"),
    pytest.param({"truncation": "auto"}, "truncation", id="truncation-auto"),
    pytest.param({"reasoning": {"effort": "high"}}, "reasoning", id="reasoning"),
    pytest.param({"include": ["reasoning.encrypted_content"]}, "include[0]", id="include"),
    pytest.param({"tools": [{"type": "web_search"}]}, "tools[0].type", id="hosted-tool"),
    pytest.param({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
                 "input[0].content[0]", id="image-input"),
    pytest.param({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", id="item-reference"),
    # found by schemathesis: an unhashable type was a TypeError -> 500
    pytest.param({"input": [{"type": {}}]}, "input[0]", id="object-type"),
    pytest.param({"input": [{"type": ["message"]}]}, "input[0]", id="list-type"),
    pytest.param({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id",
                 id="call-without-id"),
    pytest.param({"temperature": "0.5"}, "temperature", id="string-temperature"),
    pytest.param({"stream": "yes"}, "stream", id="string-stream"),
    pytest.param({"max_output_tokens": 0}, "max_output_tokens", id="zero-max-output-tokens"),
    pytest.param({"tools": WEATHER, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
                 id="unknown-named-tool"),
    pytest.param({"tool_choice": "required"}, "tool_choice", id="required-without-tools"),
    pytest.param({"top_logprobs": 2}, "top_logprobs", id="top-logprobs-without-include"),
    pytest.param({"input": "x" * 5000}, "input", id="context-length"),
]


@pytest.mark.parametrize("body,param", REFUSED)
def test_unserved_fields_and_bad_input_are_400s_naming_the_field(body, param):
    app, tc = in_process(FakeEngine("ok"))
    with tc:
        r = tc.post("/v1/responses", json={"model": MODEL, "input": "hi", **body})
        error = assert_openai_error(r, 400)
        assert error["param"] == param, error


def test_unknown_model_and_retrieval_are_404s():
    app, tc = in_process(FakeEngine("ok"), model_aliases=["gpt-4o"])
    with tc:
        client = client_for(tc)
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.create(model="gpt-5", input="hi")
        assert assert_openai_error(info.value.response, 404, "model_not_found")["param"] == "model"
        assert client.responses.create(model="gpt-4o", input="hi").output_text == "ok"
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve("resp_123")
        # accepted and changing nothing: store (nothing is stored), metadata (echoed), an empty include
        r = client.responses.create(model=MODEL, input="hi", store=True, metadata={"run": "7"}, include=[],
                                    user="u1", prompt_cache_key="k")
        assert r.output_text == "ok" and r.metadata == {"run": "7"}


def test_engine_failure_mid_stream_is_a_failed_response():
    app, tc = in_process(FakeEngine("some text that fails halfway", chunk=2, fail_at_round=3))
    with tc:
        body = {"model": MODEL, "input": "hi", "stream": True}
        with tc.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith(("event: ", "data: "))]
        kinds = [line[7:] for line in lines if line.startswith("event: ")]
        assert kinds[0] == "response.created" and kinds[-1] == "response.failed"
        failed = json.loads(lines[-1][6:])["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
