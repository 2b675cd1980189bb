"""The PostgreSQL store's hot path in batches: the reads that start passes and the commits
that end them, many at a time on one connection (see `treadle.stores.batching.Batcher`).

A batch of reads is two queries whatever its size: the heads of every conversation asked for,
then the rows not yet cached. A batch of commits is one statement calling `treadle_commit` once
per pass over arrays of their parameters (one round trip, one server commit, and one set of
parameters to send instead of one per pass), in key order so two processes' batches take their
conversations' locks in the same order. Each call
still checks its own conversation's version, so a batch changes no outcome: a conflict is that
pass's `ConflictError` alone. If a commit fails otherwise (the transaction is then rolled back
for all), or a pass's parameters cannot be sent at all (text no encoding can carry), the batch
is committed again one pass at a time, so only that pass sees the error (a parameter that
cannot be sent is a `StoreError` naming the conversation).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from treadle.errors import StoreError
from treadle.session import ChunkRow
from treadle.stores.batching import OFF_LOOP_ROWS, off_loop
from treadle.stores.records import RowCache, StoredConversation, decode_row, stored_from_head

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = ["COMMIT_CALL", "commit_many", "load_many"]

# Parameters go in binary (`%b`): JSON payloads sent as a text-format array literal would be
# quoted and backslash-escaped by the client and parsed back by the server.

#: One pass's commit (see `postgres_open.COMMIT_FUNCTION`): the new version, or -1 - the
#: version found when the conversation moved.
COMMIT_CALL = "SELECT treadle_commit(%b, %b, %b, %b, %b, %b, %b, %b, %b, %b, %b, %b)"

#: Every pass of a batch: its parameters as arrays (a pass's rows are the slice `lo:hi` of the
#: flat kinds and payloads arrays), evaluated in the arrays' order (sorted by key).
_COMMIT_MANY = (
    "SELECT u.i, treadle_commit(u.pass, u.key, u.base, (%b::text[])[u.lo:u.hi],"
    " (%b::text[])[u.lo:u.hi], u.usage, u.stop, u.meta, u.status, u.agents, u.recorded, u.now)"
    " FROM unnest(%b::int[], %b::text[], %b::text[], %b::bigint[], %b::int[], %b::int[],"
    " %b::text[], %b::text[], %b::text[], %b::text[], %b::text[], %b::bool[],"
    " %b::float8[]) AS u(i, pass, key, base, lo, hi, usage, stop, meta, status, agents,"
    " recorded, now)"
)

_HEADS = (
    "SELECT c.key, c.usage, c.stop_reason, c.metadata, c.parent_key, c.parent_version,"
    " c.created_at, c.version FROM treadle_conversations c WHERE c.key = ANY(%b)"
)
_ROWS = (
    "SELECT r.key, r.kind, r.payload FROM unnest(%b::text[], %b::bigint[], %b::bigint[])"
    " AS t(key, lo, hi) JOIN treadle_rows r ON r.key = t.key AND r.seq >= t.lo"
    " AND r.seq < t.hi ORDER BY r.key, r.seq"
)


async def load_many(
    conn: AsyncConnection[Any], keys: Sequence[str], cache: RowCache
) -> list[StoredConversation]:
    """The committed conversations `keys` (empty for new keys), in two queries; only rows not
    in `cache` are fetched and decoded (off the loop when there are many)."""
    asked = list(dict.fromkeys(keys))
    cur = await conn.execute(_HEADS, (asked,))
    heads = {str(h[0]): tuple(h[1:]) for h in await cur.fetchall()}
    known = {key: cache.get(key, head[5], head[6]) for key, head in heads.items()}
    short = [key for key, head in heads.items() if len(known[key]) < head[6]]
    if short:
        cur = await conn.execute(
            _ROWS, (short, [len(known[k]) for k in short], [heads[k][6] for k in short])
        )
        found = await cur.fetchall()

        def decode() -> dict[str, tuple[ChunkRow, ...]]:
            fetched: dict[str, list[ChunkRow]] = {key: [] for key in short}
            for key, kind, payload in found:
                fetched[key].append(decode_row(kind, payload, key))
            return {key: tuple(rows) for key, rows in fetched.items()}

        # Off the loop by the batch's total: many conversations just under the threshold each
        # would otherwise all be decoded on it, one after another.
        decoded = await off_loop(len(found), decode)
        for key in short:
            known[key] += decoded[key]
            cache.put(key, heads[key][5], known[key])
    return [
        stored_from_head(key, known[key], heads[key]) if key in heads else StoredConversation(key)
        for key in keys
    ]


async def commit_many(
    conn: AsyncConnection[Any], calls: Sequence[tuple[Any, ...]]
) -> list[int | BaseException]:
    """Run the `treadle_commit` calls (their parameters) in one transaction; each one's result,
    or its error when the batch had to be committed one by one."""
    import psycopg

    if len(calls) == 1:
        return [await _commit_alone(conn, calls[0])]
    # The parameter arrays are built, and the rows' arrays dumped to PostgreSQL's binary
    # format, off the loop when the batch's rows are many in all: psycopg would otherwise
    # convert them on the loop inside `execute` (200 passes of 500 rows: a 0.2-0.9 s stall).
    # The dump is UTF-8: only for a connection that speaks it (the store's own always do, see
    # `CONNECT_OPTIONS`); another gets plain lists, which psycopg encodes in its encoding.
    total = sum(len(call[3]) for call in calls)
    dump = total > OFF_LOOP_ROWS and conn.info.encoding == "utf-8"
    params = await off_loop(total, lambda: _arrays(calls, dump=dump))
    if dump:
        conn.adapters.register_dumper(DumpedTextArray, _dumped_dumper())
    try:
        cur = await conn.execute(_COMMIT_MANY, params)
        results: list[int | BaseException] = [0] * len(calls)
        for i, version in await cur.fetchall():
            results[int(i)] = int(version)
        return results
    except (psycopg.Error, UnicodeError):  # a statement failed, or a parameter was unsendable
        if conn.broken or conn.closed:
            raise  # the connection is gone: every commit of the batch failed with it
    # One commit failed and rolled back all (or none was sent): each alone, in order.
    return [await _commit_alone(conn, call) for call in calls]


def _arrays(calls: Sequence[tuple[Any, ...]], *, dump: bool = False) -> tuple[Any, ...]:
    """`_COMMIT_MANY`'s parameters: the flat kinds and payloads, then one array per field; with
    `dump`, the kinds and payloads already in binary (`DumpedTextArray`)."""
    order = sorted(range(len(calls)), key=lambda i: str(calls[i][1]))  # by key: lock order
    kinds: list[str] = []
    payloads: list[str] = []
    columns: list[list[Any]] = [[] for _ in range(13)]
    for i in order:
        call = calls[i]
        lo = len(kinds) + 1  # PostgreSQL arrays count from 1; a slice includes both ends
        kinds += call[3]
        payloads += call[4]
        fields = (i, call[0], call[1], call[2], lo, len(kinds), *call[5:])
        for column, value in zip(columns, fields, strict=True):
            column.append(value)
    if dump and kinds:
        return (DumpedTextArray.of(kinds), DumpedTextArray.of(payloads), *columns)
    return (kinds, payloads, *columns)


class DumpedTextArray:
    """A `text[]` parameter already in PostgreSQL's binary format (dumped by psycopg's own
    dumper, on whichever thread builds it), so `execute` on the loop only copies its bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    @classmethod
    def of(cls, items: list[str]) -> DumpedTextArray:
        """`items` (not empty: an empty array's binary form names no element type) dumped."""
        from psycopg.adapt import PyFormat, Transformer

        dumper = Transformer().get_dumper(items, PyFormat.BINARY)
        return cls(bytes(dumper.dump(items) or b""))


@functools.cache
def _dumped_dumper() -> type:
    """psycopg's dumper of `DumpedTextArray` (made on first use: psycopg is an extra)."""
    from psycopg.adapt import Dumper
    from psycopg.pq import Format

    class DumpedTextArrayDumper(Dumper):
        format = Format.BINARY
        oid = 1009  # text[]

        def dump(self, obj: Any) -> bytes:
            data: bytes = obj.data
            return data

    return DumpedTextArrayDumper


async def _commit_alone(conn: AsyncConnection[Any], call: tuple[Any, ...]) -> int | BaseException:
    """One pass's commit: its version, or its error (raised only when the connection is gone)."""
    import psycopg

    try:
        return await _commit_one(conn, call)
    except psycopg.Error as err:
        if conn.broken or conn.closed:
            raise
        return err
    except UnicodeError as err:  # psycopg could not encode a parameter: nothing was sent
        return StoreError(
            f"the commit of conversation {call[1]!r} cannot be sent to PostgreSQL: {err}."
        )


async def _commit_one(conn: AsyncConnection[Any], call: tuple[Any, ...]) -> int:
    cur = await conn.execute(COMMIT_CALL, call)
    return int(((await cur.fetchone()) or (-1,))[0])
