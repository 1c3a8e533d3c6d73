"""Agent frameworks against `llamax serve`: LangChain's ChatOpenAI over loopback, the way an app uses it.

Tool calling (bind_tools -> AIMessage.tool_calls -> the tool run -> ToolMessage back -> a second
invoke), streamed tool calls (the AIMessageChunks added up), and structured output
(with_structured_output, by json_schema and by function calling) returning validated pydantic
objects. SmolLM2-135M is tiny: these hold the mechanics (shapes that parse and validate), greedy and
seeded, not the wisdom of the answers."""
from typing import Literal

import langchain_openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city."""
    return f"18 degrees {unit}, sunny, in {city}"


class City(BaseModel):
    """A city and its country."""
    name: str = Field(min_length=1, max_length=16)
    country: str = Field(min_length=1, max_length=16)
    population_millions: int = Field(ge=0, le=50)


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


@pytest.fixture(scope="module")
def llm(server):
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="none", model="smollm2-135m",
                                       temperature=0, seed=1, max_tokens=64, max_retries=0, timeout=120)


def check_call(call):
    assert call["type"] == "tool_call" and call["name"] == "get_weather" and call["id"].startswith("call_")
    assert set(call["args"]) == {"city", "unit"} and call["args"]["unit"] in ("celsius", "fahrenheit")
    assert isinstance(call["args"]["city"], str) and call["args"]["city"]


def test_bind_tools_round_trip(llm):
    agent = llm.bind_tools([get_weather])
    msgs = [HumanMessage("What is the weather in Paris?")]
    ai = agent.invoke(msgs)
    assert isinstance(ai, AIMessage) and ai.response_metadata["finish_reason"] == "tool_calls"
    assert len(ai.tool_calls) == 1 and not ai.invalid_tool_calls
    check_call(ai.tool_calls[0])
    result = get_weather.invoke(ai.tool_calls[0])  # a tool call in: a ToolMessage out
    assert isinstance(result, ToolMessage) and result.tool_call_id == ai.tool_calls[0]["id"]
    msgs += [ai, result]
    again = agent.invoke(msgs)  # the call and its result go back: the server renders them
    assert isinstance(again, AIMessage) and not again.invalid_tool_calls
    assert again.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    for call in again.tool_calls:
        check_call(call)
    if not again.tool_calls:
        assert isinstance(again.content, str)
    answer = llm.invoke(msgs)  # the model without tools answers from the same history
    assert isinstance(answer.content, str) and answer.content and not answer.tool_calls
    assert answer.usage_metadata["input_tokens"] > 40


def test_streamed_tool_calls_add_up(llm):
    agent = llm.bind_tools([get_weather], tool_choice="get_weather")
    msgs = [HumanMessage("Is it cold in Oslo?")]
    whole = agent.invoke(msgs)
    acc = None
    for chunk in agent.stream(msgs):
        acc = chunk if acc is None else acc + chunk
    assert acc is not None and not acc.invalid_tool_calls
    assert [(c["name"], c["args"]) for c in acc.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]
    check_call(acc.tool_calls[0])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(llm, method):
    structured = llm.with_structured_output(City, method=method, include_raw=True)
    for prompt in ("Tell me about Paris.", "Describe Tokyo."):
        out = structured.invoke(prompt)
        assert out["parsing_error"] is None, out["raw"]
        city = out["parsed"]
        assert isinstance(city, City)
        City.model_validate(city.model_dump())
        want = "tool_calls" if method == "function_calling" else "stop"
        assert out["raw"].response_metadata["finish_reason"] == want
