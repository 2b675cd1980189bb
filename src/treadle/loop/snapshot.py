"""`Snapshot`: the `with` block of a pass's output so far, as tools and callbacks see it.

A class, not a `@contextmanager` generator: every tool round takes one, and a generator-based
context manager (the generator, its wrapper object, two steps and a `StopIteration`) cost about
as much as building the snapshot's session (docs/performance.md, issue 33's fifth round).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from treadle.llm.turn import HttpExecutor
from treadle.session import Session, ToolCall
from treadle.tools import BaseTool, FunctionTool, Tool
from treadle.tools.dispatch import has_tool_dispatch

__all__ = ["NO_SNAPSHOT", "Snapshot", "blind_round"]


class Snapshot:
    """`with Snapshot(session) as session`: closes the session's sandbox share at the end."""

    __slots__ = ("session",)

    def __init__(self, session: Session) -> None:
        self.session = session

    def __enter__(self) -> Session:
        return self.session

    def __exit__(self, *exc: object) -> None:
        self.session.close_sandbox()


class _NoSnapshot:
    """`with NO_SNAPSHOT as session`: None, for a round whose tools cannot see a session."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        pass


NO_SNAPSHOT = _NoSnapshot()


def blind_round(tools: Mapping[str, Tool], calls: Sequence[ToolCall], executor: object) -> bool:
    """True when no tool of the round can read the pass's session, so none is built for it: each
    call's tool is a `@tool` function or `BaseTool` asking for no context, session or sandbox (or
    a name no tool has: answered without running anything), and no executor of the user's runs
    them (it is handed the session). Tools with an `invoke` of their own (MCP, agents as tools,
    a user's `Tool`) get the whole context, so a snapshot."""
    if type(executor) is not HttpExecutor and has_tool_dispatch(executor):  # the usual one first
        return False
    for call in calls:
        item = tools.get(call.name)
        # The bound method's function: an `invoke` replaced on the instance (a tracing
        # wrapper) is not one of ours, so it gets the session.
        if item is not None and (
            item.injected or getattr(item.invoke, "__func__", None) not in _INJECTING
        ):
            return False
    return True


_INJECTING = frozenset({FunctionTool.invoke, BaseTool.invoke})
"""The `invoke`s that hand a tool only what its `injected` names."""
