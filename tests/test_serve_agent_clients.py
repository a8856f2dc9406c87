"""The structured-output and agent clients against the real engine behind `onegpu serve`, live on
loopback: instructor (JSON_SCHEMA and TOOLS modes, a pydantic model with an Enum, a nested model
and a list), the OpenAI Agents SDK (a function tool with an Enum parameter, tool_choice
"required", run to completion, streamed and not) and pydantic-ai (a typed output and a tool).
The random tiny model writes nonsense: each test asserts the protocol (objects that validate,
arguments that parse, loops that finish), never the content. One server for the module, with
--tool_parser hermes: after a forced call the agents ask with tool_choice "auto", which needs a
format."""

from __future__ import annotations

import asyncio
import enum
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from helpers import make_tiny_llama
from serve_support import Server
from test_serve import KEY

pytest.importorskip("llguidance")


class Unit(str, enum.Enum):
    C = "celsius"
    F = "fahrenheit"


class Place(BaseModel):
    city: str = Field(max_length=6)


class Report(BaseModel):
    """An Enum, a nested model and a list: pydantic writes the first two under $defs."""

    unit: Unit
    place: Place
    days: list[Annotated[int, Field(ge=0, le=9)]] = Field(max_length=2)
    windy: bool


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory, tiny_tokenizer):
    """The tiny Llama with a context of 1024: an agent's turns (a call, its result, the answer)
    in the tiny tokenizer's many tokens do not fit in 256."""
    path = tmp_path_factory.mktemp("tiny-llama-1k")
    make_tiny_llama(tiny_tokenizer, max_position_embeddings=1024).save_pretrained(str(path))
    tiny_tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def server(long_model_dir, tmp_path_factory):
    args = ["--model", str(long_model_dir), "--api_key", KEY, "--max_len", "1024"]
    args += ["--max_slots", "4", "--queue_size", "8", "--sync_every", "4"]
    args += ["--tool_parser", "hermes"]
    srv = Server(args, tmp_path_factory.mktemp("serve-log") / "server.log")
    yield srv
    srv.stop()


def _openai(server, asynchronous: bool = False):
    from openai import AsyncOpenAI, OpenAI

    cls = AsyncOpenAI if asynchronous else OpenAI
    return cls(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_gets_its_response_model(server, long_model_dir, mode):
    """JSON_SCHEMA sends pydantic's schema as response_format (no additionalProperties: before,
    IncompleteOutputException); TOOLS forces a named call whose schema has $defs (before, 400
    invalid_grammar "Pointer '/$defs/...' does not exist")."""
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(_openai(server), mode=getattr(instructor.Mode, mode))
    for seed in (0, 1):
        report = client.chat.completions.create(
            model=str(long_model_dir),
            messages=[{"role": "user", "content": "the weather report"}],
            response_model=Report,
            max_retries=1,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        assert isinstance(report, Report) and isinstance(report.unit, Unit)


def _agent(server, long_model_dir, called: list):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool

    @function_tool
    def convert(unit: Unit) -> str:
        """Convert the reading to a unit."""
        called.append(unit)
        return "done"

    model = OpenAIChatCompletionsModel(str(long_model_dir), _openai(server, asynchronous=True))
    settings = ModelSettings(tool_choice="required", max_tokens=150, temperature=0.0)
    return Agent(name="weather", instructions="Use the tool.", tools=[convert], model=model,
                 model_settings=settings)  # fmt: skip


@pytest.mark.parametrize("streamed", [False, True])
def test_an_openai_agent_calls_its_enum_tool_and_finishes(server, long_model_dir, streamed):
    pytest.importorskip("agents")
    from agents import Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no export of traces to OpenAI
    called: list = []
    agent = _agent(server, long_model_dir, called)

    async def run():
        if not streamed:
            return await Runner.run(agent, "convert it", max_turns=4)
        result = Runner.run_streamed(agent, "convert it", max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        assert "run_item_stream_event" in kinds
        return result

    result = asyncio.run(run())
    assert called and all(isinstance(u, Unit) for u in called)  # the arguments parsed as Unit
    assert isinstance(result.final_output, str)  # the loop ended with the model's answer


def test_pydantic_ai_typed_output_and_a_tool(server, long_model_dir):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(openai_client=_openai(server, asynchronous=True))
    model = OpenAIChatModel(str(long_model_dir), provider=provider)
    looked: list = []

    async def once(_ctx, tool):  # offered until called: then the output tool alone is left
        return None if looked else tool

    # seed 1: this model's first forced call is to the tool (seed 0: to the output at once)
    for seed, calls in ((0, 0), (1, 1)):
        settings = {"max_tokens": 200, "temperature": 1.0, "seed": seed}
        agent = Agent(model, output_type=Report, model_settings=settings)
        agent.tool_plain(prepare=once)(lookup_in(looked))
        looked.clear()
        result = agent.run_sync("the weather report")
        assert isinstance(result.output, Report) and isinstance(result.output.unit, Unit)
        assert len(looked) == calls and all(isinstance(u, Unit) for u in looked)


def lookup_in(looked: list):
    def lookup(unit: Unit) -> str:
        """Look the reading up in a unit."""
        looked.append(unit)
        return "12"

    return lookup
