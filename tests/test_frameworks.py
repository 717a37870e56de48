"""Agent frameworks against the live float32 server (conftest), each loop kept short: the OpenAI
Agents SDK on its default Responses path (a tool loop, and `output_type` with tools), the official
client's `responses.create` (plain and streaming), LangChain (`bind_tools` + a tool result back,
`with_structured_output`), pydantic-ai (`output_type`) and llama-index `OpenAILike` over the legacy
completions endpoint. The 135M model cannot be trusted to choose well, so calls are forced or
constrained; what is judged is the protocol: the framework gets a parsed call, a validated object,
or the text the server's own completions endpoint returns."""
from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

from test_gateway import MODEL, TOOLS, WEATHER_Q, check_args

pytestmark = pytest.mark.timeout(600)


class Weather(BaseModel):
    city: str
    sunny: bool


def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return f"It is sunny and 22 degrees Celsius in {city}."


# --- the OpenAI Agents SDK's default path: OpenAIResponsesModel over /v1/responses -------------------


def run_agent(live_server, output_type=None, stream=False):
    """One Runner run with the SDK's default model class (only the client's base URL configured):
    the first turn must call get_weather (tool_choice required); the tool is offered once per run, so
    the next turn answers (a 135M model given a tool result otherwise calls the same tool again)."""
    agents = pytest.importorskip("agents")
    from agents.models.openai_provider import OpenAIProvider
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool(is_enabled=lambda ctx, agent: not calls)
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        calls.append(city)
        return f"It is sunny and 22 degrees Celsius in {city}."

    async def main():
        client = live_server.async_client()
        provider = OpenAIProvider(openai_client=client)
        assert isinstance(provider.get_model(MODEL), OpenAIResponsesModel)  # the default: no chat-completions override
        agent = agents.Agent(name="weather", instructions="You are a helpful assistant. Use the tools to answer.",
                             tools=[get_weather], model=MODEL, output_type=output_type,
                             model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64))
        config = agents.RunConfig(model_provider=provider)
        async with client:
            if not stream:
                return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3, run_config=config)
            result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3, run_config=config)
            kinds = {event.type async for event in result.stream_events()}
            assert "raw_response_event" in kinds  # the Responses stream events, as the SDK parsed them
            return result

    result = asyncio.run(main())
    assert calls == ["Paris"]
    assert [type(item).__name__ for item in result.new_items] == ["ToolCallItem", "ToolCallOutputItem",
                                                                 "MessageOutputItem"]
    call = result.new_items[0].raw_item
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    return result.final_output


def test_agents_sdk_default_responses_path_tool_loop(live_server):
    answer = run_agent(live_server)
    assert isinstance(answer, str) and answer.strip()
    assert run_agent(live_server, stream=True) == answer  # float32: the same answer streamed


def test_agents_sdk_output_type_with_tools(live_server):
    """The first request carries the tools and text.format json_schema together; the run ends with the
    structured object, validated by the SDK."""
    weather = run_agent(live_server, output_type=Weather)
    assert isinstance(weather, Weather)
    assert run_agent(live_server, output_type=Weather, stream=True) == weather


# --- the official client's Responses API ----------------------------------------------------------


def items(response) -> list[tuple]:
    return [(o.type, o.status, o.content[0].text) if o.type == "message" else (o.type, o.status, o.name, o.arguments)
            for o in response.output]


def test_openai_client_responses_plain_and_streaming(live_server):
    client = live_server.client()
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=16,
                                temperature=0)
    assert r.status == "completed" and r.output_text == "The capital of France is Paris."
    with client.responses.stream(model=MODEL, input="What is the capital of France?", max_output_tokens=16,
                                 temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == r.output_text and items(final) == items(r)
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=8,
                                temperature=0, include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == r.output_text

    flat = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat tools
    kw = dict(model=MODEL, input=WEATHER_Q[0]["content"], tools=flat, tool_choice="required", max_output_tokens=48,
              temperature=0)
    r = client.responses.create(**kw)
    ((kind, status, name, arguments),) = items(r)
    assert (kind, status, name) == ("function_call", "completed", "get_weather")
    check_args(name, arguments)
    with client.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert items(final) == items(r) and deltas == arguments
    # cut off by max_output_tokens: an incomplete response with the text, never a call
    r = client.responses.create(**{**kw, "max_output_tokens": 14})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [i[0] for i in items(r)] == ["message"] and r.output_text.startswith("<tool_call>")
    streamed = list(client.responses.create(**{**kw, "max_output_tokens": 14}, stream=True))
    assert streamed[-1].type == "response.incomplete" and items(streamed[-1].response) == items(r)


# --- LangChain, pydantic-ai, llama-index -----------------------------------------------------------------


def test_langchain_tool_loop_and_structured_output(live_server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = langchain_openai.ChatOpenAI(base_url=live_server.base_url, api_key="none", model=MODEL, temperature=0,
                                      max_tokens=48, max_retries=0)
    question = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(question)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    result = ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])
    answer = llm.invoke(question + [ai, result])  # the tool result back, the answer as text
    assert isinstance(answer.content, str) and answer.content.strip() and not answer.tool_calls

    weather = llm.with_structured_output(Weather, method="json_schema").invoke("Is it sunny in Paris?")
    assert isinstance(weather, Weather)


def test_pydantic_ai_output_type(live_server):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=live_server.base_url, api_key="none"))
    agent = Agent(model, output_type=Weather, model_settings={"temperature": 0, "max_tokens": 64})
    result = agent.run_sync("Is it sunny in Paris?")
    assert isinstance(result.output, Weather)


def test_llama_index_openai_like_over_completions(live_server):
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=MODEL, api_base=live_server.base_url, api_key="none", is_chat_model=False,
                     max_tokens=12, temperature=0, max_retries=0)
    prompt = "The capital of France is"
    text = llm.complete(prompt).text
    direct = live_server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert text == direct.choices[0].text and text.strip()
    assert "".join(r.delta for r in llm.stream_complete(prompt)) == text
