"""The OpenAI Agents SDK through the same workloads (runs in benchmarks/.peers/openai-agents)."""

from __future__ import annotations

from typing import Any

from agents import (  # type: ignore[import-not-found]
    Agent,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from benchmarks.peers.passes import fanout_passes, serial_passes
from benchmarks.worker import Meter
from benchmarks.workload import API_KEY, MAX_ROUNDS, MODEL, SYSTEM_PROMPT, USER_PROMPT

set_tracing_disabled(True)


@function_tool
def noop(round: int) -> dict[str, Any]:
    """Do nothing and report the round."""
    return {"round": round}


def _agent(job: dict[str, Any]) -> Agent:
    client = AsyncOpenAI(base_url=job["url"], api_key=API_KEY)
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    return Agent(name="bench", instructions=SYSTEM_PROMPT, tools=[noop], model=model)


async def _one(agent: Agent) -> bool:
    result = await Runner.run(agent, USER_PROMPT, max_turns=MAX_ROUNDS)
    return bool(result.final_output)


def serial(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` passes one at a time."""
    return serial_passes(job, meter, _agent, _one)


def fanout(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` concurrent passes."""
    return fanout_passes(job, meter, _agent, _one)
