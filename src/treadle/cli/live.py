"""`LiveView`: shows a pass as it happens, from its typed events (`stream_session_loop`).

Model text is written as it arrives; each tool call is shown when it starts and its result when
its row is appended. Between them a `StatusLine` says what the pass is waiting on (the model, with
the seconds elapsed, or a tool), so the screen is never blank while work goes on. This module
only renders: it never starts passes or touches files.
"""

from __future__ import annotations

from treadle.cli.console import Console
from treadle.cli.describe import describe_call, describe_result
from treadle.cli.shown_url import shown_url
from treadle.cli.status import StatusLine
from treadle.loop.events import (
    AssistantRowEvent,
    Event,
    GuardrailTripped,
    Interrupted,
    TextDelta,
    ToolCallDelta,
    ToolResultEvent,
    ToolStarted,
)

__all__ = ["LiveView"]


class LiveView:
    """Feeds events of one pass to a console; counts tool calls for the summary."""

    def __init__(
        self,
        console: Console,
        *,
        status: StatusLine | None = None,
        model: str = "the model",
        base_url: str | None = None,
    ) -> None:
        self.console = console
        self.status = status
        self.tool_calls = 0
        self.model = model
        # never `netloc`: it holds the user-info of https://user:password@host
        self.host = shown_url(base_url).split("://", 1)[-1] if base_url else ""
        self._mid_line = False
        self._running: dict[str, str] = {}

    def start(self) -> None:
        """Show that the pass is under way, before its first request is answered.

        The phase names the host but not "connecting": most of a long first wait is the model
        reading the prompt, long after the connection was made, and the reminder of a long
        phase ("still ...") repeats these words."""
        where = f" at {self.host}" if self.host else ""
        self._phase(f"waiting for {self.model}{where}")

    def _phase(self, phase: str | None, *, announce: bool = True) -> None:
        if self.status is not None:
            self.status.set(phase, announce=announce)

    def _clear(self) -> None:
        if self.status is not None:
            self.status.clear()

    def _end_text(self) -> None:
        if self._mid_line:
            self.console.line()
            self._mid_line = False

    def __call__(self, event: Event) -> None:
        """Show one event."""
        if isinstance(event, TextDelta):
            self._phase(None)  # the text itself shows progress now
            self.console.write(event.text, "assistant")
            self._mid_line = not event.text.endswith("\n")
        elif isinstance(event, ToolCallDelta):
            if event.name:
                self._end_text()
                self._phase(f"{self.model} is writing a call to {event.name}")
        elif isinstance(event, AssistantRowEvent):
            self._clear()
            self._end_text()
            self._phase(None)
        elif isinstance(event, ToolStarted):
            self._clear()
            self._end_text()
            self.tool_calls += 1
            self.console.line(f"-> {describe_call(event.name, event.arguments)}", "tool")
            self._running[event.call_id] = event.name
            # the "->" line already says it; a plain log only hears of it again if it runs long
            self._phase(f"running {', '.join(self._running.values())}", announce=False)
        elif isinstance(event, ToolResultEvent):
            self._clear()
            ok, said = describe_result(event.row.payload.get("content", ""))
            name = event.row.payload.get("name", "")
            self.console.line(f"<- {name}: {said}", "ok" if ok else "error")
            self._running.pop(str(event.row.payload.get("tool_call_id", "")), None)
            if self._running:
                self._phase(f"running {', '.join(self._running.values())}", announce=False)
            else:
                self._phase(f"waiting for {self.model}")
        elif isinstance(event, GuardrailTripped):
            self._phase(None)
            self._end_text()
            self.console.line(f"blocked by guardrail: {event.tripwire}", "warn")
        elif isinstance(event, Interrupted):
            self._phase(None)
            self._end_text()
            self.console.line(f"interrupted: {event.reason}", "warn")

    def finish(self) -> None:
        """Erase the status and end a line of model text left open."""
        self._phase(None)
        self._end_text()
