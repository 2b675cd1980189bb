"""Streaming a whole agent run: typed events tagged with the agent that produced them.

`async for event in agent.stream(session)` yields `AgentPassEvent`s (a pass's typed event, from
`treadle.loop`, with the agent's name), `HandoffEvent`s when the conversation changes hands, and
ends with one `AgentRunStopped` holding the output session. An agent used as a tool (`as_tool`)
inside a streamed run streams its own passes' events into the same iterator, tagged with its own
name. Events are delivered in order from the runtime loop; nothing here blocks it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

from treadle.loop.events import Event
from treadle.session import Session

__all__ = [
    "AgentEvent",
    "AgentPassEvent",
    "AgentRunStopped",
    "HandoffEvent",
    "current_sink",
    "streaming_to",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentEvent:
    """Base of the events of a streamed agent run."""

    type: ClassVar[str] = "agent_event"
    agent: str
    """The name of the agent the event comes from."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentPassEvent(AgentEvent):
    """One typed event of one of the agent's passes (`TextDelta`, `ToolStarted`, ...)."""

    type: ClassVar[str] = "pass_event"
    event: Event
    """The pass's event; `event.type` says which."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HandoffEvent(AgentEvent):
    """`agent` handed the conversation to `target`."""

    type: ClassVar[str] = "handoff"
    target: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentRunStopped(AgentEvent):
    """The run ended (the last event); `agent` is the one that answered."""

    type: ClassVar[str] = "run_stopped"
    session: Session
    """The output session."""


Sink = Callable[[AgentEvent], None]

_sink: ContextVar[Sink | None] = ContextVar("treadle_agent_event_sink", default=None)


def current_sink() -> Sink | None:
    """Where a streamed run in this context sends its events (None when not streaming)."""
    return _sink.get()


@contextmanager
def streaming_to(sink: Sink) -> Iterator[None]:
    """Inside the block, agent runs (agents used as tools too) send their events to `sink`."""
    token = _sink.set(sink)
    try:
        yield
    finally:
        _sink.reset(token)


def pass_sink(sink: Sink, agent: str) -> Callable[[Any], None]:
    """A pass's `emit` that tags each event with `agent` and forwards it."""

    def emit(event: Event) -> None:
        sink(AgentPassEvent(agent=agent, event=event))

    return emit
