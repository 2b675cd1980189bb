"""The PostgreSQL store's hot path in batches: the reads that start passes and the commits
that end them, many at a time on one connection (see `treadle.stores.batching.Batcher`).

A batch of reads is two queries whatever its size: the heads of every conversation asked for,
then the rows not yet cached. A conversation whose stored data does not decode is that key's
`StoreError` alone; a read query that fails (a key the database cannot hold) with the connection
still up is run again one key at a time, so only that key sees the error.

A batch of commits is one statement calling `treadle_commit` once
per pass over one JSON parameter holding every pass's parameters (one round trip, one server
commit, and one value to send, encoded by pydantic-core in one call instead of thirteen arrays
converted element by element in Python), in key order so two processes' batches take their
conversations' locks in the same order. Each call
still checks its own conversation's version, so a batch changes no outcome: a conflict is that
pass's `ConflictError` alone. If a commit fails otherwise (the transaction is then rolled back
for all), or a pass's parameters cannot be sent at all (text no encoding can carry), the batch
is committed again one pass at a time, so only that pass sees the error (a parameter that
cannot be sent is a `StoreError` naming the conversation).

A batch is capped by bytes too: passes whose parameters would make more than `BATCH_BYTES` of
JSON go as several statements (each its own transaction, still in key order), and a pass too
large to share one goes alone. PostgreSQL takes at most 1 GB in one message and breaks the
connection on a larger one, so a pass whose commit would need more (`MESSAGE_LIMIT`) fails
alone with a `StoreError` before anything is sent; the other passes of its batch go on.
"""

from __future__ import annotations

import asyncio
import functools
import time
import weakref
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pydantic_core

from treadle.errors import StoreError
from treadle.session import ChunkRow, Usage
from treadle.stores.batching import off_loop
from treadle.stores.postgres_outcome import commit_statement
from treadle.stores.records import (
    KEPT_METADATA,
    RowCache,
    StoredConversation,
    decode_row,
    encode_json,
    encode_usage,
    stored_from_head,
)

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = [
    "BATCH_BYTES", "COMMIT_CALL", "MESSAGE_LIMIT", "commit_call", "commit_many", "commit_task",
    "load_many",
]  # fmt: skip

# Parameters go in binary (`%b`): JSON payloads sent as a text-format array literal would be
# quoted and backslash-escaped by the client and parsed back by the server.

#: The most bytes of JSON one batch statement sends: passes ending together that would make
#: more go as several statements (a batch's cost is in its passes, not its bytes, long before
#: this; the server parses the whole parameter in memory).
BATCH_BYTES = 64 * 1024 * 1024

#: The most bytes one commit may send: PostgreSQL refuses a message over 1 GB (and breaks the
#: connection), less room for the statement and the message's framing.
MESSAGE_LIMIT = (1 << 30) - (1 << 20)

#: One pass's commit (see `postgres_open.COMMIT_FUNCTION`): the new version, or -1 - the
#: version found when the conversation moved.
COMMIT_CALL = "SELECT treadle_commit(%b, %b, %b, %b, %b, %b, %b, %b, %b, %b, %b, %b, %b)"

#: Every pass of a batch: one JSON array of their parameters (`_batch_json`), one object per
#: pass, evaluated in the array's order (sorted by key). A pass's kinds and payloads are JSON
#: arrays of text, made `text[]` again in their order.
_COMMIT_MANY = (
    "SELECT u.i, treadle_commit(u.pass, u.key, u.base,"
    " ARRAY(SELECT e FROM json_array_elements_text(u.kinds) WITH ORDINALITY AS k(e, o)"
    " ORDER BY o),"
    " ARRAY(SELECT e FROM json_array_elements_text(u.payloads) WITH ORDINALITY AS p(e, o)"
    " ORDER BY o),"
    " u.usage, u.stop, u.meta, u.status, u.agents, u.recorded, u.now, u.born)"
    " FROM json_to_recordset(%b::json) AS u(i int, pass text, key text, base bigint,"
    " kinds json, payloads json, usage text, stop text, meta text, status text, agents text,"
    " recorded bool, now float8, born float8)"
)

#: The fields of a pass's object in `_COMMIT_MANY`'s parameter, in `COMMIT_CALL`'s order.
_FIELDS = (
    "pass", "key", "base", "kinds", "payloads", "usage", "stop", "meta", "status", "agents",
    "recorded", "now", "born",
)  # fmt: skip

#: The heads of the keys of one JSON array (encoded by pydantic-core in one call: a `text[]`
#: parameter is dumped by psycopg element by element in Python).
_HEADS = (
    "SELECT c.key, c.usage, c.stop_reason, c.metadata, c.parent_key, c.parent_version,"
    " c.created_at, c.version FROM treadle_conversations c"
    " WHERE c.key IN (SELECT json_array_elements_text(%b::json))"
)
_ROWS = (
    "SELECT r.key, r.kind, r.payload FROM unnest(%b::text[], %b::bigint[], %b::bigint[])"
    " AS t(key, lo, hi) JOIN treadle_rows r ON r.key = t.key AND r.seq >= t.lo"
    " AND r.seq < t.hi ORDER BY r.key, r.seq"
)


def commit_call(
    pass_id: str,
    key: str,
    base: int,
    rows: Sequence[ChunkRow],
    encoded: Sequence[tuple[str, str]],
    usage: Usage,
    stop_reason: str | None,
    metadata: Mapping[str, Any],
    agent_rows: Sequence[ChunkRow],
    recorded: bool,
    born: float | None = None,
) -> tuple[Any, ...]:
    """A pass's commit as a request of the batched commits: `COMMIT_CALL`'s parameters, then
    its rows and usage (for the row cache once it landed). `encoded`: the rows' text; `born`:
    the read conversation's `created_at` (see `StoreBackend.commit`)."""
    kept = encode_json({k: metadata[k] for k in KEPT_METADATA if k in metadata})
    status = "interrupted" if stop_reason == "interrupted" else "done"
    # Only a pass that leaves a new record needs its agent rows (treadle_commit's own test;
    # a recorded pass's record holds them already).
    new_record = (recorded or status != "done") and not (recorded and born is not None)
    agents = encode_json([r.to_message() for r in agent_rows]) if new_record else ""
    return (
        pass_id, key, base, [k for k, _ in encoded], [p for _, p in encoded],
        encode_usage(usage), stop_reason, kept, status, agents, recorded, time.time(), born,
        (rows, usage),
    )  # fmt: skip


#: Commit tasks of `commit_task` while they run (a task needs a strong reference).
_TASKS: set[asyncio.Task[int]] = set()


def commit_task(
    commit: Coroutine[Any, Any, int], then: Callable[[int | BaseException], None]
) -> None:
    """Run `commit` as a task and hand its outcome to `then`: a `commit_soon` that must await
    first. A task cancelled (a shutdown cancelling every task) hands over `CancelledError`, as
    the journal's own commit task would end."""

    def done(task: asyncio.Task[int]) -> None:
        _TASKS.discard(task)
        if task.cancelled():
            then(asyncio.CancelledError())
        else:
            error = task.exception()
            then(error if error is not None else task.result())

    task = asyncio.ensure_future(commit)
    _TASKS.add(task)
    task.add_done_callback(done)


async def load_many(
    conn: AsyncConnection[Any], keys: Sequence[str], cache: RowCache
) -> list[StoredConversation | BaseException]:
    """The committed conversations `keys` (empty for new keys), in two queries; only rows not
    in `cache` are fetched and decoded (off the loop when there are many). A key whose stored
    data is damaged gets its `StoreError` alone. If the batch's query fails (a key the database
    cannot hold, say) and the connection is still there, the keys are read again one at a time,
    so only the failing key gets the error (a `psycopg.Error`, or a `StoreError`)."""
    import psycopg

    try:
        return await _load_batch(conn, keys, cache)
    except psycopg.Error:
        if conn.broken or conn.closed or len(set(keys)) < 2:
            raise  # the connection is gone (every read failed with it), or the key was alone
    except UnicodeError:  # a key psycopg could not encode: nothing was sent
        pass
    alone: dict[str, StoredConversation | BaseException] = {}
    for key in dict.fromkeys(keys):
        try:
            alone[key] = (await _load_batch(conn, [key], cache))[0]
        except psycopg.Error as err:
            if conn.broken or conn.closed:
                raise
            alone[key] = err
        except UnicodeError as err:  # psycopg could not encode the key: nothing was sent
            alone[key] = StoreError(f"conversation {key!r} cannot be read from PostgreSQL: {err}.")
    return [alone[key] for key in keys]


async def _load_batch(
    conn: AsyncConnection[Any], keys: Sequence[str], cache: RowCache
) -> list[StoredConversation | BaseException]:
    """`load_many`'s two queries for `keys`; a query that fails raises."""
    asked = list(dict.fromkeys(keys))
    cur = await conn.execute(_HEADS, (_json_param(conn, asked),))
    heads = {str(h[0]): tuple(h[1:]) for h in await cur.fetchall()}
    known = {key: cache.get(key, head[5], head[6]) for key, head in heads.items()}
    bad: dict[str, StoreError] = {}  # keys whose stored rows do not decode: their error alone
    short = [key for key, head in heads.items() if len(known[key]) < head[6]]
    if short:
        cur = await conn.execute(
            _ROWS, (short, [len(known[k]) for k in short], [heads[k][6] for k in short])
        )
        found = await cur.fetchall()

        def decode() -> dict[str, tuple[ChunkRow, ...] | StoreError]:
            fetched: dict[str, list[ChunkRow] | StoreError] = {key: [] for key in short}
            for key, kind, payload in found:
                rows = fetched[key]
                if isinstance(rows, list):
                    try:
                        rows.append(decode_row(kind, payload, key))
                    except StoreError as err:
                        fetched[key] = err
            return {k: v if isinstance(v, StoreError) else tuple(v) for k, v in fetched.items()}

        # Off the loop by the batch's total: many conversations just under the threshold each
        # would otherwise all be decoded on it, one after another.
        decoded = await off_loop(len(found), decode)
        for key in short:
            rows = decoded[key]
            if isinstance(rows, StoreError):
                bad[key] = rows
                continue
            known[key] += rows
            cache.put(key, heads[key][5], known[key])
    return [_stored(key, known, heads, cache, bad) for key in keys]


def _stored(
    key: str,
    known: Mapping[str, tuple[ChunkRow, ...]],
    heads: Mapping[str, tuple[Any, ...]],
    cache: RowCache,
    bad: Mapping[str, StoreError],
) -> StoredConversation | BaseException:
    """`key`'s conversation from its head and rows, or its own error (damaged data)."""
    if key in bad:
        return bad[key]
    if key not in heads:
        return StoredConversation(key)
    try:
        return stored_from_head(key, known[key], heads[key], cache.usage(key, heads[key][0]))
    except StoreError as err:  # its usage or metadata do not decode
        return err


async def commit_many(
    conn: AsyncConnection[Any], calls: Sequence[tuple[Any, ...]]
) -> list[int | BaseException]:
    """Run the `treadle_commit` calls (their parameters) in as few statements as `BATCH_BYTES`
    allows (one, but for very large passes); each one's result, or its error (a statement that
    failed is committed again one pass at a time)."""
    if len(calls) == 1:
        return [await _commit_alone(conn, calls[0])]
    chars = [_chars(call) for call in calls]
    order = sorted(range(len(calls)), key=lambda i: str(calls[i][1]))  # by key: lock order
    groups: list[list[int]] = []
    size = BATCH_BYTES + 1
    for i in order:  # packed by each pass's most JSON bytes: no statement passes the cap
        most = _json_bound(chars[i], len(calls[i][3]))
        if most > BATCH_BYTES or size + most > BATCH_BYTES:  # a huge one goes alone
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += most
    results: list[int | BaseException] = [0] * len(calls)
    for n, group in enumerate(groups):
        try:
            await _commit_group(conn, calls, group, chars, results)
        except Exception as err:  # the connection is gone: the groups not yet done fail
            if n == 0:
                raise
            for i in (i for rest in groups[n:] for i in rest):
                results[i] = err
            break
    return results


async def _commit_group(
    conn: AsyncConnection[Any],
    calls: Sequence[tuple[Any, ...]],
    group: Sequence[int],
    chars: Sequence[int],
    results: list[int | BaseException],
) -> None:
    """One statement for the calls `group` (indices in `calls`, in key order): their results
    into `results`."""
    import psycopg

    if len(group) == 1:
        results[group[0]] = await _commit_alone(conn, calls[group[0]], chars[group[0]])
        return
    # The statement's one parameter is encoded (pydantic-core, one call) off the loop when its
    # rows are many or its text large in all (200 passes of 500 rows, or two of 2 MB, must not
    # stall the loop). It goes as UTF-8 bytes to a connection that speaks UTF-8 (the store's
    # own always do, see `CONNECT_OPTIONS`); another gets text, which psycopg encodes.
    rows = sum(len(calls[i][3]) for i in group)
    utf8 = _utf8(conn)
    try:
        param = await off_loop(
            rows, lambda: _batch_json(calls, utf8=utf8, order=group),
            chars=sum(chars[i] for i in group),
        )  # fmt: skip
    except ValueError:  # text JSON cannot carry (a lone surrogate): each alone says whose
        for i in group:
            results[i] = await _commit_alone(conn, calls[i], chars[i])
        return
    try:
        cur = await commit_statement(conn, _COMMIT_MANY, (param,))
        for i, version in await cur.fetchall():
            results[int(i)] = int(version)
        return
    except (psycopg.Error, UnicodeError):  # a statement failed, or a parameter was unsendable
        if conn.broken or conn.closed:
            raise  # the connection is gone: every commit of the batch failed with it
    # One commit failed and rolled back its statement (or none was sent): each alone, in order.
    for i in group:
        results[i] = await _commit_alone(conn, calls[i], chars[i])


def _chars(call: tuple[Any, ...]) -> int:
    """Characters of a commit's text parameters: key, payloads, usage, metadata, agent rows."""
    return len(call[1]) + sum(map(len, call[4])) + len(call[5]) + len(call[7]) + len(call[9])


def _json_bound(chars: int, rows: int) -> int:
    """The most bytes a commit takes in a batch's JSON: six per character (an escaped control
    character; UTF-8 takes at most four), a row's kind and punctuation, the fields."""
    return 6 * chars + 32 * rows + 512


def _batch_json(
    calls: Sequence[tuple[Any, ...]], *, utf8: bool = True, order: Sequence[int] | None = None
) -> DumpedJson | str:
    """`_COMMIT_MANY`'s parameter: a JSON array of one object per call (those of `order`, or
    all by key: the lock order), each with its index in `calls` (`i`); UTF-8 bytes
    (`DumpedJson`) or text."""
    if order is None:
        order = sorted(range(len(calls)), key=lambda i: str(calls[i][1]))
    items = [{"i": i, **dict(zip(_FIELDS, calls[i], strict=True))} for i in order]
    data = pydantic_core.to_json(items)
    return DumpedJson(data) if utf8 else data.decode()


def _utf8(conn: AsyncConnection[Any]) -> bool:
    """Whether `conn` speaks UTF-8 (the store's own connections always do, see
    `CONNECT_OPTIONS`); if so it can take a `DumpedJson` (its dumper is registered here)."""
    if conn.info.encoding != "utf-8":
        return False
    if conn not in _REGISTERED:  # once per connection
        conn.adapters.register_dumper(DumpedJson, _dumped_dumper())
        _REGISTERED.add(conn)
    return True


#: Connections `DumpedJson`'s dumper was registered on.
_REGISTERED: weakref.WeakSet[AsyncConnection[Any]] = weakref.WeakSet()


def _json_param(conn: AsyncConnection[Any], value: Any) -> DumpedJson | str:
    """`value` as a `json` parameter of `conn`: UTF-8 bytes, or text psycopg encodes."""
    data = pydantic_core.to_json(value)
    return DumpedJson(data) if _utf8(conn) else data.decode()


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


async def _commit_alone(
    conn: AsyncConnection[Any], call: tuple[Any, ...], chars: int | None = None
) -> int | BaseException:
    """One pass's commit: its version, or its error (raised only when the connection is gone;
    a commit PostgreSQL could not take in one message is a `StoreError`, sent nothing)."""
    import psycopg

    if chars is None:
        chars = _chars(call)
    if 4 * chars + 16 * len(call[3]) + 1024 > MESSAGE_LIMIT:  # maybe too large: count it
        size = await off_loop(0, lambda: _message_bytes(call), chars=chars)
        if size > MESSAGE_LIMIT:
            return StoreError(
                f"the commit of conversation {call[1]!r} is too large for PostgreSQL: about "
                f"{size:,} bytes, over the {MESSAGE_LIMIT:,} one message may hold (1 GB); "
                "nothing was written. Keep large content out of the conversation (a file, "
                "a blob store) and store a reference to it."
            )
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
    cur = await commit_statement(conn, COMMIT_CALL, call)
    return int(((await cur.fetchone()) or (-1,))[0])


def _message_bytes(call: tuple[Any, ...]) -> int:
    """The bytes of a commit's text parameters in UTF-8, with each array element's length."""
    texts = [call[1], *call[3], *call[4], call[5], call[7], call[9]]
    return sum(len(t.encode("utf-8", "surrogatepass")) + 8 for t in texts) + 1024
