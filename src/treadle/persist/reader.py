"""`load_session`: read a JSONL session file back into a resumable `Session`.

A file without a trailer (the pass crashed or was cancelled) loads with `closed=False`. Only a
final segment without a newline is torn (the writer died mid-line) and ignored; a complete,
newline-terminated line that is not JSON is damage and raises `PersistenceError`, wherever it is.
Tool calls recorded as intents without a result are reported, so a resume can treat them as of
unknown outcome. Tool results are written as they finish, so the results of one round are put
back in call order. The trailer's `pending_approvals` and `interrupt_reason` come back on the
session's metadata. This module reads files synchronously: call it off the loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic_core

from treadle.errors import ConfigurationError, PersistenceError
from treadle.persist.format import SCHEMA_VERSION
from treadle.session import ChunkRow, ChunkTable, Session, SessionData, Usage
from treadle.session.placement import SandboxHandle
from treadle.session.rows import in_call_order

__all__ = ["LoadedSession", "load_session"]


@dataclass(frozen=True, slots=True)
class LoadedSession:
    """What a session file holds."""

    session: Session
    """The transcript (input rows plus every row the pass wrote); resumable."""
    agent: Session
    """The agent session (system prompt) the pass ran with."""
    closed: bool
    """True when the file has a trailer: the pass ended gracefully."""
    stop_reason: str | None
    """The trailer's stop reason (None without a trailer)."""
    path: Path
    """The file read."""
    header: dict[str, Any] = field(default_factory=dict)
    """The header line as written."""
    pending_intents: tuple[str, ...] = ()
    """Ids of tool calls that were about to run but have no result row (unknown outcome)."""


#: Trailer metadata a loaded session gets back (what a resume or a human decision needs).
_RESTORED = ("pending_approvals", "interrupt_reason", "budget_message", "cancelled")


def load_session(path: str | os.PathLike[str]) -> LoadedSession:
    """Load a session file written with `persist=True`."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as err:
        raise PersistenceError(f"cannot read session file {p}: {err.strerror}.") from None
    lines = raw.split(b"\n")
    objs: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = pydantic_core.from_json(line)
        except ValueError:
            if i == len(lines) - 1:  # no newline after it: the writer died mid-line (torn)
                break
            raise PersistenceError(
                f"{p}: line {i + 1} is not valid JSON; the file is damaged."
            ) from None
        if not isinstance(obj, dict):
            raise PersistenceError(f"{p}: line {i + 1} is not a JSON object.")
        objs.append(obj)
    if not objs or objs[0].get("type") != "header":
        raise PersistenceError(f"{p} is not a Treadle session file (no header line).")
    header = objs[0]
    if int(header.get("schema", 0)) > SCHEMA_VERSION:
        raise PersistenceError(
            f"{p} was written by a newer Treadle (schema {header.get('schema')}); upgrade Treadle."
        )
    rows: list[ChunkRow] = []
    trailer: dict[str, Any] | None = None
    intents: dict[str, str] = {}
    answered: set[str] = set()
    try:
        for obj in objs[1:]:
            kind = obj.get("type")
            if kind == "row":
                row = ChunkRow(obj["kind"], obj["payload"])
                rows.append(row)
                if row.kind == "tool_result":
                    answered.add(str(row.payload["tool_call_id"]))
            elif kind == "intent":
                intents[str(obj["tool_call_id"])] = str(obj.get("name", ""))
            elif kind == "trailer":
                trailer = obj
        agent_rows = [ChunkRow.from_message(m) for m in header.get("agent_rows", [])]
    except (KeyError, ConfigurationError) as err:
        raise PersistenceError(f"{p}: a row is malformed ({err}).") from None
    usage = Usage()
    if trailer is not None and isinstance(trailer.get("usage"), dict):
        u = trailer["usage"]
        usage = Usage(
            int(u.get("prompt_tokens", 0)),
            int(u.get("completion_tokens", 0)),
            int(u.get("total_tokens", 0)),
            int(u.get("requests", 0)),
        )
    stop_reason = trailer.get("stop_reason") if trailer else None
    pending = tuple(cid for cid in intents if cid not in answered)
    metadata: dict[str, Any] = {"closed": trailer is not None, "path": str(p)}
    written = trailer.get("metadata") if trailer is not None else None
    if isinstance(written, dict):
        for key in _RESTORED:
            if key in written:
                metadata[key] = written[key]
    if pending:
        metadata["unknown_outcome_tool_calls"] = list(pending)
    rows = in_call_order(rows)
    # A resumed pass gets a sandbox of the same placement: the same directory when the user gave
    # one, a fresh temporary workspace for "local" (the old one was removed or orphaned).

    placement = header.get("placement")
    handle = SandboxHandle(placement) if isinstance(placement, str) and placement else None
    session = Session._derive(
        SessionData(ChunkTable(rows), usage, stop_reason, metadata),
        operator="load_session",
        kind="output",
        parents=(),
        sandbox=handle,
        id=str(header.get("session_id") or "") or None,  # the id the pass gave its output
    )
    if handle is not None:
        handle.release()  # the session took its own share; drop the creator's
    agent = Session(agent_rows, operator="load_session", kind="agent")
    return LoadedSession(
        session=session,
        agent=agent,
        closed=trailer is not None,
        stop_reason=stop_reason,
        path=p,
        header=header,
        pending_intents=pending,
    )
