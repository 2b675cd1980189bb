"""`LiveView`: shows a pass as it happens, from its typed events (`stream_session_loop`).

Model text is written as it arrives; each tool call is shown when it starts and its result when
its row is appended. This module only renders: it never starts passes or touches files.
"""

from __future__ import annotations

from treadle.cli.console import Console
from treadle.cli.describe import describe_call, describe_result
from treadle.loop.events import (
    AssistantRowEvent,
    Event,
    GuardrailTripped,
    Interrupted,
    TextDelta,
    ToolResultEvent,
    ToolStarted,
)

__all__ = ["LiveView"]


class LiveView:
    """Feeds events of one pass to a console; counts tool calls for the summary."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.tool_calls = 0
        self._mid_line = False

    def _end_text(self) -> None:
        if self._mid_line:
            self.console.line()
            self._mid_line = False

    def __call__(self, event: Event) -> None:
        """Show one event."""
        if isinstance(event, TextDelta):
            self.console.write(event.text, "assistant")
            self._mid_line = not event.text.endswith("\n")
        elif isinstance(event, AssistantRowEvent):
            self._end_text()
        elif isinstance(event, ToolStarted):
            self._end_text()
            self.tool_calls += 1
            self.console.line(f"-> {describe_call(event.name, event.arguments)}", "tool")
        elif isinstance(event, ToolResultEvent):
            ok, said = describe_result(event.row.payload.get("content", ""))
            name = event.row.payload.get("name", "")
            self.console.line(f"<- {name}: {said}", "ok" if ok else "error")
        elif isinstance(event, GuardrailTripped):
            self._end_text()
            self.console.line(f"blocked by guardrail: {event.tripwire}", "warn")
        elif isinstance(event, Interrupted):
            self._end_text()
            self.console.line(f"interrupted: {event.reason}", "warn")

    def finish(self) -> None:
        """End a line of model text left open."""
        self._end_text()
