"""The SQLite store's pass records, as the database thread runs them: a running pass's
journal writes, a resume's takeover, the pending list. Kept apart from `treadle.stores.sqlite`
(the backend's calls) so each stays readable; every job here runs on the database thread.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence

from treadle.errors import ConflictError
from treadle.stores.backend import JournalEntry
from treadle.stores.pass_records import (
    carried_metadata,
    check_first_write,
    check_pass_key,
    claimed_metadata,
    owner_check,
    owner_metadata,
    pending_list,
)
from treadle.stores.records import (
    RESUMABLE,
    PassRecord,
    PendingPass,
    conflict_error,
    journal_record,
    journal_text,
)
from treadle.stores.sqlite_writes import head_of, version_of

__all__ = ["claim_job", "pending_job", "record_job"]


def record_job(
    pass_id: str,
    key: str,
    version: int,
    agents: str,
    entries: Sequence[JournalEntry],
    start: int,
    supersedes: str | None,
    born: float | None = None,
) -> Callable[[sqlite3.Connection], None]:
    """`SqliteBackend.record`'s transaction (see `StoreBackend.record`)."""

    def do(conn: sqlite3.Connection) -> None:
        now = time.time()
        if not conn.execute(
            "UPDATE passes SET updated_at = ? WHERE pass_id = ?", (now, pass_id)
        ).rowcount:
            check_first_write(pass_id, key, version, start, born, head_of(conn, key))
            meta = owner_metadata()
            if supersedes is not None:
                taken = conn.execute(
                    "SELECT metadata FROM passes WHERE pass_id = ?", (supersedes,)
                ).fetchone()
                meta = carried_metadata(taken[0] if taken else None, key)
            conn.execute(
                "INSERT INTO passes (pass_id, key, status, version, agent_rows, metadata,"
                " created_at, updated_at) VALUES (?, ?, 'running', ?, ?, ?, ?, ?)",
                (pass_id, key, version, agents, meta, now, now),
            )
        if supersedes is not None:  # the resume now holds the journal of the pass it took
            conn.execute(
                "UPDATE passes SET status = 'resumed', updated_at = ? WHERE pass_id = ?"
                " AND status = 'running'",
                (now, supersedes),
            )
        conn.executemany(
            "INSERT INTO journal (pass_id, seq, entry, kind, body) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (pass_id, seq) DO NOTHING",
            [(pass_id, start + i, *journal_text(e)) for i, e in enumerate(entries)],
        )

    return do


def claim_job(pass_id: str, claimed_key: str) -> Callable[[sqlite3.Connection], PassRecord]:
    """`SqliteBackend.claim`'s transaction (see `StoreBackend.claim`)."""

    def do(conn: sqlite3.Connection) -> PassRecord:
        found = conn.execute(
            "SELECT key, status, version, metadata, updated_at FROM passes WHERE pass_id = ?",
            (pass_id,),
        ).fetchone()
        check_pass_key(pass_id, found and found[0], claimed_key)
        if found is None or found[1] not in RESUMABLE:
            raise ConflictError(
                f"pass {pass_id} is not pending (another process resumed it, or it ended); "
                "list what is pending with store.pending().",
                key=found[0] if found else "",
            )
        key, status, version, meta, updated = found
        owner_check(pass_id, key, status, meta, updated)
        actual = version_of(conn, key) or 0
        if actual != version:
            raise conflict_error(key, version, actual, ())
        taken, was = claimed_metadata(meta, key, status)
        conn.execute(
            "UPDATE passes SET status = 'running', metadata = ?, updated_at = ? WHERE pass_id = ?",
            (taken, time.time(), pass_id),
        )
        entries = conn.execute(
            "SELECT entry, kind, body FROM journal WHERE pass_id = ? ORDER BY seq", (pass_id,)
        ).fetchall()
        return journal_record(entries, key, was)

    return do


def pending_job(key: str | None) -> Callable[[sqlite3.Connection], list[PendingPass]]:
    """`SqliteBackend.pending`'s query (see `StoreBackend.pending`)."""

    def do(conn: sqlite3.Connection) -> list[PendingPass]:
        where = "AND p.key = ?" if key is not None else ""
        found = conn.execute(
            "SELECT p.pass_id, p.key, p.status, p.version, p.updated_at, p.metadata,"
            " p.agent_rows FROM passes p LEFT JOIN conversations c ON c.key = p.key"
            " WHERE p.status IN ('running', 'interrupted', 'cancelled', 'failed')"
            f" AND p.version = coalesce(c.version, 0) {where} ORDER BY p.updated_at",
            (key,) if key is not None else (),
        ).fetchall()
        return pending_list(found, key)

    return do
