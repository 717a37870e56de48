"""Agent frameworks against the live float32 server (conftest), each loop kept short: LangChain
(`bind_tools` + a tool result back, `with_structured_output`), pydantic-ai (`output_type`) and
llama-index `OpenAILike` over the legacy completions endpoint. The 135M model cannot be trusted to
choose well, so calls are forced or constrained; what is judged is the protocol: the framework gets
a parsed call, a validated object, or the text the server's own completions endpoint returns."""
from __future__ import annotations

import pytest
from pydantic import BaseModel

from test_gateway import MODEL

pytestmark = pytest.mark.timeout(600)


class Weather(BaseModel):
    city: str
    sunny: bool


def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return f"It is sunny and 22 degrees Celsius in {city}."


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
