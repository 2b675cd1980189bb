"""The JSONL session file format: one JSON object per line, encoded with pydantic-core.

```
{"type": "header", "schema": 1, "session_id", "parent_ids", "operator", "created_at",
 "placement", "agent_rows": [messages]}
{"type": "row", "kind", "payload"}                       one per row, in order
{"type": "intent", "tool_call_id", "name"}               a tool is about to run (crash safety)
{"type": "trailer", "rows", "usage", "stop_reason", "metadata"}   only on a graceful end
```

Pure encoding and decoding; no file I/O here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic_core

from treadle.session import ChunkRow, Usage

__all__ = [
    "SCHEMA_VERSION",
    "encode_header",
    "encode_intent",
    "encode_row",
    "encode_trailer",
]

#: Version of the file format written in every header; readers refuse newer major versions.
SCHEMA_VERSION = 1


def _line(obj: Mapping[str, Any]) -> bytes:
    return pydantic_core.to_json(obj) + b"\n"


def encode_header(
    *,
    session_id: str,
    parent_ids: Sequence[str],
    operator: str,
    placement: str | None,
    agent_rows: Sequence[ChunkRow],
) -> bytes:
    """The first line of a session file."""
    return _line(
        {
            "type": "header",
            "schema": SCHEMA_VERSION,
            "session_id": session_id,
            "parent_ids": list(parent_ids),
            "operator": operator,
            "created_at": time.time(),
            "placement": placement,
            "agent_rows": [row.to_message() for row in agent_rows],
        }
    )


def encode_row(row: ChunkRow) -> bytes:
    """One row line."""
    return _line({"type": "row", "kind": row.kind, "payload": row.payload})


def encode_intent(tool_call_id: str, name: str) -> bytes:
    """A line recording that a tool call is about to run (its result may never be written)."""
    return _line({"type": "intent", "tool_call_id": tool_call_id, "name": name})


def encode_trailer(
    *, rows: int, usage: Usage, stop_reason: str | None, metadata: Mapping[str, Any]
) -> bytes:
    """The last line of a gracefully ended pass."""
    return _line(
        {
            "type": "trailer",
            "rows": rows,
            "usage": usage.to_dict(),
            "stop_reason": stop_reason,
            "metadata": dict(metadata),
        }
    )
