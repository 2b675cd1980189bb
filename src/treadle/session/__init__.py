"""Session values: rows, tables, tool calls, usage, lineage, sandbox placement and the `Session`
facade. No I/O.

Names load on first access, so the top-level package can install the sandbox opener
(`treadle.session.placement`) without importing pydantic at `import treadle`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.session.calls import ToolCall, tool_calls_of
    from treadle.session.lineage import LineageNode
    from treadle.session.placement import SandboxHandle
    from treadle.session.rows import ROLE_OF_KIND, ChunkRow, ChunkTable, RowKind
    from treadle.session.session import Session, SessionData, new_session_id
    from treadle.session.stops import STOP_REASONS, StopReason
    from treadle.session.usage import Usage

_HOMES = {
    "ToolCall": "calls",
    "tool_calls_of": "calls",
    "LineageNode": "lineage",
    "SandboxHandle": "placement",
    "ROLE_OF_KIND": "rows",
    "ChunkRow": "rows",
    "ChunkTable": "rows",
    "RowKind": "rows",
    "Session": "session",
    "SessionData": "session",
    "new_session_id": "session",
    "STOP_REASONS": "stops",
    "StopReason": "stops",
    "Usage": "usage",
}

__all__ = [
    "ROLE_OF_KIND",
    "STOP_REASONS",
    "ChunkRow",
    "ChunkTable",
    "LineageNode",
    "RowKind",
    "SandboxHandle",
    "Session",
    "SessionData",
    "StopReason",
    "ToolCall",
    "Usage",
    "new_session_id",
    "tool_calls_of",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'treadle.session' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"treadle.session.{home}"), name)
    globals()[name] = value
    return value
