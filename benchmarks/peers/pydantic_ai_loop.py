"""pydantic-ai through the same workloads (runs in benchmarks/.peers/pydantic-ai)."""

from __future__ import annotations

from typing import Any

from pydantic_ai import Agent  # type: ignore[import-not-found]
from pydantic_ai.providers.openai import OpenAIProvider  # type: ignore[import-not-found]

from benchmarks.peers.passes import fanout_passes, serial_passes
from benchmarks.worker import Meter
from benchmarks.workload import API_KEY, MODEL, SYSTEM_PROMPT, USER_PROMPT

try:
    from pydantic_ai.models.openai import OpenAIChatModel as _Model
except ImportError:  # older releases
    from pydantic_ai.models.openai import OpenAIModel as _Model


def _agent(job: dict[str, Any]) -> Any:
    model = _Model(MODEL, provider=OpenAIProvider(base_url=job["url"], api_key=API_KEY))
    agent = Agent(model, system_prompt=SYSTEM_PROMPT)

    @agent.tool_plain
    def noop(round: int) -> dict[str, Any]:
        """Do nothing and report the round."""
        return {"round": round}

    return agent


async def _one(agent: Any) -> bool:
    result = await agent.run(USER_PROMPT)
    return bool(result.output)


def serial(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` passes one at a time."""
    return serial_passes(job, meter, _agent, _one)


def fanout(job: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """`n` concurrent passes."""
    return fanout_passes(job, meter, _agent, _one)
