"""Handoffs: an agent's `handoffs=[...]` become transfer tools the model calls.

`Agent("triage", handoffs=[billing, handoff(tech, input_type=Reason, on_handoff=log)])` offers
the model one tool per target (`transfer_to_billing`, ...). When the model calls one, the round
runs as usual (other calls of the same reply too), the transfer's result row says who takes over
(`{"assistant": "billing"}`), and the pass ends there. Only the first transfer call of a reply
can take effect: any other gets `HANDOFF_IGNORED` as its result, as in the OpenAI Agents SDK.
The transcript passes through the handoff's `input_filter`, `on_handoff` runs, and the target
agent continues the SAME transcript under its own instructions. The output records who answered
(`metadata["agent"]`) and every transfer (`metadata["handoffs"]`).

This module builds values and rows; it never calls a model and never blocks the event loop.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pydantic

from treadle.errors import ConfigurationError, ToolArgumentsError, ToolError
from treadle.loop.control import call_user
from treadle.session import ChunkRow, Session, ToolCall
from treadle.tools import Tool, ToolContext
from treadle.tools.arguments import parse_arguments
from treadle.tools.results import success_content

if TYPE_CHECKING:
    from treadle.agents.agent import Agent
    from treadle.llm.provider import Provider

__all__ = [
    "HANDOFF_IGNORED",
    "HANDOFF_INTERRUPT",
    "MAX_HANDOFFS_PER_RUN",
    "Handoff",
    "HandoffChoice",
    "handoff",
    "handoff_rows",
    "remove_tool_rows",
]

#: Transfers one run may make; past this the run stops with `stop_reason == "max_steps"`.
MAX_HANDOFFS_PER_RUN = 16
#: The interrupt reason a transfer call ends its pass with (never shown to users).
HANDOFF_INTERRUPT = "treadle:handoff"
#: What the model hears for a transfer call that is not its reply's first (not performed).
HANDOFF_IGNORED = "Multiple handoffs detected, ignoring this one"

_TOOL_NAME = re.compile(r"[^A-Za-z0-9_-]")


def _default_tool_name(name: str) -> str:
    return ("transfer_to_" + _TOOL_NAME.sub("_", name.strip().lower()))[:64]


@dataclass(frozen=True, eq=False)
class Handoff:
    """A transfer to `agent`, offered to the model as a tool.

    Build with `handoff(agent, ...)`; a bare `Agent` in `handoffs=[...]` is `handoff(agent)`.
    """

    agent: Agent
    """The agent that continues the conversation."""
    tool_name: str = ""
    """The tool's name (default `transfer_to_<agent name>`)."""
    tool_description: str = ""
    """What the model reads (default: the target's `description`)."""
    input_type: type[pydantic.BaseModel] | None = None
    """Arguments the model must give with the transfer (validated; invalid ones go back)."""
    on_handoff: Callable[..., Any] | None = None
    """Called as `on_handoff(session)` or, with `input_type`, `on_handoff(session, input)`."""
    input_filter: Callable[[Session], Session] | None = None
    """Rewrites the transcript the target sees (e.g. `remove_tool_rows`)."""
    is_enabled: bool | Callable[[Session], Any] = True
    """Offer the tool at all; a callable decides per pass from the session so far."""
    tool: Tool = field(init=False)

    def __post_init__(self) -> None:
        from treadle.agents.agent import Agent

        if not isinstance(self.agent, Agent):
            raise ConfigurationError(
                f"a handoff needs an Agent to hand off to, got {type(self.agent).__name__}."
            )
        if self.input_type is not None and not (
            isinstance(self.input_type, type) and issubclass(self.input_type, pydantic.BaseModel)
        ):
            raise ConfigurationError("handoff input_type must be a pydantic BaseModel subclass.")
        for name in ("on_handoff", "input_filter"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigurationError(f"handoff {name} must be callable.")
        if not (isinstance(self.is_enabled, bool) or callable(self.is_enabled)):
            raise ConfigurationError("handoff is_enabled must be a bool or a callable.")
        object.__setattr__(self, "tool_name", self.tool_name or _default_tool_name(self.agent.name))
        if not self.tool_description:
            about = self.agent.description or f"the {self.agent.name} agent"
            text = f"Hand the conversation to {self.agent.name}: {about}"
            object.__setattr__(self, "tool_description", text)
        object.__setattr__(self, "tool", _TransferTool(self))

    async def enabled(self, session: Session) -> bool:
        """Whether the tool is offered on a pass starting from `session`."""
        if isinstance(self.is_enabled, bool):
            return self.is_enabled
        return bool(await call_user(self.is_enabled, session))

    def parse(self, arguments: str) -> pydantic.BaseModel | None:
        """The typed input from the call's JSON arguments (None without `input_type`), read
        exactly as the tool dispatcher reads them for the transfer tool's own validation."""
        if self.input_type is None:
            return None
        return self.input_type.model_validate(parse_arguments(arguments))

    @property
    def result_content(self) -> str:
        """The transfer tool's own successful result row content (what a handoff needs)."""
        return success_content({"assistant": self.agent.name})

    async def run_callback(self, session: Session, value: pydantic.BaseModel | None) -> None:
        """Call `on_handoff` (sync ones off the event loop)."""
        if self.on_handoff is None:
            return
        if self.input_type is not None:
            await call_user(self.on_handoff, session, value)
        else:
            await call_user(self.on_handoff, session)


class _HandoffIgnored(ToolError):
    """A transfer call after the first one of its reply: not performed."""

    error_kind = "handoff_ignored"


class _TransferTool(Tool):
    """The transfer as a tool: its arguments are validated; the call itself ends the pass.

    Bound to a pass (`bound`), it knows the names of every transfer offered there, so a call
    that is not the first transfer call of its reply reports `HANDOFF_IGNORED` instead of
    claiming the conversation (only the first can take effect; siblings that are ordinary
    tools run as usual).
    """

    _siblings: frozenset[str] = frozenset()

    def __init__(self, target: Handoff) -> None:
        self.name = target.tool_name
        self.description = target.tool_description
        if target.input_type is not None:
            schema = target.input_type.model_json_schema()
            schema.pop("title", None)
        else:
            schema = {"type": "object", "properties": {}, "additionalProperties": False}
        self.parameters = schema
        self._target = target

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Validate the transfer's input; `ToolArgumentsError` lists the bad fields."""
        model = self._target.input_type
        if model is not None:
            try:
                model.model_validate(dict(arguments))
            except pydantic.ValidationError as err:
                raise ToolArgumentsError(
                    f"the transfer to {self._target.agent.name} needs valid input: {err}",
                    detail="fix these fields and call the transfer again",
                ) from None
        return dict(arguments)

    def bound(self, siblings: frozenset[str]) -> _TransferTool:
        """This tool for one pass whose offered transfers are named `siblings`."""
        tool = copy.copy(self)
        tool._siblings = siblings
        return tool

    async def invoke(self, arguments: Mapping[str, Any], *, context: ToolContext) -> Any:
        """The transfer's result row: the agent that takes over (an `Agent` run then ends the
        pass and hands over; in a bare pass nothing else happens)."""
        first = first_transfer(context, self._siblings)
        if first is not None and first.id != context.tool_call_id:
            raise _HandoffIgnored(
                f"{HANDOFF_IGNORED}: only the first transfer of a reply can take effect "
                f"({first.name}), so this call to {self.name} was not performed."
            )
        return {"assistant": self._target.agent.name}


def first_transfer(context: ToolContext, names: frozenset[str]) -> ToolCall | None:
    """The first call, in the reply that made `context`'s call, to one of the transfers
    `names` (None outside a pass or when no sibling list is known)."""
    call, session = context.call, context.session
    if not names or call is None or session is None:
        return None
    for row in reversed(session.rows):  # the reply is the last assistant row, or close to it
        if row.kind == "assistant" and any(c.id == call.id for c in row.calls):
            return next((c for c in row.calls if c.name in names), None)
    return None


def transfer_tools(offered: Sequence[Handoff]) -> list[Tool]:
    """The transfer tools of one pass offering `offered` (each knows the others)."""
    names = frozenset(h.tool_name for h in offered)
    return [h.tool.bound(names) if isinstance(h.tool, _TransferTool) else h.tool for h in offered]


def as_handoff(item: Any) -> Handoff:
    """A `Handoff` from a `handoffs=[...]` item (an `Agent` or a `Handoff`)."""
    if isinstance(item, Handoff):
        return item
    return Handoff(item)


@dataclass
class HandoffChoice:
    """The transfer a pass's last reply asked for (one per run state, reset per pass)."""

    handoff: Handoff
    call_id: str
    value: pydantic.BaseModel | None


def transfer_calls(row: ChunkRow, offered: Mapping[str, Handoff]) -> dict[str, tuple[Handoff, str]]:
    """The transfer calls of an assistant row, by call id: `(handoff, arguments)` for each call
    of a transfer offered on this pass (a disabled one the model names anyway is not a
    transfer: the tool round reports it as an unknown tool)."""
    return {
        call.id: (offered[call.name], call.arguments) for call in row.calls if call.name in offered
    }


def transfer_result(
    row: ChunkRow, calls: Mapping[str, tuple[Handoff, str]]
) -> HandoffChoice | None:
    """The handoff a tool_result row completes, if any: only the transfer tool's own
    successful result does (a guardrail's rejection or replacement, or a validation error,
    does not); the input is the one the tool's validation accepted."""
    call_id = row.payload.get("tool_call_id")
    found = calls.get(call_id) if isinstance(call_id, str) else None
    if (
        found is None
        or not isinstance(call_id, str)
        or row.payload.get("content") != found[0].result_content
    ):
        return None
    target, arguments = found
    try:
        value = target.parse(arguments)
    except (pydantic.ValidationError, ToolArgumentsError):
        return None  # unreachable for a result the tool itself produced: same validation
    return HandoffChoice(target, call_id, value)


def handoff_rows(out: Session, choice: HandoffChoice) -> Session:
    """`out` (a pass ended by a transfer's result) with its stop fields cleared: the transcript
    the target continues."""
    data = out.data
    metadata = {
        k: v for k, v in data.metadata.items() if k not in ("interrupt_reason", "cancelled")
    }
    return out.with_data(stop_reason=None, metadata=metadata)


def remove_tool_rows(session: Session) -> Session:
    """An `input_filter`: the transcript without tool calls and tool results (the target sees
    only the conversation's words)."""
    kept: list[ChunkRow] = []
    for row in session.rows:
        if row.kind == "tool_result":
            continue
        if row.kind == "assistant" and row.calls:
            payload = {k: v for k, v in row.payload.items() if k != "tool_calls"}
            if not payload.get("content"):
                continue
            row = ChunkRow._trusted("assistant", payload)
        kept.append(row)
    return session.with_data(table=type(session.data.table)(kept))


def check_handoffs(owner: str, items: Sequence[Any]) -> tuple[Handoff, ...]:
    """The handoffs of agent `owner`, with distinct tool names."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise ConfigurationError("handoffs takes a list of Agents or handoff(...) values.")
    out = tuple(as_handoff(item) for item in items)
    names = [h.tool_name for h in out]
    if len(set(names)) != len(names):
        raise ConfigurationError(
            f"Agent {owner!r} has two handoffs with one tool name; set tool_name= on one."
        )
    return out


def worker_handoffs(
    owner: Agent, provider: Provider, guardrails: Sequence[Any], done: dict[int, Agent]
) -> tuple[Handoff, ...]:
    """`owner`'s handoffs on a distributed worker (`Agent.on_worker`): a target defined on
    the owner's provider moves to the worker's `provider` too (`done`: the agents already
    moved, so agents handing back to each other end); any other target keeps its own."""
    out = []
    for target in owner.handoffs:
        agent = target.agent
        if agent.provider == owner.provider and agent.executor is None:
            moved = done.get(id(agent)) or agent.on_worker(provider, guardrails, _done=done)
            target = dataclasses.replace(target, agent=moved)
        out.append(target)
    return tuple(out)


def handoff(
    agent: Agent,
    specialists: Mapping[str, Agent] | None = None,
    *,
    tool_name: str = "",
    tool_description: str = "",
    input_type: type[pydantic.BaseModel] | None = None,
    on_handoff: Callable[..., Any] | None = None,
    input_filter: Callable[[Session], Session] | None = None,
    is_enabled: bool | Callable[[Session], Any] = True,
    route: Callable[[Any], str] | None = None,
) -> Any:
    """A transfer to `agent` with options, for `Agent(handoffs=[...])`.

    The old form `handoff(router, {"name": specialist, ...})` (a router's structured choice,
    the specialist answering a fresh copy of the input) still works but is deprecated: it is
    `treadle.agents.triage` now.
    """
    if specialists is not None:
        warnings.warn(
            "handoff(router, specialists) is now triage(router, specialists); handoff(agent) "
            "builds a transfer for Agent(handoffs=[...]).",
            DeprecationWarning,
            stacklevel=2,
        )
        from treadle.agents.patterns import triage

        return triage(agent, specialists, route=route)
    return Handoff(
        agent,
        tool_name=tool_name,
        tool_description=tool_description,
        input_type=input_type,
        on_handoff=on_handoff,
        input_filter=input_filter,
        is_enabled=is_enabled,
    )


def check_no_input_filter(agent: Agent) -> None:
    """`ConfigurationError` when a handoff reachable from `agent` has an `input_filter`, for a
    run on a stored conversation: the store keeps the conversation's rows as they are, so the
    filter could not hide them from the target (its rows would be added again after them)."""
    seen: set[int] = set()
    waiting = [agent]
    while waiting:
        current = waiting.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for target in current.handoffs:
            if target.input_filter is not None:
                raise ConfigurationError(
                    f"the handoff from {current.name!r} to {target.agent.name!r} has an "
                    "input_filter, which a stored conversation cannot apply (the store keeps "
                    "every row the target would see): drop the filter, or run without store=."
                )
            waiting.append(target.agent)
