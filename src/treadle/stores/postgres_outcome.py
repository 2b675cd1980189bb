"""A PostgreSQL write's commit, and what a connection lost during it means (`committing`,
`commit_statement`): once the commit is sent (a transaction's COMMIT, or an autocommit
statement that is the whole write) the server may have committed it before the connection
ended, so the write's caller gets `WriteOutcomeUnknown` (it may have landed), never a plain
failure a retry would write twice. A connection lost before the commit was sent is a plain
failure (the server rolls the transaction back). A server error with the connection still
open (a cancel, a failed check) is a plain failure too: the server answered, nothing landed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from treadle.errors import WriteOutcomeUnknown

if TYPE_CHECKING:
    from psycopg import AsyncConnection, AsyncCursor
    from psycopg.abc import Params

__all__ = ["commit_statement", "committing", "outcome_unknown"]


def outcome_unknown(err: BaseException) -> WriteOutcomeUnknown:
    """The error of a write whose connection ended after its commit was sent."""
    why = " ".join(str(err).split()) or type(err).__name__
    return WriteOutcomeUnknown(
        f"the connection to PostgreSQL ended after this write's commit was sent ({why}); the"
        " server may have committed it or not: read the conversation before writing it again."
    )


def _lost(conn: AsyncConnection[Any]) -> bool:
    return bool(conn.broken or conn.closed)


@asynccontextmanager
async def committing(conn: AsyncConnection[Any]) -> AsyncIterator[None]:
    """`conn.transaction()` for a write: a connection lost while its COMMIT is in flight is
    `WriteOutcomeUnknown`; an error in the block (nothing committed) propagates as it was."""
    import psycopg

    tx = conn.transaction()
    await tx.__aenter__()
    try:
        yield
    except BaseException as err:
        if not await tx.__aexit__(type(err), err, err.__traceback__):
            raise
        return  # pragma: no cover - a transaction never swallows an error
    try:
        await tx.__aexit__(None, None, None)  # sends the COMMIT
    except psycopg.Error as err:
        if _lost(conn):
            raise outcome_unknown(err) from err
        raise


async def commit_statement(
    conn: AsyncConnection[Any], query: str, params: Params | None = None
) -> AsyncCursor[Any]:
    """`conn.execute` of an autocommit statement that is a whole write (its own commit): a
    connection lost once it was sent is `WriteOutcomeUnknown`; one already lost is not."""
    import psycopg

    lost_before = _lost(conn)  # then nothing is sent: psycopg's own error, a plain failure
    try:
        return await conn.execute(query, params)
    except psycopg.Error as err:
        if not lost_before and _lost(conn):
            raise outcome_unknown(err) from err
        raise
