"""PostgreSQL retention: deleting conversations (`Store.delete`, `Store.prune`) without racing
the commits of passes on them (see `delete_conversations`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = ["PRUNE_CHUNK", "delete_conversations"]

#: How many conversations a prune deletes per transaction (one advisory lock each).
PRUNE_CHUNK = 100


async def delete_conversations(
    conn: AsyncConnection[Any], keys: Sequence[str], before: float | None
) -> list[str]:
    """Delete conversations `keys` (only those still unchanged since `before`, if given) with
    their rows, passes and journal, in the caller's transaction; the keys deleted.

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
    await conn.execute("DELETE FROM treadle_passes WHERE key = ANY(%s)", (ordered,))
    await conn.execute("DELETE FROM treadle_rows WHERE key = ANY(%s)", (ordered,))
    return gone
