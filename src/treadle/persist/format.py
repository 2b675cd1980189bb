"""The JSONL session file format: one JSON object per line, encoded with pydantic-core.

```
{"type": "header", "schema": 1, "session_id", "parent_ids", "operator", "created_at",
 "placement", "placement_options"?, "producer"?, "agent_rows": [messages]}
{"type": "row", "kind", "payload"}                       one per row, in order
{"type": "intent", "tool_call_id", "name"}               a tool is about to run (crash safety)
{"type": "trailer", "rows", "usage", "stop_reason", "metadata"}   only on a graceful end
```

`placement_options` (only for `Isolated(...)` placements) is the options' spec with the env
*names* (`env_names`) in place of `env`: env values may be secrets and never reach the disk.
`producer` (older files have none, and still load) says what wrote the file: Treadle's
version, model, endpoint origin and output options, never a secret (see
`treadle.persist.producer`). Pure encoding and decoding; no file I/O here.
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
    "saved_options",
]

#: Version of the file format written in every header; readers refuse newer major versions.
SCHEMA_VERSION = 1


def _line(obj: Mapping[str, Any]) -> bytes:
    return pydantic_core.to_json(obj) + b"\n"


def saved_options(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A placement options spec as written to disk: `env` becomes the sorted `env_names`."""
    saved = {key: value for key, value in spec.items() if key != "env"}
    saved["env_names"] = sorted(spec.get("env") or ())
    return saved


def encode_header(
    *,
    session_id: str,
    parent_ids: Sequence[str],
    operator: str,
    placement: str | None,
    agent_rows: Sequence[ChunkRow],
    placement_options: Mapping[str, Any] | None = None,
    producer: Mapping[str, Any] | None = None,
) -> bytes:
    """The first line of a session file (`placement_options` is written without env values;
    `producer` is a `treadle.persist.producer.producer_record`)."""
    header: dict[str, Any] = {
        "type": "header",
        "schema": SCHEMA_VERSION,
        "session_id": session_id,
        "parent_ids": list(parent_ids),
        "operator": operator,
        "created_at": time.time(),
        "placement": placement,
    }
    if placement_options is not None:
        header["placement_options"] = saved_options(placement_options)
    if producer is not None:
        header["producer"] = dict(producer)
    header["agent_rows"] = [row.to_message() for row in agent_rows]
    return _line(header)


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
