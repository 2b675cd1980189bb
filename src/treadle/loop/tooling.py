"""How a pass treats its tools between rounds: which are offered (`is_enabled`), whether a tool
round ends the pass (`tool_use_behavior`), and the forced `tool_choice` reset.

Each helper costs nothing when its option is unused: `offered` returns the pass's tool set as is
when no tool is gated, and the others are a comparison or two per round.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import anyio

from treadle.errors import ConfigurationError, ToolEnabledError
from treadle.llm.provider import Provider
from treadle.loop.control import call_user
from treadle.session import ChunkRow, ToolCall
from treadle.session.stops import StopReason
from treadle.tools import Tool, ToolContext, ToolSet

__all__ = [
    "StopAtTools",
    "ToolUseBehavior",
    "check_stop_names",
    "check_tool_use_behavior",
    "choice_extra",
    "forced_tool_choice",
    "gated_tools",
    "offered",
    "stop_after_tools",
]


@dataclass(frozen=True, slots=True)
class StopAtTools:
    """`tool_use_behavior=StopAtTools("a", "b")`: a round calling one of these tools ends the pass;
    the first such call's result (in call order) is the pass's output."""

    names: tuple[str, ...]

    def __init__(self, *names: str) -> None:
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigurationError("StopAtTools takes one or more tool names.")
        object.__setattr__(self, "names", tuple(names))


ToolUseBehavior = Literal["run_llm_again", "stop_on_first_tool"] | StopAtTools
"""What a tool round leads to: `"run_llm_again"` (default: the model sees the results and
answers), `"stop_on_first_tool"` (the first call's result is the output, the model is not asked
again), or `StopAtTools(...)`."""


def check_tool_use_behavior(value: object) -> ToolUseBehavior:
    """`value` if it is a `ToolUseBehavior`, else a clear `ConfigurationError`."""
    if value in ("run_llm_again", "stop_on_first_tool") or isinstance(value, StopAtTools):
        return value
    raise ConfigurationError(
        f"tool_use_behavior must be 'run_llm_again', 'stop_on_first_tool' or "
        f"StopAtTools('name', ...), got {value!r}."
    )


def check_stop_names(behavior: ToolUseBehavior, tools: ToolSet) -> None:
    """Refuse `StopAtTools` naming a tool the pass does not have (it could never stop there)."""
    if isinstance(behavior, StopAtTools):
        unknown = [n for n in behavior.names if n not in tools]
        if unknown:
            raise ConfigurationError(
                f"StopAtTools names {', '.join(map(repr, unknown))}, which the pass has no tool "
                f"called; pass the names of its tools ({', '.join(map(repr, tools)) or 'none'})."
            )


def gated_tools(tools: ToolSet) -> tuple[Tool, ...]:
    """The tools whose `is_enabled` is not plainly True (asked before each request)."""
    return tuple(t for t in tools.values() if t.is_enabled is not True)


async def offered(tools: ToolSet, gated: Sequence[Tool], context: ToolContext) -> ToolSet:
    """The tools to offer in the next request: every tool, less those disabled now.

    The functions are asked within the pass's deadline (`context.deadline`): past it the pass's
    tools are returned as they are, and the model request that follows stops with `deadline`.
    A function that raises fails the pass with `ToolEnabledError` naming the tool.
    """
    off: set[str] = set()
    if context.deadline is None:
        await _ask(gated, context, off)
    else:
        with anyio.move_on_after(max(0.0, context.deadline - time.monotonic())):
            await _ask(gated, context, off)
    if not off:
        return tools
    return ToolSet(t for t in tools.values() if t.name not in off)


async def _ask(gated: Sequence[Tool], context: ToolContext, off: set[str]) -> None:
    """Add to `off` the name of each gated tool whose `is_enabled` says no."""
    for item in gated:
        rule = item.is_enabled
        if isinstance(rule, bool):
            enabled: object = rule
        else:
            try:
                enabled = await call_user(rule, context)
            except Exception as error:
                raise ToolEnabledError(
                    f"the is_enabled function of tool {item.name!r} raised {error!r}; make it "
                    "return True or False for every context."
                ) from error
        if not enabled:
            off.add(item.name)


def stop_after_tools(
    behavior: ToolUseBehavior,
    calls: Sequence[ToolCall],
    rows: Sequence[ChunkRow],
    metadata: dict[str, Any],
) -> StopReason | None:
    """`"final_answer"` when the round ends the pass under `behavior` (None: ask the model again).

    `rows` are the round's `tool_result` rows in call order. The pass's output
    (`metadata["output"]`) is then the decoded JSON body of the deciding call's result, as the
    model would have seen it; `metadata["stopped_at_tool"]` names that call.
    """
    if behavior == "run_llm_again" or not calls:
        return None
    index = 0
    if isinstance(behavior, StopAtTools):
        hits = [i for i, c in enumerate(calls) if c.name in behavior.names]
        if not hits:
            return None
        index = hits[0]
    content = rows[index].payload.get("content")
    try:
        body = json.loads(content) if isinstance(content, str) else content
    except ValueError:
        body = content
    metadata["output"] = body
    metadata["stopped_at_tool"] = {"name": calls[index].name, "tool_call_id": calls[index].id}
    return "final_answer"


def forced_tool_choice(provider: Provider | None) -> bool:
    """True when the provider forces a tool call (`"required"` or a named function), which must
    be reset to `"auto"` after a tool ran or the pass could only ever call tools."""
    choice = provider.tool_choice if provider is not None else None
    return choice == "required" or isinstance(choice, Mapping)


class _Plan(Protocol):
    """What `choice_extra` reads of a pass's plan."""

    @property
    def provider(self) -> Provider | None: ...
    @property
    def reset_tool_choice(self) -> bool: ...


def choice_extra(
    plan: _Plan, ran: bool, tools: ToolSet, extra: Mapping[str, Any] | None
) -> Mapping[str, Any] | None:
    """The request's overrides, with `tool_choice="auto"` when a forced choice must not be sent:
    a tool already ran (`ran`) and the reset is on, or the function it names is not offered this
    round (disabled by `is_enabled`; forcing it would make the endpoint fail). A few attribute
    reads per round when no choice is forced."""
    provider = plan.provider
    choice = provider.tool_choice if provider is not None else None
    if choice is None or choice == "auto":
        return extra
    reset = ran and plan.reset_tool_choice and forced_tool_choice(provider)
    if reset or (isinstance(choice, Mapping) and _forced_name(choice) not in tools):
        return {"tool_choice": "auto", **(extra or {})}
    return extra


def _forced_name(choice: Mapping[str, Any]) -> object:
    function = choice.get("function")
    return function.get("name") if isinstance(function, Mapping) else None
