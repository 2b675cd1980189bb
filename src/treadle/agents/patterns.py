"""Workflow patterns built from agents: pipelines, brainstorms and handoffs.

- `pipeline(a, b, c)`: the output session of each agent is the input of the next.
- `brainstorm(a, b, rounds=2)`: agents take turns appending to one shared session.
- `triage(router, {"billing": billing, ...})`: a router agent's structured choice picks the
  specialist that answers, on a fresh copy of the input (formerly `handoff(...)`; handoffs that
  continue the same transcript are `Agent(handoffs=[...])`, see `treadle.agents.handoffs`).
- Manager/worker needs no helper: give the manager `worker.as_tool()` tools; calls in one reply
  run concurrently.

Every pattern is itself callable like an agent: `flow(session)` returns a lazy `Session` at once
and `await flow.run(session)` runs on the calling loop, so patterns nest and `map` takes them.
This module must never block the caller: all waiting happens inside the runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pydantic

from treadle.agents.agent import Agent, AgentInput, as_session
from treadle.agents.agent_run import lazy_session
from treadle.errors import ConfigurationError
from treadle.session import Session

__all__ = ["Pipeline", "Triage", "brainstorm", "pipeline", "triage"]


class Pipeline:
    """Agents run one after another, each on the previous one's output session."""

    def __init__(self, agents: Sequence[Agent], *, operator: str = "pipeline") -> None:
        if not agents:
            raise ConfigurationError("a pipeline needs at least one agent.")
        for agent in agents:
            if not isinstance(agent, Agent):
                raise ConfigurationError(
                    f"pipeline steps must be Agents, got {type(agent).__name__}."
                )
        self.agents = tuple(agents)
        self.operator = operator

    def __call__(self, session: AgentInput) -> Session:
        """Chain the agents' lazy outputs and return the last one at once."""
        out = as_session(session)
        for agent in self.agents:
            out = agent(out)
        return out

    async def run(self, session: AgentInput) -> Session:
        """Run the steps on the calling loop; return the last output."""
        out = as_session(session)
        for agent in self.agents:
            out = await agent.run(out)
        return out


def pipeline(*agents: Agent) -> Pipeline:
    """`pipeline(a, b, c)(session)`: `c(b(a(session)))`, returned lazily at once."""
    return Pipeline(agents)


def brainstorm(*agents: Agent, rounds: int = 1) -> Pipeline:
    """Agents take turns on one shared session, `rounds` times around.

    Each agent sees the whole conversation so far (the others' replies included) under its own
    instructions, and appends its reply.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigurationError(f"rounds must be an int >= 1, got {rounds!r}.")
    return Pipeline([*agents] * rounds, operator="brainstorm")


def _default_route(specialists: Mapping[str, Agent]) -> Callable[[Any], str]:
    def route(output: Any) -> str:
        values = output.model_dump() if isinstance(output, pydantic.BaseModel) else {}
        for value in values.values():
            if isinstance(value, str) and value in specialists:
                return value
        raise ConfigurationError(
            f"the triage output {output!r} names none of the specialists "
            f"{sorted(specialists)}; give its choice field a Literal of those names."
        )

    return route


class Triage:
    """A router agent chooses; the chosen specialist answers on a fresh copy of the input.

    The specialist does not see the router's rows. For a transfer that keeps the transcript, give
    the agent `handoffs=[...]` instead.
    """

    def __init__(
        self,
        triage: Agent,
        specialists: Mapping[str, Agent],
        *,
        route: Callable[[Any], str] | None = None,
    ) -> None:
        if not isinstance(triage, Agent) or triage.output_type is None:
            raise ConfigurationError(
                "handoff needs a triage Agent with an output_type (a model with a Literal "
                "field naming the specialists)."
            )
        if not specialists or not all(isinstance(a, Agent) for a in specialists.values()):
            raise ConfigurationError("handoff needs a mapping of names to specialist Agents.")
        self.triage = triage
        self.specialists = dict(specialists)
        self.route = route or _default_route(self.specialists)

    def __call__(self, session: AgentInput) -> Session:
        """Triage, then the specialist's output, returned lazily at once."""
        user = as_session(session)
        return lazy_session(lambda: self.run(user), parents=[user], operator="handoff")

    async def run(self, session: AgentInput) -> Session:
        """Triage and hand off on the calling loop.

        The specialist's output records the decision in `metadata["handoff"]`:
        `{"from", "to", "decision"}`; usage includes the triage's tokens.
        """
        user = as_session(session)
        decision = await self.triage.run(user)
        choice = self.route(decision.output)
        specialist = self.specialists.get(choice)
        if specialist is None:
            raise ConfigurationError(
                f"route chose {choice!r}, which is not one of {sorted(self.specialists)}."
            )
        out = await specialist.run(user.fork())
        data = out.data
        output = decision.output
        record = {
            "from": self.triage.name,
            "to": choice,
            "decision": output.model_dump() if isinstance(output, pydantic.BaseModel) else output,
        }
        triage_cost = decision.data.usage
        input_usage = (await user.wait_ready()).usage
        extra = _minus(triage_cost, input_usage)
        return out.with_data(
            usage=data.usage + extra, metadata={**data.metadata, "handoff": record}
        )


def _minus(a: Any, b: Any) -> Any:
    from treadle.session import Usage

    return Usage(
        a.prompt_tokens - b.prompt_tokens,
        a.completion_tokens - b.completion_tokens,
        a.total_tokens - b.total_tokens,
        a.requests - b.requests,
    )


def triage(
    triage: Agent,
    specialists: Mapping[str, Agent],
    *,
    route: Callable[[Any], str] | None = None,
) -> Triage:
    """A router agent (with an `output_type`) picks which specialist answers.

    `route(output) -> name` picks the specialist; by default the first string field of the
    triage output that names one. The specialist runs on a fresh copy of the input session (it
    does not see the triage's rows).
    """
    return Triage(triage, specialists, route=route)
