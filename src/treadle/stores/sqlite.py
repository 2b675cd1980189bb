"""The SQLite conversation store: the standard library's `sqlite3`, WAL, one writer thread per
database file.

Every statement runs on one thread per database file in this process, which owns the file's only
connection here: commits are serialised without locks in Python, and the event loop only awaits
a future. Other processes open their own connection; SQLite's file lock and `busy_timeout`
serialise them, and each transaction takes the lock at its start (`BEGIN IMMEDIATE`) so a version
check and its insert are never split by another writer. WAL with `synchronous=NORMAL` makes a commit
survive a crash of the process (a power loss may lose the last commits, never corrupt the file).
Never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from treadle.errors import ConfigurationError, ConflictError, StoreError
from treadle.session import ChunkRow, Usage
from treadle.stores.backend import SCHEMA_VERSION, JournalEntry, schema_found
from treadle.stores.pass_records import waiting_error
from treadle.stores.queueing import FileKeyLock, HeldLocks, KeyLock
from treadle.stores.records import (
    ConversationInfo,
    PassRecord,
    PendingPass,
    StoredConversation,
    conflict_error,
    decode_json,
    decode_row,
    encode_json,
    exists_error,
    fork_point,
    stored_conversation,
)
from treadle.stores.sqlite_passes import claim_job, pending_job, record_job
from treadle.stores.sqlite_thread import DatabaseThread, Head, release, thread_for
from treadle.stores.sqlite_writes import (
    ORPHAN_KEYS,
    StoreConnection,
    advance,
    commit_job,
    delete_keys,
    insert_rows,
    version_of,
)

__all__ = ["MIGRATIONS", "SqliteBackend"]

T = TypeVar("T")

#: How long a write waits for another process's lock on the file before failing.
BUSY_TIMEOUT_MS = 60_000

#: Schema migrations, by the version they reach; each runs once, in one transaction.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE conversations (
            key TEXT PRIMARY KEY, version INTEGER NOT NULL, usage TEXT NOT NULL,
            stop_reason TEXT, metadata TEXT NOT NULL, parent_key TEXT, parent_version INTEGER,
            created_at REAL NOT NULL, updated_at REAL NOT NULL)""",
        """CREATE TABLE rows (
            key TEXT NOT NULL, seq INTEGER NOT NULL, pass_id TEXT, kind TEXT NOT NULL,
            payload TEXT NOT NULL, PRIMARY KEY (key, seq)) WITHOUT ROWID""",
        """CREATE TABLE passes (
            pass_id TEXT PRIMARY KEY, key TEXT NOT NULL, status TEXT NOT NULL,
            version INTEGER NOT NULL, agent_rows TEXT NOT NULL, metadata TEXT NOT NULL,
            created_at REAL NOT NULL, updated_at REAL NOT NULL)""",
        "CREATE INDEX passes_by_key ON passes (key, status)",
        """CREATE TABLE journal (
            pass_id TEXT NOT NULL, seq INTEGER NOT NULL, entry TEXT NOT NULL, kind TEXT NOT NULL,
            body TEXT NOT NULL, PRIMARY KEY (pass_id, seq)) WITHOUT ROWID""",
    ),
    # Version 2 changed PostgreSQL's commit function only; SQLite's writes are whole
    # transactions on one file already, so its schema stays as it was.
    2: (),
    # Version 3 changed PostgreSQL's commit function only (it checks the conversation's
    # `created_at`, which both schemas hold already).
    3: (),
}
assert max(MIGRATIONS) == SCHEMA_VERSION


def _connect(path: Path) -> sqlite3.Connection:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, factory=StoreConnection
        )
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        _migrate(conn, path)
    except (sqlite3.Error, OSError) as err:
        raise ConfigurationError(
            f"cannot open the SQLite store {path}: {err}; check the path and its permissions."
        ) from None
    return conn


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS treadle_schema (version INTEGER NOT NULL)")
        found = schema_found(
            conn.execute("SELECT max(version) FROM treadle_schema").fetchone()[0],
            f"the SQLite file {path}",
        )
        for version in sorted(v for v in MIGRATIONS if v > found):
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
            conn.execute("INSERT INTO treadle_schema VALUES (?)", (version,))
        conn.execute("COMMIT")
    except BaseException:
        # A statement that failed may have ended the transaction already (or none began: a
        # path such as /dev/null): a ROLLBACK then would replace its error with its own.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


class SqliteBackend:
    """A conversation store in one SQLite file (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser().resolve()
        self._writer: DatabaseThread | None = thread_for(self.path, _connect)
        self._cache = self._writer.cache  # touched only on the database thread
        self._heads = self._writer.heads  # likewise
        self._locks = HeldLocks()  # queue mode: the conversation locks its passes hold

    @property
    def url(self) -> str:
        """`sqlite:///<absolute path>`."""
        return f"sqlite:///{self.path}"

    async def _run(self, fn: Callable[[sqlite3.Connection], T], *, read_only: bool = False) -> T:
        writer = self._writer
        if writer is None:
            raise StoreError(f"the store {self.url} is closed; open a new Store.")
        try:
            # A job handed to the thread always runs to its end, even if this caller is
            # cancelled meanwhile (a pass recording its own cancellation).
            return await writer.submit(fn, read_only=read_only)
        except sqlite3.Error as err:  # the thread maps it already; kept for a job's own raise
            raise StoreError(f"the SQLite store {self.path} failed: {err}.") from None

    async def lock(self, key: str) -> FileKeyLock:
        """Hold `key`'s conversation lock (queue mode; see `treadle.stores.queueing`): a file
        under `<db>.locks/`."""
        if self._writer is None:
            raise StoreError(f"the store {self.url} is closed; open a new Store.")
        held = await FileKeyLock.acquire(
            self.path.with_name(self.path.name + ".locks"),
            key,
            lambda: self.url if self._writer is None else None,
        )
        self._locks.add(key, held)
        return held

    def load(self, key: str) -> asyncio.Future[StoredConversation]:
        """The committed conversation (empty for a new key); only rows not cached are decoded.
        A future of the calling loop (no coroutine of its own: a read is every turn's)."""
        writer = self._writer
        if writer is None:
            raise StoreError(f"the store {self.url} is closed; open a new Store.")
        cache, heads = self._cache, self._heads

        def do(conn: sqlite3.Connection) -> StoredConversation:
            head = heads.get(key)  # known while no other process committed (`HeadCache`)
            if head is None:
                found = conn.execute(
                    "SELECT usage, stop_reason, metadata, parent_key, parent_version,"
                    " created_at, version FROM conversations WHERE key = ?",
                    (key,),
                ).fetchone()
                if found is None:
                    return StoredConversation(key)
                heads.put(key, head := Head.of(key, found))
            known = cache.get(key, head.created_at, head.version)
            if len(known) < head.version:
                found_rows = conn.execute(
                    "SELECT kind, payload FROM rows WHERE key = ? AND seq >= ? AND seq < ?"
                    " ORDER BY seq",
                    (key, len(known), head.version),
                ).fetchall()
                known += tuple(decode_row(k, p, key) for k, p in found_rows)
                cache.put(key, head.created_at, known)
            # Built here (every turn's read; a method of `Head` was one Python call more), with
            # its own copy of the metadata, which its reader may change.
            meta = {} if head.metadata == "{}" else decode_json(head.metadata, key)
            return stored_conversation(
                key, known, head.usage, head.stop_reason, meta, head.parent_key,
                head.parent_version, head.created_at,
            )  # fmt: skip

        # Runs to its end even if the caller is cancelled; a `sqlite3.Error` arrives as the
        # `StoreError` `_run` would raise (`DatabaseThread` maps it).
        return writer.submit(do, read_only=True)

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
        await self._run(record_job(pass_id, key, version, agents, entries, start, supersedes, born))

    async def commit(
        self,
        pass_id: str,
        key: str,
        base: int,
        rows: Sequence[ChunkRow],
        *,
        usage: Usage,
        stop_reason: str | None,
        metadata: Mapping[str, Any],
        agent_rows: Sequence[ChunkRow],
        recorded: bool = True,
        born: float | None = None,
    ) -> int:
        """Append a pass's rows at version `base` and settle the pass (one transaction)."""
        job = commit_job(
            self._cache,
            self._heads,
            pass_id,
            key,
            base,
            rows,
            usage,
            stop_reason,
            metadata,
            agent_rows,
            recorded,
            born,
        )
        held = self._locks.take(key)  # queue mode: the lock goes back where the commit ends
        if held is None:
            version = await self._run(job)
        else:
            version = await self._commit_and_drop(job, held)
        if version < 0:
            raise conflict_error(key, base, -1 - version, rows)
        return version

    async def _commit_and_drop(
        self, job: Callable[[sqlite3.Connection], int], held: KeyLock
    ) -> int:
        """Run the commit `job`, giving the conversation's lock back on the database thread as
        soon as the transaction is durable (or failed): whatever becomes of the caller's loop
        (closed with the commit in flight), the next pass on the key starts from it."""
        writer = self._writer
        if writer is None:
            held.drop()
            raise StoreError(f"the store {self.url} is closed; open a new Store.")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()

        def then(value: int | None, error: BaseException | None) -> None:
            held.drop()
            with contextlib.suppress(RuntimeError):  # the caller's loop closed: nobody waits
                loop.call_soon_threadsafe(_settle_one, self.path, future, value, error)

        writer.submit_here(job, then)
        return await future

    def commit_soon(
        self,
        then: Callable[[int | BaseException], None],
        pass_id: str,
        key: str,
        base: int,
        rows: Sequence[ChunkRow],
        *,
        usage: Usage,
        stop_reason: str | None,
        metadata: Mapping[str, Any],
        agent_rows: Sequence[ChunkRow],
        recorded: bool = True,
        born: float | None = None,
    ) -> None:
        """`commit`, with its outcome (the new version, or the error `commit` would raise)
        handed to `then` on this loop once durable: no task and no future, one call from the
        batch's settling (`DatabaseThread.submit_then`). Raises at once only when the store is
        closed. Once handed over, the commit runs to its end whatever happens to the caller."""
        writer = self._writer
        if writer is None:
            raise StoreError(f"the store {self.url} is closed; open a new Store.")
        job = commit_job(
            self._cache,
            self._heads,
            pass_id,
            key,
            base,
            rows,
            usage,
            stop_reason,
            metadata,
            agent_rows,
            recorded,
            born,
        )

        def settle(version: int | None, error: BaseException | None) -> None:
            if isinstance(error, sqlite3.Error):
                then(StoreError(f"the SQLite store {self.path} failed: {error}."))
            elif error is not None:
                then(error)
            elif version is None or version < 0:
                then(conflict_error(key, base, -1 - (version or -1), rows))
            else:
                then(version)

        writer.submit_then(job, settle)

    async def settle(self, pass_id: str, status: str, *, was: str = "running") -> None:
        """Move a pass from status `was` to `status` (no effect from any other status)."""

        def do(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE passes SET status = ?, updated_at = ? WHERE pass_id = ? AND status = ?",
                (status, time.time(), pass_id, was),
            )

        await self._run(do)

    async def renew(self, pass_id: str) -> None:
        """Renew a running pass's owner lease (its `updated_at`)."""

        def do(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE passes SET updated_at = ? WHERE pass_id = ? AND status = 'running'",
                (time.time(), pass_id),
            )

        await self._run(do)

    async def claim(self, pass_id: str, key: str) -> PassRecord:
        """Take over a pending pass: its journal, or `ConflictError`."""
        return await self._run(claim_job(pass_id, key))

    async def append(
        self, key: str, rows: Sequence[ChunkRow], expected: int | None, *, new: bool = False
    ) -> int:
        """Append rows at the end (or only at version `expected`; with `new`, only to a key
        that holds no conversation)."""

        def do(conn: sqlite3.Connection) -> int:
            now = time.time()
            head = conn.execute(
                "SELECT version, metadata FROM conversations WHERE key = ?", (key,)
            ).fetchone()
            found = None if head is None else int(head[0])
            if new and found is not None:
                raise exists_error(key, found)
            base = found or 0
            if expected is not None and expected != base:
                raise conflict_error(key, expected, base, rows)
            if head is not None and (
                refused := waiting_error(key, decode_json(head[1], key), base)
            ):
                raise refused
            insert_rows(conn, key, base, rows, None)
            advance(conn, key, found, base + len(rows), now)
            self._heads.drop(key)  # read again when next asked for
            return base + len(rows)

        held = self._locks.take(key)  # queue mode: the lock goes back where the append ends
        return await (self._run(do) if held is None else self._commit_and_drop(do, held))

    async def pending(self, key: str | None) -> list[PendingPass]:
        """Passes a resume may pick up, oldest first."""
        return await self._run(pending_job(key))

    async def conversations(self) -> list[ConversationInfo]:
        """Every conversation, most recently changed first."""

        def do(conn: sqlite3.Connection) -> list[ConversationInfo]:
            found = conn.execute(
                "SELECT key, version, updated_at, parent_key FROM conversations "
                "ORDER BY updated_at DESC"
            ).fetchall()
            return [ConversationInfo(k, v, u, p) for k, v, u, p in found]

        return await self._run(do)

    async def fork(self, key: str, new_key: str, version: int | None) -> int:
        """Copy `key` up to `version` to `new_key` (which must be new)."""

        def do(conn: sqlite3.Connection) -> int:
            head = conn.execute(
                "SELECT version, usage FROM conversations WHERE key = ?", (key,)
            ).fetchone()
            at = fork_point(key, None if head is None else int(head[0]), version)
            if version_of(conn, new_key) is not None:
                raise ConflictError(
                    f"conversation {new_key!r} already exists; fork to a new key.", key=new_key
                )
            conn.execute(
                "INSERT INTO rows (key, seq, pass_id, kind, payload) SELECT ?, seq, pass_id,"
                " kind, payload FROM rows WHERE key = ? AND seq < ?",
                (new_key, key, at),
            )
            usage = head[1]
            advance(
                conn, new_key, None, at, time.time(),
                usage=usage, parent_key=key, parent_version=at,
            )  # fmt: skip
            self._heads.drop(new_key)
            return int(at)

        return await self._run(do)

    async def delete(self, key: str) -> bool:
        """Delete a conversation with its passes and journal (also a key holding only the
        records of passes that never committed); True when the key held anything."""

        def do(conn: sqlite3.Connection) -> bool:
            gone = delete_keys(conn, [key])
            self._cache.drop(key)
            self._heads.drop(key)
            return gone > 0

        return await self._run(do)

    async def prune(self, before: float) -> int:
        """Delete conversations not changed since `before`, and keys holding only records of
        passes that never committed, none changed since `before`; how many keys."""

        def do(conn: sqlite3.Connection) -> int:
            keys = [
                k
                for (k,) in conn.execute(
                    "SELECT key FROM conversations WHERE updated_at < ?", (before,)
                )
            ]
            keys += [k for (k,) in conn.execute(ORPHAN_KEYS, (before,))]
            gone = delete_keys(conn, keys)
            for key in keys:
                self._cache.drop(key)
                self._heads.drop(key)
            return gone

        return await self._run(do)

    async def aclose(self, grace: float = 30.0) -> None:
        """Let go of the file's writer thread (it stops with its last user, waited for at most
        `grace` seconds: see `DatabaseThread.stop`)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            await asyncio.to_thread(release, writer, grace)


def _settle_one(
    path: Path, future: asyncio.Future[int], value: int | None, error: BaseException | None
) -> None:
    if future.done():  # its caller was cancelled (the commit still ran)
        return
    if isinstance(error, sqlite3.Error):
        future.set_exception(StoreError(f"the SQLite store {path} failed: {error}."))
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(-1 if value is None else value)
