"""PostgreSQL retention: deleting conversations (`Store.delete`, `Store.prune`) without racing
the commits of passes on them (see `delete_conversations`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from treadle.stores.postgres_outcome import committing

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = ["PRUNE_CHUNK", "delete_conversations", "prune_orphans"]

#: How many conversations a prune deletes per transaction (one advisory lock each).
PRUNE_CHUNK = 100


async def delete_conversations(
    conn: AsyncConnection[Any], keys: Sequence[str], before: float | None
) -> list[str]:
    """Delete conversations `keys` (only those still unchanged since `before`, if given) with
    their rows, passes and journal, in the caller's transaction; the keys that held anything
    (without `before`, a key whose only data were records of passes that never committed
    counts too: a first turn cancelled on a new key leaves its user's text there).

    Each conversation's advisory lock is taken first, in key order, as a commit takes it: a
    commit in flight finishes before its conversation is deleted, and one that comes after
    finds the conversation gone (a conflict), so no rows outlive their head."""
    ordered = sorted(set(keys))
    for key in ordered:
        await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))
    age = "" if before is None else " AND updated_at < %s"
    cur = await conn.execute(
        f"DELETE FROM treadle_conversations WHERE key = ANY(%s){age} RETURNING key",
        (ordered,) if before is None else (ordered, before),
    )
    gone = [str(k) for (k,) in await cur.fetchall()]
    if before is not None:
        ordered = gone  # a conversation changed since the first look is kept, whole
    await conn.execute(
        "DELETE FROM treadle_journal WHERE pass_id IN"
        " (SELECT pass_id FROM treadle_passes WHERE key = ANY(%s))",
        (ordered,),
    )
    cur = await conn.execute(
        "DELETE FROM treadle_passes WHERE key = ANY(%s) RETURNING key", (ordered,)
    )
    had = {str(k) for (k,) in await cur.fetchall()}
    await conn.execute("DELETE FROM treadle_rows WHERE key = ANY(%s)", (ordered,))
    return sorted({*gone, *had})


#: Keys whose only data are records of passes that never committed (a first turn cancelled or
#: failed on a new key), none changed since a time.
_ORPHAN_KEYS = (
    "SELECT p.key FROM treadle_passes p WHERE NOT EXISTS (SELECT 1 FROM treadle_conversations c"
    " WHERE c.key = p.key) GROUP BY p.key HAVING max(p.updated_at) < %s ORDER BY p.key"
)

#: Those keys' records and journal, checked again under their locks (a pass that wrote or
#: committed since the first look keeps its key).
_DELETE_ORPHANS = (
    "WITH gone AS (DELETE FROM treadle_passes p WHERE p.key = ANY(%s) AND NOT EXISTS"
    " (SELECT 1 FROM treadle_conversations c WHERE c.key = p.key) AND NOT EXISTS"
    " (SELECT 1 FROM treadle_passes q WHERE q.key = p.key AND q.updated_at >= %s)"
    " RETURNING p.pass_id, p.key), journal AS (DELETE FROM treadle_journal"
    " WHERE pass_id IN (SELECT pass_id FROM gone)) SELECT DISTINCT key FROM gone"
)


async def prune_orphans(conn: AsyncConnection[Any], before: float) -> int:
    """Delete the records and journal of passes that never committed on keys without a
    conversation, none changed since `before` (`Store.prune`); how many keys. In chunks of
    `PRUNE_CHUNK` keys, each chunk's locks taken in key order as `delete_conversations` does."""
    cur = await conn.execute(_ORPHAN_KEYS, (before,))
    candidates = [str(k) for (k,) in await cur.fetchall()]
    gone = 0
    for at in range(0, len(candidates), PRUNE_CHUNK):
        chunk = candidates[at : at + PRUNE_CHUNK]
        async with committing(conn):
            for key in chunk:
                await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))
            cur = await conn.execute(_DELETE_ORPHANS, (chunk, before))
            gone += len(await cur.fetchall())
    return gone
