"""Session values: rows, tables, usage, lineage and the `Session` facade. No I/O."""

from treadle.session.calls import ToolCall, tool_calls_of
from treadle.session.lineage import LineageNode
from treadle.session.rows import ROLE_OF_KIND, ChunkRow, ChunkTable, RowKind
from treadle.session.session import Session, SessionData, new_session_id
from treadle.session.usage import Usage

__all__ = [
    "ROLE_OF_KIND",
    "ChunkRow",
    "ChunkTable",
    "LineageNode",
    "RowKind",
    "Session",
    "SessionData",
    "ToolCall",
    "Usage",
    "new_session_id",
    "tool_calls_of",
]
