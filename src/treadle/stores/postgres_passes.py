"""A PostgreSQL store's pass records (`PostgresPasses`, a base of
`treadle.stores.postgres.PostgresBackend`): a running pass's journal and lease, its settling,
and another process taking a pending pass over. Every write holds the conversation's advisory
lock where it checks the conversation (`_lock`), as the commits do."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from treadle.errors import ConflictError
from treadle.session import ChunkRow
from treadle.stores.backend import JournalEntry
from treadle.stores.pass_records import (
    carried_metadata,
    check_first_write,
    check_pass_key,
    claimed_metadata,
    owner_check,
    owner_metadata,
)
from treadle.stores.postgres_home import PostgresHome
from treadle.stores.postgres_open import DB_NOW
from treadle.stores.postgres_outcome import commit_statement, committing
from treadle.stores.records import (
    RESUMABLE,
    PassRecord,
    conflict_error,
    encode_json,
    journal_record,
    journal_text,
)

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = ["PostgresPasses"]


class PostgresPasses(PostgresHome):
    """Pass records of a PostgreSQL store (see the module docstring)."""

    async def record(
        self,
        pass_id: str,
        key: str,
        version: int,
        agent_rows: Sequence[ChunkRow],
        entries: Sequence[JournalEntry],
        *,
        start: int,
        supersedes: str | None = None,
        born: float | None = None,
    ) -> None:
        """Make a running pass's journal entries durable (one transaction), as its entries
        from `start` on: entries already there are kept, so a write repeated after one whose
        outcome its caller never learned adds nothing twice. Refused (`ConflictError`) once the
        pass's conversation was deleted (see `StoreBackend.record`)."""
        agents = encode_json([r.to_message() for r in agent_rows])

        async def do(conn: AsyncConnection[Any]) -> None:
            async with committing(conn):
                # The owner's lease runs on the server's clock (`DB_NOW`): every machine
                # judges it the same way, whatever its own clock says.
                cur = await conn.execute(
                    f"UPDATE treadle_passes SET updated_at = {DB_NOW} WHERE pass_id = %s",
                    (pass_id,),
                )
                if not cur.rowcount:  # its first write (or its conversation was deleted)
                    await self._first_write(conn, pass_id, key, version, agents, start,
                                            supersedes, born)  # fmt: skip
                if supersedes is not None:  # the resume now holds the pass it took's journal
                    await conn.execute(
                        f"UPDATE treadle_passes SET status = 'resumed', updated_at = {DB_NOW}"
                        " WHERE pass_id = %s AND status = 'running'",
                        (supersedes,),
                    )
                async with conn.cursor() as cur:
                    await cur.executemany(
                        "INSERT INTO treadle_journal (pass_id, seq, entry, kind, body)"
                        " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (pass_id, seq) DO NOTHING",
                        [(pass_id, start + i, *journal_text(e)) for i, e in enumerate(entries)],
                    )

        await self._run(do)

    async def _first_write(
        self,
        conn: AsyncConnection[Any],
        pass_id: str,
        key: str,
        version: int,
        agents: str,
        start: int,
        supersedes: str | None,
        born: float | None,
    ) -> None:
        """Record a pass at its first write (`record`), or refuse a write whose record a
        delete took (`check_first_write`)."""
        cur = await conn.execute(
            "SELECT version, created_at FROM treadle_conversations WHERE key = %s", (key,)
        )
        head = await cur.fetchone()
        found = (None, 0.0) if head is None else (int(head[0]), float(head[1]))
        check_first_write(pass_id, key, version, start, born, found)
        meta = owner_metadata()
        if supersedes is not None:
            cur = await conn.execute(
                "SELECT metadata FROM treadle_passes WHERE pass_id = %s", (supersedes,)
            )
            taken = await cur.fetchone()
            meta = carried_metadata(taken[0] if taken else None, key)
        await conn.execute(
            "INSERT INTO treadle_passes (pass_id, key, status, version, agent_rows,"
            f" metadata, created_at, updated_at) VALUES (%s, %s, 'running', %s, %s, %s,"
            f" {DB_NOW}, {DB_NOW}) ON CONFLICT (pass_id) DO UPDATE SET updated_at = {DB_NOW}",
            (pass_id, key, version, agents, meta),
        )  # the same first write, repeated at once on another connection, may land first

    async def _lock(self, conn: AsyncConnection[Any], key: str) -> int | None:
        """Take the conversation's write lock (to the end of the transaction); its version."""
        await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))
        cur = await conn.execute(
            "SELECT version FROM treadle_conversations WHERE key = %s FOR UPDATE", (key,)
        )
        found = await cur.fetchone()
        return None if found is None else int(found[0])

    async def settle(self, pass_id: str, status: str, *, was: str = "running") -> None:
        """Move a pass from status `was` to `status` (no effect from any other status)."""

        async def do(conn: AsyncConnection[Any]) -> None:
            await commit_statement(
                conn,
                "UPDATE treadle_passes SET status = %s, updated_at = %s WHERE pass_id = %s"
                " AND status = %s",
                (status, time.time(), pass_id, was),
            )

        await self._run(do)

    async def renew(self, pass_id: str) -> None:
        """Renew a running pass's owner lease (its `updated_at`)."""

        async def do(conn: AsyncConnection[Any]) -> None:
            await conn.execute(
                f"UPDATE treadle_passes SET updated_at = {DB_NOW} WHERE pass_id = %s"
                " AND status = 'running'",
                (pass_id,),
            )

        await self._run(do)

    async def claim(self, pass_id: str, key: str) -> PassRecord:
        """Take over a pending pass: its journal, or `ConflictError`."""
        claimed_key = key

        async def do(conn: AsyncConnection[Any]) -> PassRecord:
            async with committing(conn):
                cur = await conn.execute(
                    "SELECT key, status, version, metadata, updated_at,"
                    f" {DB_NOW} FROM treadle_passes WHERE pass_id = %s FOR UPDATE",
                    (pass_id,),
                )
                found = await cur.fetchone()
                check_pass_key(pass_id, found and found[0], claimed_key)
                if found is None or found[1] not in RESUMABLE:
                    raise ConflictError(
                        f"pass {pass_id} is not pending (another process resumed it, or it "
                        "ended); list what is pending with store.pending().",
                        key=found[0] if found else "",
                    )
                key, status, version, meta, updated, now = found
                owner_check(pass_id, key, status, meta, updated, now)
                actual = (await self._lock(conn, key)) or 0
                if actual != version:
                    raise conflict_error(key, int(version), actual, ())
                taken, was = claimed_metadata(meta, key, status)
                # On the server's clock, as a running pass's lease is (`record`, `renew`).
                await conn.execute(
                    "UPDATE treadle_passes SET status = 'running', metadata = %s,"
                    f" updated_at = {DB_NOW} WHERE pass_id = %s",
                    (taken, pass_id),
                )
                cur = await conn.execute(
                    "SELECT entry, kind, body FROM treadle_journal WHERE pass_id = %s ORDER BY seq",
                    (pass_id,),
                )
                return journal_record(await cur.fetchall(), key, was)

        return await self._run(do)
