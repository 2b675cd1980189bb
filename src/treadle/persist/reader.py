"""`load_session`: read a JSONL session file back into a resumable `Session`.

A file without a trailer (the pass crashed or was cancelled) loads with `closed=False`. Only a
final segment without a newline is torn (the writer died mid-line) and ignored; a complete,
newline-terminated line that is not JSON is damage and raises `PersistenceError`, wherever it is.
Tool calls recorded as intents without a result are reported, so a resume can treat them as of
unknown outcome. Tool results are written as they finish, so the results of one round are put
back in call order. The trailer's `pending_approvals` and `interrupt_reason` come back on the
session's metadata. An `Isolated(...)` placement comes back with its saved options; its env
values were never saved, so a box that had any needs them again (`load_session(path, env=...)`).
This module reads files synchronously: call it off the loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic_core

from treadle.errors import ConfigurationError, PersistenceError
from treadle.persist.format import SCHEMA_VERSION
from treadle.session import ChunkRow, ChunkTable, Session, SessionData, Usage
from treadle.session.placement import SandboxHandle
from treadle.session.rows import in_call_order
from treadle.session.stops import StopReason, as_stop_reason

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
    stop_reason: StopReason | None
    """The trailer's stop reason (None without a trailer or an unknown one)."""
    path: Path
    """The file read."""
    header: dict[str, Any] = field(default_factory=dict)
    """The header line as written."""
    pending_intents: tuple[str, ...] = ()
    """Ids of tool calls that were about to run but have no result row (unknown outcome)."""


#: Trailer metadata a loaded session gets back (what a resume or a human decision needs).
_RESTORED = ("pending_approvals", "interrupt_reason", "budget_message", "cancelled")


def _damaged(p: Path, what: str) -> PersistenceError:
    return PersistenceError(f"{p}: {what}; the file is damaged or from a newer Treadle.")


def _placement(p: Path, header: Mapping[str, Any], env: Mapping[str, str]) -> SandboxHandle | None:
    """The sandbox handle the header's placement (and options) describe, env values from `env`."""
    placement = header.get("placement")
    saved = header.get("placement_options")
    if saved is None:
        if env:
            raise PersistenceError(
                f"{p}: env= names {', '.join(sorted(env))}, but the saved session has no "
                "Isolated(env=...) variables."
            )
        return SandboxHandle(placement) if isinstance(placement, str) and placement else None
    if placement != "isolated":
        raise _damaged(
            p, f"the header has placement_options but its placement is {placement!r} (options "
            "apply to only the isolated placement)"
        )  # fmt: skip
    if not isinstance(saved, dict):
        raise _damaged(p, "the header's placement_options is not a JSON object")
    spec = dict(saved)
    if "env" in spec:
        raise _damaged(p, "the header's placement_options hold env values (env values are never "
                       "saved, only env_names)")  # fmt: skip
    names = spec.pop("env_names", None)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _damaged(p, "the header's placement_options env_names must be a list of names")
    missing = [n for n in names if n not in env]
    if missing:
        raise PersistenceError(
            f"{p}: the session's Isolated box had env variables {', '.join(missing)}, whose "
            "values are not saved (they may be secrets); give them back: "
            f"treadle.load_session(path, env={{{', '.join(repr(n) + ': ...' for n in missing)}}})."
        )
    extra = sorted(set(env) - set(names))
    if extra:
        raise PersistenceError(
            f"{p}: env= names {', '.join(extra)}, which the saved Isolated box did not have "
            f"(it had: {', '.join(names) or 'none'})."
        )
    spec["env"] = {name: env[name] for name in names}
    from treadle.sandbox.bwrap import Isolated  # the sandbox layer loads only when one is needed

    try:
        options = Isolated.from_spec(spec)
    except ConfigurationError as err:
        raise _damaged(p, f"the header's placement_options are invalid ({err})") from None
    return SandboxHandle(options)


def load_session(
    path: str | os.PathLike[str],
    *,
    env: Mapping[str, str] | None = None,
    sandbox: bool = True,
) -> LoadedSession:
    """Load a session file written with `persist=True`.

    `env` gives back the values of the `Isolated(env=...)` variables the session's box had (the
    file holds only their names): every saved name, and no other, or `PersistenceError`.
    `sandbox=False` reads the transcript only: the session comes back with no placement (no box
    is prepared, no env values are needed).
    """
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
    stop_reason = as_stop_reason(trailer.get("stop_reason")) if trailer else None
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
    # one, a fresh temporary workspace for "local" (the old one was removed or orphaned), and for
    # "isolated" a fresh box with the saved options.
    handle = _placement(p, header, env or {}) if sandbox else None
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
