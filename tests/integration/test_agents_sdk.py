"""The OpenAI Agents SDK (``openai-agents``) as the client, on both of its model classes
(the Responses API and Chat Completions), through the real pipeline (the session cluster:
redis-server, ``conveyor worker`` processes, the API over HTTP): an agent with a strict
function tool and a structured output type runs its loop: the tool is called with
arguments its schema allows, the tool's output goes back to the model, and the run ends
with the model's answer parsed into the output type; the same streamed (the SDK's
run_streamed events). The model has random weights, so its first call is forced
(``tool_choice: required``, one call: ``parallel_tool_calls`` false; the SDK resets the
choice after a tool ran; the forced call overrides the output type's format, as vLLM
lets it), and its answer ends because the output type's schema is bounded (the SDK fails
a run whose answer hit its token limit)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI
from pydantic import BaseModel

from tests.integration.conftest import Cluster

pytestmark = pytest.mark.integration

set_tracing_disabled(True)  # no export to OpenAI's servers


class Light(BaseModel):
    on: bool


def _agent(cluster: Cluster, kind: str, calls: list[bool]) -> Agent:
    @function_tool
    def set_light(on: bool) -> str:
        """Switch the light on or off."""
        calls.append(on)
        return f"the light is {'on' if on else 'off'}"

    client = AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)
    model: Any = (OpenAIResponsesModel if kind == "responses" else OpenAIChatCompletionsModel)(
        model=cluster.model_name, openai_client=client
    )
    return Agent(name="lights", instructions="Use the tool.", tools=[set_light], model=model,
                 output_type=Light,
                 model_settings=ModelSettings(tool_choice="required", max_tokens=200,
                                              temperature=0,
                                              parallel_tool_calls=False))  # fmt: skip


@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_an_agent_calls_its_tool_and_answers(cluster: Cluster, kind: str) -> None:
    calls: list[bool] = []
    result = Runner.run_sync(_agent(cluster, kind, calls), "Light on, please.", max_turns=3)
    items = result.new_items
    assert [type(i) for i in items[:2]] == [ToolCallItem, ToolCallOutputItem], items
    assert len(calls) == 1 and isinstance(calls[0], bool)  # the strict schema held
    assert items[1].output == f"the light is {'on' if calls[0] else 'off'}"
    assert isinstance(items[-1], MessageOutputItem)  # the model answered after the tool
    assert isinstance(result.final_output, Light)  # the answer, in the output type
    assert len(result.raw_responses) == 2  # two model calls: forced, then free


@pytest.mark.parametrize("kind", ["responses", "chat"])
def test_a_streamed_run_gives_the_same_items(cluster: Cluster, kind: str) -> None:
    calls: list[bool] = []
    agent = _agent(cluster, kind, calls)

    async def run() -> tuple[Any, list[str]]:
        res = Runner.run_streamed(agent, "Light off, please.", max_turns=3)
        names: list[str] = [ev.name async for ev in res.stream_events()
                            if ev.type == "run_item_stream_event"]  # fmt: skip
        return res, names

    res, names = asyncio.run(run())
    assert names[:2] == ["tool_called", "tool_output"], names
    assert names[-1] == "message_output_created", names
    assert len(calls) == 1 and isinstance(res.final_output, Light)
