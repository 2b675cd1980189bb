"""Typed events of a pass, for UIs and logs (`stream_session_loop`).

Every event carries the output session's id and a sequence number that increases by one per
event of that pass. Events are the same whether the model streams or not: a non-streamed reply
produces one text delta and one tool-call delta per call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from treadle.llm.turn import ToolCallPiece, TurnDelta
from treadle.loop.control import Tripwire
from treadle.session import ChunkRow, Session, Usage

__all__ = [
    "AssistantRowEvent",
    "Emitter",
    "Event",
    "GuardrailTripped",
    "Interrupted",
    "PassStarted",
    "PassStopped",
    "TextDelta",
    "ToolCallDelta",
    "ToolResultEvent",
    "ToolStarted",
    "UsageEvent",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of every pass event."""

    type: ClassVar[str] = "event"
    session_id: str
    """Id of the output session the pass produces."""
    seq: int
    """Position of this event in its pass, from 0."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PassStarted(Event):
    """The pass began; `rows` is how many input rows it starts from."""

    type: ClassVar[str] = "pass_started"
    rows: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TextDelta(Event):
    """A piece of assistant text."""

    type: ClassVar[str] = "text_delta"
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallDelta(Event):
    """A piece of a tool call: its id and name arrive first, arguments in pieces."""

    type: ClassVar[str] = "tool_call_delta"
    index: int
    call_id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AssistantRowEvent(Event):
    """The assistant row was appended (once per round, after its deltas)."""

    type: ClassVar[str] = "assistant_row"
    row: ChunkRow


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolStarted(Event):
    """A tool call is about to run."""

    type: ClassVar[str] = "tool_started"
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResultEvent(Event):
    """A tool_result row was appended."""

    type: ClassVar[str] = "tool_result"
    row: ChunkRow


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageEvent(Event):
    """Token usage of one completion, and of the pass so far."""

    type: ClassVar[str] = "usage"
    usage: Usage
    total: Usage


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardrailTripped(Event):
    """A guardrail blocked the pass."""

    type: ClassVar[str] = "guardrail_tripwire"
    tripwire: Tripwire


@dataclass(frozen=True, slots=True, kw_only=True)
class Interrupted(Event):
    """The pass was interrupted (by `on_message` or a tool needing approval)."""

    type: ClassVar[str] = "interrupt"
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PassStopped(Event):
    """The pass ended; the last event. `session` is the output session."""

    type: ClassVar[str] = "stop"
    stop_reason: str
    session: Session | None = None


@dataclass(slots=True)
class Emitter:
    """Numbers events of one pass and hands them to a sink."""

    session_id: str
    sink: Callable[[Event], None]
    seq: int = field(default=0)

    def emit(self, cls: type[Event], **fields: Any) -> None:
        """Build and deliver one event."""
        event = cls(session_id=self.session_id, seq=self.seq, **fields)
        self.seq += 1
        self.sink(event)

    def deltas(self, delta: TurnDelta) -> None:
        """Events for one stream delta (or a whole reply, given as one delta)."""
        self.pieces(delta.text, delta.tool_calls)

    def pieces(self, text: str | None, tool_calls: tuple[ToolCallPiece, ...]) -> None:
        """Events for one delta's text and tool-call pieces (`request_turn`'s `on_pieces`)."""
        if text:
            self.emit(TextDelta, text=text)
        for piece in tool_calls:
            self.emit(
                ToolCallDelta,
                index=piece.index,
                call_id=piece.call_id,
                name=piece.name,
                arguments=piece.arguments,
            )
