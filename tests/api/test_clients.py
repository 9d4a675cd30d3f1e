"""Other people's clients against the API (`python -m app.api`): the `ollama` package, the OpenAI Agents SDK,
langchain-openai on the Responses API and langchain-ollama, each as its own documentation uses it.

Two models are served: "tiny", a random Llama 3 checkpoint (greedy, its text is garbage but always the same, so
a streamed reply must join to the reply asked whole; a call that tool_choice asks for is constrained to the
tool's schema), and "caller", a scripted one that answers every prompt with the Llama 3.2 call
`[get_weather(city="Paris")]`, for clients that have no tool_choice, and "city", another that answers
`{"city": "Paris"}`, for Ollama's format "json" (a random model's JSON strings may never end).
"""

from __future__ import annotations

import json
import operator
from functools import reduce
from typing import Literal

import ollama
import openai
import pytest
from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from langchain_core.tools import tool
from langchain_ollama import ChatOllama
from langchain_openai import ChatOpenAI
from support.checkpoints import write_tiny_checkpoint
from support.servers import ApiServer, server_env
from support.special_checkpoints import write_scripted_checkpoint

pytestmark = pytest.mark.timeout(300)

KEY = "clients-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTION = "What is the weather in Paris?"
CALL = '[get_weather(city="Paris")]'
CITY = '{"city": "Paris"}'
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "description": "The city"}},
                                                 "required": ["city"]}}}]

# A JSON format (Ollama's "format": "json" or a schema) a random model completes within a few tokens.
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
         "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights")
    tiny = write_tiny_checkpoint(weights / "tiny")
    write_scripted_checkpoint(weights / "caller", CALL)
    write_scripted_checkpoint(weights / "city", CITY)
    server = ApiServer(server_env(checkpoint=tiny, weights_dir=weights, dtype="fp32", threads=1, api_key=KEY),
                       log=weights.parent / "api.log")
    yield from server.running()


# ---- the ollama package -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ollama_client(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers=AUTH, timeout=120)


def test_ollama_chat_streamed_joins_to_the_whole_reply(ollama_client):
    options = {"temperature": 0, "num_predict": 12}
    messages = [{"role": "user", "content": QUESTION}]
    whole = ollama_client.chat(model="tiny", messages=messages, options=options)
    parts = list(ollama_client.chat(model="tiny", messages=messages, options=options, stream=True))
    assert whole.message.role == "assistant" and whole.message.content and whole.done
    assert "".join(part.message.content for part in parts) == whole.message.content
    assert parts[-1].done and parts[-1].eval_count == whole.eval_count


def test_ollama_generate_and_json_formats(ollama_client):
    whole = ollama_client.generate(model="tiny", prompt=QUESTION, options={"temperature": 0, "num_predict": 12})
    streamed = ollama_client.generate(model="tiny", prompt=QUESTION, options={"temperature": 0, "num_predict": 12},
                                      stream=True)
    assert whole.response and "".join(part.response for part in streamed) == whole.response
    answer = ollama_client.chat(model="tiny", messages=[{"role": "user", "content": "A color, in JSON"}],
                                format=COLOR, options={"temperature": 0, "num_predict": 64})
    assert json.loads(answer.message.content)["color"] in ("red", "green", "blue")  # a random model, constrained
    answer = ollama_client.chat(model="city", messages=[{"role": "user", "content": "A city, in JSON"}], format="json")
    assert json.loads(answer.message.content) == {"city": "Paris"}


def test_ollama_tool_call_names_the_tool_with_its_arguments(ollama_client):
    for stream in (False, True):
        reply = ollama_client.chat(model="caller", messages=[{"role": "user", "content": QUESTION}], tools=WEATHER,
                                   stream=stream)
        calls = [c for part in reply for c in part.message.tool_calls or []] if stream else reply.message.tool_calls
        assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_ollama_models_list_show_ps_version(ollama_client):
    assert {m.model.split(":")[0] for m in ollama_client.list().models} == {"tiny", "caller", "city"}
    shown = ollama_client.show("tiny")
    assert "tools" in shown.capabilities and shown.details.family
    ollama_client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 1})
    assert "tiny" in {m.model.split(":")[0] for m in ollama_client.ps().models}
    version = ollama_client._client.get("/api/version").json()["version"]  # (the package has no version())
    assert version and version[0].isdigit()


# ---- the OpenAI Agents SDK ----------------------------------------------------------------------------

@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


@pytest.mark.parametrize("model_class", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
def test_agents_sdk_runs_the_function_tool_the_model_calls(server, model_class):
    set_tracing_disabled(True)  # (traces go to OpenAI's servers)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                  model=model_class(model="caller", openai_client=client), tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, QUESTION, max_turns=2)
    assert result.final_output == "Sunny in Paris"  # the tool ran with the arguments the model wrote


# ---- langchain-openai on the Responses API --------------------------------------------------------------

@tool
def forecast(city: Literal["Paris", "Oslo"], days: Literal[1, 2, 3]) -> str:
    """The forecast for a city."""
    return f"{city}: sunny for {days} days"


@pytest.fixture(scope="module")
def responses_chat(server) -> ChatOpenAI:
    return ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key=KEY, use_responses_api=True,
                      temperature=0, max_tokens=12)


def test_langchain_openai_responses_invoke_and_stream(responses_chat):
    whole = responses_chat.invoke(QUESTION)
    assert whole.text and whole.response_metadata["model_name"] == "tiny"
    assert "".join(chunk.text for chunk in responses_chat.stream(QUESTION)) == whole.text


def test_langchain_openai_bind_tools_with_tool_choice(server):
    chat = ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key=KEY, use_responses_api=True, temperature=0,
                      max_tokens=64)  # room for the whole call
    with_tools = chat.bind_tools([forecast], tool_choice="forecast", parallel_tool_calls=False)
    for message in (with_tools.invoke(QUESTION), reduce(operator.add, with_tools.stream(QUESTION))):
        [call] = message.tool_calls
        assert call["name"] == "forecast" and call["args"]["city"] in ("Paris", "Oslo")
        assert forecast.invoke(call["args"]).startswith(call["args"]["city"])  # the arguments fit the tool


# ---- langchain-ollama ---------------------------------------------------------------------------------

@tool("get_weather")
def weather_tool(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


def test_langchain_ollama_invoke_stream_and_bind_tools(server):
    chat = ChatOllama(model="tiny", base_url=server.url, client_kwargs={"headers": AUTH}, temperature=0,
                      num_predict=12)
    whole = chat.invoke(QUESTION)
    assert whole.content and "".join(chunk.content for chunk in chat.stream(QUESTION)) == whole.content
    caller = ChatOllama(model="caller", base_url=server.url, client_kwargs={"headers": AUTH})
    [call] = caller.bind_tools([weather_tool]).invoke(QUESTION).tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})  # what the model wrote, as it wrote it
