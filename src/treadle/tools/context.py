"""`ToolContext`: what a tool may know about the call it serves (session, sandbox, pass, deadline).

A tool asks for it by declaring a parameter annotated `ToolContext` (or, as shorthands, `Session`
or `Sandbox`); the dispatcher fills it in and leaves it out of the schema the model sees. The
context is a value: building one does no I/O, and the sandbox opens only when a tool reads it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from treadle.errors import ToolError
from treadle.session import Session, ToolCall

if TYPE_CHECKING:
    from treadle.sandbox import Sandbox

__all__ = ["ToolContext"]


@dataclass(frozen=True, slots=True)
class ToolContext:
    """The calling pass, as a tool sees it."""

    __treadle_inject__: ClassVar[str] = "context"

    session: Session | None = None
    """The pass's output session so far (None when a tool runs outside a pass)."""
    pass_id: str | None = None
    """Id of the output session the pass produces."""
    deadline: float | None = None
    """`time.monotonic()` value by which the pass must end (None: no deadline)."""
    call: ToolCall | None = None
    """The call being served (set by the dispatcher for each call)."""
    tool_timeout: float | None = None
    """The pass's timeout for tools that set none (None: `DEFAULT_TOOL_TIMEOUT`)."""

    @property
    def sandbox(self) -> Sandbox:
        """The session's sandbox, opened on first use; `ToolError` when the pass has none."""
        session = self.require_session()
        return session.require_sandbox()

    def require_session(self) -> Session:
        """The calling session; `ToolError` when the tool runs outside a pass."""
        if self.session is None:
            name = self.call.name if self.call is not None else "this tool"
            raise ToolError(f"tool {name!r} needs the calling session, but none was given.")
        return self.session

    def seconds_left(self) -> float | None:
        """Seconds until the pass's deadline (None without one; never negative)."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - time.monotonic())

    def for_call(self, call: ToolCall) -> ToolContext:
        """This context serving `call`."""
        return ToolContext(self.session, self.pass_id, self.deadline, call, self.tool_timeout)
