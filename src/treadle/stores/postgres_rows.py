"""Rows the PostgreSQL store writes outside a pass's commit (`append`, `fork`): inserted at a
version, with the conversation's head moved to the new version in the same transaction (the
caller holds the conversation's lock; see `PostgresBackend._lock`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from treadle.session import Usage
from treadle.stores.records import encode_usage

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = ["write_rows"]


async def write_rows(
    conn: AsyncConnection[Any],
    key: str,
    found: int | None,
    base: int,
    rows: Sequence[tuple[str, str]],
    pass_id: str | None,
    head: Mapping[str, Any],
) -> int:
    """Insert encoded `(kind, payload)` rows at `base` and move the head."""
    now = time.time()
    async with conn.cursor() as cur:
        await cur.executemany(
            "INSERT INTO treadle_rows (key, seq, pass_id, kind, payload)"
            " VALUES (%s, %s, %s, %s, %s)",
            [(key, base + i, pass_id, k, p) for i, (k, p) in enumerate(rows)],
        )
    version = base + len(rows)
    if found is None:
        await conn.execute(
            "INSERT INTO treadle_conversations (key, version, usage, stop_reason, metadata,"
            " parent_key, parent_version, created_at, updated_at)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                key,
                version,
                head.get("usage", encode_usage(Usage())),
                head.get("stop_reason"),
                head.get("metadata", "{}"),
                head.get("parent_key"),
                head.get("parent_version"),
                now,
                now,
            ),
        )
    else:
        sets = "".join(f", {name} = %s" for name in head)
        await conn.execute(
            f"UPDATE treadle_conversations SET version = %s, updated_at = %s{sets} WHERE key = %s",
            (version, now, *head.values(), key),
        )
    return version
