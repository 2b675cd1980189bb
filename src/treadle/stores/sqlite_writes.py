"""The SQLite store's writes, as the database thread runs them: a commit's job, the rows'
inserts, the head's moves, deletes. Kept apart from `treadle.stores.sqlite` (the backend's
calls) so each stays readable; every function here runs on the database thread.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from treadle.session import ChunkRow, Usage
from treadle.stores.records import (
    KEPT_METADATA,
    RowCache,
    encode_json,
    encode_usage,
    rows_text,
)
from treadle.stores.sqlite_heads import Head, HeadCache

__all__ = [
    "INSERT_ROW",
    "ORPHAN_KEYS",
    "UPDATE_HEAD",
    "UPDATE_HEAD_MOVED",
    "StoreConnection",
    "advance",
    "commit_job",
    "delete_keys",
    "head_of",
    "insert_rows",
    "row_params",
    "version_of",
]


class StoreConnection(sqlite3.Connection):
    """The database thread's connection (`sqlite3.connect(..., factory=StoreConnection)`), with
    one cursor kept for a commit's statements: `Connection.execute` makes a new cursor for each
    call, registers it with the connection and frees it again (about 1,200 instructions a
    statement; a turn's commit runs two)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept = self.cursor()
        """The kept cursor: for statements that return no rows to fetch later (the next
        statement on it resets the last)."""


def version_of(conn: sqlite3.Connection, key: str) -> int | None:
    """The conversation's version as stored (None: no such conversation)."""
    found = conn.execute("SELECT version FROM conversations WHERE key = ?", (key,)).fetchone()
    return None if found is None else int(found[0])


def head_of(conn: sqlite3.Connection, key: str) -> tuple[int | None, float]:
    """The conversation's version and `created_at` as stored ((None, 0.0): none)."""
    found = conn.execute(
        "SELECT version, created_at FROM conversations WHERE key = ?", (key,)
    ).fetchone()
    return (None, 0.0) if found is None else (int(found[0]), float(found[1]))


def insert_rows(
    conn: sqlite3.Connection, key: str, start: int, rows: Sequence[ChunkRow], pass_id: str | None
) -> None:
    """Insert `rows` as the conversation's rows from `start` on."""
    conn.executemany(INSERT_ROW, row_params(key, start, rows, pass_id))


#: One row of a conversation.
INSERT_ROW = "INSERT INTO rows (key, seq, pass_id, kind, payload) VALUES (?, ?, ?, ?, ?)"

#: A commit's move of an existing conversation's head (the statement text is built once).
UPDATE_HEAD = (
    "UPDATE conversations SET version = ?, updated_at = ?, usage = ?, stop_reason = ?,"
    " metadata = ? WHERE key = ?"
)


#: `UPDATE_HEAD` when the stop reason and kept metadata stay as they were.
UPDATE_HEAD_MOVED = "UPDATE conversations SET version = ?, updated_at = ?, usage = ? WHERE key = ?"


def row_params(
    key: str, start: int, rows: Sequence[ChunkRow], pass_id: str | None
) -> list[tuple[str, int, str | None, str, str]]:
    """The `INSERT_ROW` parameters of `rows` from `start` on."""
    return [(key, start + i, pass_id, k, p) for i, (k, p) in enumerate(rows_text(rows))]


def advance(
    conn: sqlite3.Connection,
    key: str,
    found: int | None,
    version: int,
    now: float,
    **fields: Any,
) -> None:
    """Move the conversation row to `version` (creating it at a new key)."""
    if found is None:
        conn.execute(
            "INSERT INTO conversations (key, version, usage, stop_reason, metadata, parent_key,"
            " parent_version, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                key,
                version,
                fields.get("usage", encode_usage(Usage())),
                fields.get("stop_reason"),
                fields.get("metadata", "{}"),
                fields.get("parent_key"),
                fields.get("parent_version"),
                now,
                now,
            ),
        )
        return
    sets = ", ".join(f"{name} = ?" for name in fields)
    conn.execute(
        f"UPDATE conversations SET version = ?, updated_at = ?{', ' if sets else ''}{sets} "
        "WHERE key = ?",
        (version, now, *fields.values(), key),
    )


def commit_job(
    cache: RowCache,
    heads: HeadCache,
    pass_id: str,
    key: str,
    base: int,
    rows: Sequence[ChunkRow],
    usage: Usage,
    stop_reason: str | None,
    metadata: Mapping[str, Any],
    agent_rows: Sequence[ChunkRow],
    recorded: bool,
    born: float | None = None,
) -> Callable[[sqlite3.Connection], int]:
    """The database thread's side of a commit: the new version, or `-1 - found` when the
    conversation is at version `found`, not `base`, or is not the one the pass read (its
    `created_at` is not `born`; 0.0: there was none; None: not checked), or the pass's record
    is gone (its conversation was deleted while it ran): a conflict."""
    # Most passes keep nothing for the next one: no encoder call for an empty object.
    kept = "{}"
    if metadata:
        kept = encode_json({k: metadata[k] for k in KEPT_METADATA if k in metadata})
    status = "interrupted" if stop_reason == "interrupted" else "done"
    # Only a pass that leaves a new record needs its agent rows encoded (most passes do not;
    # a recorded pass's record holds them already).
    keep_record = recorded or status != "done"
    # A pass that read the conversation (`born`) and recorded itself has its record (unless a
    # delete took it): settled in place, which fails when it is gone.
    settle_only = recorded and born is not None
    agents = (
        encode_json([r.to_message() for r in agent_rows]) if keep_record and not settle_only else ""
    )
    # Encoded before the job: the database thread's work is every writer's wait (the
    # rows are encoded there: a large commit must not hold the loop).
    usage_text = encode_usage(usage)

    def do(conn: sqlite3.Connection) -> int:
        # Outside a transaction each statement would commit on its own (a torn commit).
        assert conn.in_transaction
        now = time.time()
        head = heads.get(key)
        if head is not None:
            found: int | None = head.version
            created = head.created_at
        else:
            found, created = head_of(conn, key)
        # The version alone is not the conversation: one deleted and started again under the
        # same key may be back at it (ABA); its `created_at` (in the same head) tells them apart.
        if (found or 0) != base or (born is not None and created != born):
            conn.execute(
                "UPDATE passes SET status = 'conflict', updated_at = ? WHERE pass_id = ?",
                (now, pass_id),
            )
            return -1 - (found or 0)  # kept: the pass's conflict status
        version = base + len(rows)
        if settle_only:
            # Its record is there unless a delete (or prune) took it with its conversation
            # while the pass ran: then nothing of the pass may land (the same one statement
            # its settling always took, moved before the rows).
            if not conn.execute(
                "UPDATE passes SET status = ?, version = ?, metadata = ?, updated_at = ?"
                " WHERE pass_id = ?",
                (status, version, kept, now, pass_id),
            ).rowcount:
                return -1 - (found or 0)
            conn.execute("DELETE FROM journal WHERE pass_id = ?", (pass_id,))
        elif keep_record:  # a pass that kept nothing pending needs no record
            conn.execute(
                "INSERT INTO passes (pass_id, key, status, version, agent_rows, metadata,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT"
                " (pass_id) DO UPDATE SET status = excluded.status, version ="
                " excluded.version, metadata = excluded.metadata, updated_at ="
                " excluded.updated_at",
                (pass_id, key, status, version, agents, kept, now, now),
            )
            if recorded:
                conn.execute("DELETE FROM journal WHERE pass_id = ?", (pass_id,))
        # The thread's kept cursor, when it has one (`StoreConnection`): `Connection.execute`
        # makes, registers and frees a cursor a statement.
        run = conn.kept if isinstance(conn, StoreConnection) else conn
        # `row_params` inline (a turn's commit is this thread's most frequent job): each row's
        # wire JSON is the one its model request encoded and cached.
        numbered = enumerate(rows, base)
        run.executemany(
            INSERT_ROW,
            [(key, seq, pass_id, r.kind, r.message_json().decode()) for seq, r in numbered],
        )
        if found is None:
            advance(
                conn, key, found, version, now,
                usage=usage_text, stop_reason=stop_reason, metadata=kept,
            )  # fmt: skip
        elif head is not None and head.stop_reason == stop_reason and head.metadata == kept:
            # Most turns end as the one before (same stop reason, nothing kept): two text
            # parameters fewer (a bound text is a copy SQLite allocates: about 1,900
            # instructions a commit with the statement's shorter work).
            run.execute(UPDATE_HEAD_MOVED, (version, now, usage_text, key))
        else:
            run.execute(UPDATE_HEAD, (version, now, usage_text, stop_reason, kept, key))
        if found is None:
            cache.put(key, now, tuple(rows))
            heads.put(key, Head(usage, stop_reason, kept, None, None, now, version))
        else:
            cache.extend(key, base, rows)
            if head is not None:  # moved in place: a new `Head` was a Python __init__ a turn
                head.usage, head.stop_reason, head.metadata = usage, stop_reason, kept
                head.version = version
        return version

    return do


def delete_keys(conn: sqlite3.Connection, keys: Sequence[str]) -> int:
    """Delete the conversations `keys` with their rows, and every pass record and journal of
    those keys (also of passes that never committed: a first turn cancelled on a new key holds
    its user's text there alone); how many keys held anything."""
    gone = 0
    for key in keys:
        conn.execute(
            "DELETE FROM journal WHERE pass_id IN (SELECT pass_id FROM passes WHERE key = ?)",
            (key,),
        )
        passes = conn.execute("DELETE FROM passes WHERE key = ?", (key,)).rowcount
        conn.execute("DELETE FROM rows WHERE key = ?", (key,))
        heads = conn.execute("DELETE FROM conversations WHERE key = ?", (key,)).rowcount
        gone += bool(heads or passes)
    return gone


#: Keys whose only data are pass records not changed since a time: passes that never committed
#: (a first turn cancelled or failed on a new key), which no conversation's age covers.
ORPHAN_KEYS = (
    "SELECT p.key FROM passes p WHERE NOT EXISTS (SELECT 1 FROM conversations c"
    " WHERE c.key = p.key) GROUP BY p.key HAVING max(p.updated_at) < ?"
)
