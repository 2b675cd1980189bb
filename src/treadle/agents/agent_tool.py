"""`AgentTool`: an agent offered as a tool with structured input (`Agent.as_tool(input_type=...)`).

The model fills the input model's schema; the call runs the agent on a fresh session whose one
user row is that input as JSON, and returns the agent's answer (or what `output_extractor`
takes from its output session). Inside an agent run, the agent inherits that run's
`RunSettings`, and its `deps` when it declares a `deps_type`. Calls run on the caller's loop
and never block it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pydantic

from treadle.agents.agent_run import inherited
from treadle.errors import ConfigurationError, ToolArgumentsError
from treadle.loop.control import call_user
from treadle.session import Session
from treadle.tools import FunctionTool, Tool, ToolContext

if TYPE_CHECKING:
    from treadle.agents.agent import Agent

__all__ = ["AgentTool", "DelegateTool", "agent_tool", "tool_answer"]

_TOOL_NAME = re.compile(r"[^A-Za-z0-9_-]")


async def tool_answer(out: Session, extractor: Callable[[Session], Any] | None) -> Any:
    """What an agent tool returns for the agent's output session `out`."""
    if extractor is not None:
        return await call_user(extractor, out)
    if out.output is not None:
        return out.output
    return {"answer": out.final_text, "stop_reason": out.stop_reason}


class AgentTool(Tool):
    """An agent as a tool whose arguments are a pydantic model."""

    def __init__(
        self,
        agent: Agent,
        name: str,
        description: str,
        input_type: type[pydantic.BaseModel],
        extractor: Callable[[Session], Any] | None,
    ) -> None:
        if not (isinstance(input_type, type) and issubclass(input_type, pydantic.BaseModel)):
            raise ConfigurationError("as_tool input_type must be a pydantic BaseModel subclass.")
        self.name = name
        self.description = description
        schema = input_type.model_json_schema()
        schema.pop("title", None)
        self.parameters = schema
        self.agent = agent
        self.input_type = input_type
        self.extractor = extractor

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Validate against the input model; `ToolArgumentsError` lists the bad fields."""
        try:
            return self.input_type.model_validate(dict(arguments)).model_dump(mode="json")
        except pydantic.ValidationError as err:
            raise ToolArgumentsError(
                f"the input for {self.agent.name} does not match its schema: {err}",
                detail="fix these fields and call the tool again",
            ) from None

    async def invoke(self, arguments: Mapping[str, Any], *, context: ToolContext) -> Any:
        """Run the agent on the input (as JSON in one user row)."""
        task = self.input_type.model_validate(dict(arguments)).model_dump_json()
        out = await self.agent.run(Session.from_user_message(task), **inherited(self.agent))
        return await tool_answer(out, self.extractor)


class DelegateTool(FunctionTool[..., Any]):
    """An agent as a tool taking `task: str` (`Agent.as_tool()` without `input_type`). It keeps
    its agent and extractor, as `AgentTool` does, so that what cannot cross to a worker is
    named by the user's own parts rather than this module's function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        agent: Agent,
        extractor: Callable[[Session], Any] | None,
        *,
        name: str,
        description: str,
    ) -> None:
        super().__init__(fn, name=name, description=description)
        self.agent = agent
        self.extractor = extractor


def agent_tool(
    agent: Agent,
    name: str | None,
    description: str | None,
    input_type: type[pydantic.BaseModel] | None,
    output_extractor: Callable[[Session], Any] | None,
) -> Tool:
    """`agent.as_tool(...)`: an `AgentTool` with `input_type`, else a tool taking `task: str`."""
    if output_extractor is not None and not callable(output_extractor):
        raise ConfigurationError("output_extractor must be callable (session -> value).")
    tool_name = name or _TOOL_NAME.sub("_", agent.name)[:64]
    text = description or agent.description or f"Ask the {agent.name} agent to do a task."
    if input_type is not None:
        return AgentTool(agent, tool_name, text, input_type, output_extractor)

    async def delegate(task: str) -> Any:
        """Args:
        task: The whole task, self-contained (the agent does not see this conversation).
        """
        out = await agent.run(Session.from_user_message(task), **inherited(agent))
        return await tool_answer(out, output_extractor)

    return DelegateTool(delegate, agent, output_extractor, name=tool_name, description=text)
