"""The PostgreSQL store's hot path in batches: the reads that start passes and the commits
that end them, many at a time on one connection (see `treadle.stores.batching.Batcher`).

A batch of reads is two queries whatever its size: the heads of every conversation asked for,
then the rows not yet cached. A batch of commits is one statement calling `treadle_commit` once
per pass over one JSON parameter holding every pass's parameters (one round trip, one server
commit, and one value to send, encoded by pydantic-core in one call instead of thirteen arrays
converted element by element in Python), in key order so two processes' batches take their
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

import pydantic_core

from treadle.errors import StoreError
from treadle.session import ChunkRow
from treadle.stores.batching import off_loop
from treadle.stores.records import RowCache, StoredConversation, decode_row, stored_from_head

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = ["COMMIT_CALL", "commit_many", "load_many"]

# Parameters go in binary (`%b`): JSON payloads sent as a text-format array literal would be
# quoted and backslash-escaped by the client and parsed back by the server.

#: One pass's commit (see `postgres_open.COMMIT_FUNCTION`): the new version, or -1 - the
#: version found when the conversation moved.
COMMIT_CALL = "SELECT treadle_commit(%b, %b, %b, %b, %b, %b, %b, %b, %b, %b, %b, %b)"

#: Every pass of a batch: one JSON array of their parameters (`_batch_json`), one object per
#: pass, evaluated in the array's order (sorted by key). A pass's kinds and payloads are JSON
#: arrays of text, made `text[]` again in their order.
_COMMIT_MANY = (
    "SELECT u.i, treadle_commit(u.pass, u.key, u.base,"
    " ARRAY(SELECT e FROM json_array_elements_text(u.kinds) WITH ORDINALITY AS k(e, o)"
    " ORDER BY o),"
    " ARRAY(SELECT e FROM json_array_elements_text(u.payloads) WITH ORDINALITY AS p(e, o)"
    " ORDER BY o),"
    " u.usage, u.stop, u.meta, u.status, u.agents, u.recorded, u.now)"
    " FROM json_to_recordset(%b::json) AS u(i int, pass text, key text, base bigint,"
    " kinds json, payloads json, usage text, stop text, meta text, status text, agents text,"
    " recorded bool, now float8)"
)

#: The fields of a pass's object in `_COMMIT_MANY`'s parameter, in `COMMIT_CALL`'s order.
_FIELDS = (
    "pass", "key", "base", "kinds", "payloads", "usage", "stop", "meta", "status", "agents",
    "recorded", "now",
)  # fmt: skip

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
        stored_from_head(key, known[key], heads[key], cache.usage(key, heads[key][0]))
        if key in heads
        else StoredConversation(key)
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
    # The batch's one parameter is encoded (pydantic-core, one call) off the loop when its rows
    # are many in all (200 passes of 500 rows must not stall the loop). It goes as UTF-8 bytes
    # to a connection that speaks UTF-8 (the store's own always do, see `CONNECT_OPTIONS`);
    # another gets text, which psycopg encodes in its encoding.
    total = sum(len(call[3]) for call in calls)
    utf8 = conn.info.encoding == "utf-8"
    try:
        param = await off_loop(total, lambda: _batch_json(calls, utf8=utf8))
    except ValueError:  # text JSON cannot carry (a lone surrogate): each alone says whose
        return [await _commit_alone(conn, call) for call in calls]
    if utf8:
        conn.adapters.register_dumper(DumpedJson, _dumped_dumper())
    params = (param,)
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


def _batch_json(calls: Sequence[tuple[Any, ...]], *, utf8: bool = True) -> DumpedJson | str:
    """`_COMMIT_MANY`'s parameter: a JSON array of one object per call, by key (the lock
    order), each with its index in `calls` (`i`); UTF-8 bytes (`DumpedJson`) or text."""
    order = sorted(range(len(calls)), key=lambda i: str(calls[i][1]))  # by key: lock order
    items = [{"i": i, **dict(zip(_FIELDS, calls[i], strict=True))} for i in order]
    data = pydantic_core.to_json(items)
    return DumpedJson(data) if utf8 else data.decode()


class DumpedJson:
    """A `json` parameter already encoded as UTF-8 (off the loop when large): `execute` only
    copies its bytes (the binary form of `json` is its text)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


@functools.cache
def _dumped_dumper() -> type:
    """psycopg's dumper of `DumpedJson` (made on first use: psycopg is an extra)."""
    from psycopg.adapt import Dumper
    from psycopg.pq import Format

    class DumpedJsonDumper(Dumper):
        format = Format.BINARY
        oid = 114  # json

        def dump(self, obj: Any) -> bytes:
            data: bytes = obj.data
            return data

    return DumpedJsonDumper


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
