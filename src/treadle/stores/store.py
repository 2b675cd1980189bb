"""`Store`: conversations by key, in SQLite (the default) or PostgreSQL.

A conversation is a key in a store; its version is its number of committed rows. A pass given
`store=` and `conversation=` continues the conversation and commits its new rows in one
transaction when it ends (see `treadle.stores.journal`); two writers on one conversation never
interleave: the second commit finds the version moved and raises `ConflictError` (optimistic
versioning), with nothing of its own written; a store opened with `on_conflict="queue"` makes
them wait their turn instead (`treadle.stores.queueing`). Reads are lazy like every Treadle read:
`store.conversation(key)` returns a `Session` at once. Each method has a blocking form (runs on
the Treadle runtime) and an `a`-prefixed coroutine twin for async code.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pydantic_core

from treadle.errors import ConfigurationError, ConflictError
from treadle.runtime import submit
from treadle.session import ChunkRow, Session, SessionData
from treadle.session.session import new_session_id
from treadle.stores.backend import StoreBackend
from treadle.stores.close_once import CloseOnce
from treadle.stores.journal import inflight
from treadle.stores.locations import KEYWORD_DSN, check_location, redact
from treadle.stores.pass_records import waiting_error
from treadle.stores.queueing import OnConflict, check_on_conflict
from treadle.stores.records import ConversationInfo, PendingPass, check_key
from treadle.tools.unanswered import answer_gaps

__all__ = ["DEFAULT_SQLITE_PATH", "Store", "check_store_arguments", "store_options"]

T = TypeVar("T")

#: Where `Store.sqlite()` keeps its database, relative to the working directory.
DEFAULT_SQLITE_PATH = os.path.join(".treadle", "treadle.db")

_DAY = 86_400.0


log = logging.getLogger("treadle.stores")


#: How many times `append` (without `expected_version`) reads and writes again when other
#: writers keep moving the conversation between its read and its write.
APPEND_ATTEMPTS = 30


class Store:
    """Conversations that outlive the process, by key.

    Open one with `Store.sqlite(path)` (nothing to install or start) or `Store.postgres(dsn)`
    (the `treadle[postgres]` extra), or `Store.open(url)`; close it with `close()` / `aclose()`
    or use it as a context manager.

    `on_conflict` says what a pass does when another pass on its conversation is running:
    `"raise"` (the default: optimistic versioning, the later commit is a `ConflictError`) or
    `"queue"` (it waits for the other to end, then starts from its committed rows).
    """

    def __init__(self, backend: StoreBackend, *, on_conflict: OnConflict = "raise") -> None:
        if not isinstance(backend, StoreBackend):
            raise ConfigurationError(
                f"Store takes a StoreBackend, got {type(backend).__name__}; use Store.sqlite(...) "
                "or Store.postgres(...)."
            )
        self.backend = backend
        self.on_conflict: OnConflict = check_on_conflict(on_conflict)
        """`"raise"` or `"queue"` (see the class)."""
        self._closing = CloseOnce()

    # -- opening ---------------------------------------------------------------------------
    @classmethod
    def sqlite(
        cls,
        path: str | os.PathLike[str] = DEFAULT_SQLITE_PATH,
        *,
        on_conflict: OnConflict = "raise",
    ) -> Store:
        """A store in the SQLite file at `path` (created with its schema on first use)."""
        from treadle.stores.sqlite import SqliteBackend

        mode = check_on_conflict(on_conflict)
        return cls(SqliteBackend(check_location(path, "SQLite store path")), on_conflict=mode)

    @classmethod
    def postgres(
        cls,
        dsn: str,
        *,
        pool_size: int = 10,
        connect_timeout: float = 5.0,
        on_conflict: OnConflict = "raise",
    ) -> Store:
        """A store in the PostgreSQL database `dsn` (schema created on first use).

        Needs `pip install 'treadle[postgres]'`. The first use connects (within
        `connect_timeout` seconds); a DSN that does not connect is a `ConfigurationError`.
        `pool_size` bounds each of the store's pools: the runtime's, and one of each event
        loop that uses the store enough (at most four at once; see docs/stores.md,
        "PostgreSQL connections").
        """
        from treadle.stores.postgres import PostgresBackend

        check_location(dsn, "PostgreSQL DSN")
        mode = check_on_conflict(on_conflict)
        backend = PostgresBackend(dsn, pool_size=pool_size, connect_timeout=connect_timeout)
        return cls(backend, on_conflict=mode)

    @classmethod
    def open(cls, url: str | os.PathLike[str], *, on_conflict: OnConflict = "raise") -> Store:
        """A store from a URL: `postgresql://...` (or `postgres://`), `sqlite:///path`, or a
        path to a SQLite file."""
        text = check_location(url, "store URL")
        mode = check_on_conflict(on_conflict)
        scheme, sep, rest = text.partition("://")
        if sep:  # schemes are case-insensitive (RFC 3986): POSTGRESQL:// is postgresql://
            scheme = scheme.lower()
            text = f"{scheme}://{rest}"
        shown = redact(text)  # what error messages may repeat: never a password
        if scheme in ("postgresql", "postgres") and sep:
            return cls.postgres(text, on_conflict=mode)
        if KEYWORD_DSN.match(text):  # libpq's "host=... dbname=..." form
            return cls.postgres(text, on_conflict=mode)
        if scheme == "sqlite" and sep:
            if not rest.startswith("/"):
                raise ConfigurationError(
                    f"{shown!r} is not a SQLite URL; write sqlite:///relative.db or "
                    "sqlite:////absolute/path.db."
                )
            if "?" in rest or "#" in rest:
                raise ConfigurationError(
                    f"{shown!r}: a SQLite store URL takes no query or fragment (such as "
                    "?mode=ro); Treadle opens the file read-write with its own settings. "
                    "Write sqlite:///path.db."
                )
            return cls.sqlite(rest[1:] or DEFAULT_SQLITE_PATH, on_conflict=mode)
        if sep:
            raise ConfigurationError(
                f"{shown!r} names no store Treadle knows; use sqlite:///path or postgresql://..."
            )
        return cls.sqlite(text, on_conflict=mode)

    @property
    def url(self) -> str:
        """Where the store lives (without a password)."""
        return self.backend.url

    def __repr__(self) -> str:
        return f"<Store {self.url}>"

    # -- reading -----------------------------------------------------------------------------
    def conversation(self, key: str) -> Session:
        """The latest committed version of conversation `key`, as a lazy `Session` (returned at
        once; empty for a new key). Its metadata holds `conversation`, `version` and what the
        last pass left for the next (`pending_approvals`, `interrupt_reason`)."""
        check_key(key)
        return Session._pending(
            submit(self._conversation_data(key)),
            id=new_session_id(),
            operator="store.conversation",
            kind="user",
            parents=(),
            sandbox=None,
        )

    async def _conversation_data(self, key: str) -> SessionData:
        self._closing.check(self.url)
        stored = await self.backend.load(key)
        metadata = {**stored.metadata, "conversation": key, "version": stored.version}
        from treadle.session import ChunkTable
        from treadle.session.stops import as_stop_reason

        return SessionData(
            ChunkTable(stored.rows), stored.usage, as_stop_reason(stored.stop_reason), metadata
        )

    async def aconversations(self) -> list[ConversationInfo]:
        """Every conversation, most recently changed first."""
        self._closing.check(self.url)
        return await self.backend.conversations()

    def conversations(self) -> list[ConversationInfo]:
        """Every conversation, most recently changed first (blocks)."""
        return self._wait(self.aconversations())

    async def apending(self, key: str | None = None) -> list[PendingPass]:
        """Passes another process may resume, oldest first: stopped for approvals or an
        interrupt, cancelled, or not ended (running, or their process died)."""
        key = None if key is None else check_key(key)
        self._closing.check(self.url)
        return await self.backend.pending(key)

    def pending(self, key: str | None = None) -> list[PendingPass]:
        """Passes another process may resume, oldest first (blocks; see `apending`).

        Resume one with `run_session_loop(Session(), agent, store=store, conversation=item,
        approvals=...)`: the pass takes it over (only one process can), runs the calls left
        waiting and commits as any pass does.
        """
        return self._wait(self.apending(key))

    # -- writing -----------------------------------------------------------------------------
    async def aappend(
        self, key: str, rows: Iterable[ChunkRow] | Session, *, expected_version: int | None = None
    ) -> int:
        """Append rows to a conversation in one transaction; the new version.

        With `expected_version` the rows are written only if the conversation is still at that
        version (else `ConflictError`, nothing written); without it they go at the end (in
        queue mode, after the running pass on the conversation, if any, has ended).
        """
        check_key(key)
        if isinstance(rows, Session):
            found: Sequence[ChunkRow] = (await rows.wait_ready()).table.rows
        else:
            found = list(rows)
        if not all(isinstance(r, ChunkRow) for r in found):
            raise ConfigurationError("append takes ChunkRow values or a Session.")
        if expected_version is not None and (
            isinstance(expected_version, bool) or not isinstance(expected_version, int)
        ):
            raise ConfigurationError("expected_version must be an int (a version read earlier).")
        self._closing.check(self.url)  # its arguments refused first, as by a closed store
        try:
            if self.on_conflict != "queue":
                return await self._append_answered(key, found, expected_version)
            held = await self.backend.lock(key)
            try:
                return await self._append_answered(key, found, expected_version)
            finally:
                await held.release()
        except pydantic_core.PydanticSerializationError as err:
            # Rows are encoded before anything is written (off the loop when there are many;
            # checking them here first would encode a large import twice): nothing was written.
            raise ConfigurationError(
                "rows that cannot be stored (text must be valid Unicode, without lone "
                f"surrogates): {' '.join(str(err).split()):.200}; nothing was written."
            ) from None

    async def _append_answered(
        self, key: str, rows: Sequence[ChunkRow], expected: int | None
    ) -> int:
        # Rows that go on past tool calls without results get "no result" rows first (as a
        # pass's input does), and results are checked against the conversation's last calls
        # (`answer_gaps` refuses a misplaced or repeated one). Both depend on the rows they
        # follow, so the rows are written at the version read: a writer that moved the
        # conversation meanwhile (its own calls, its own results) makes the write conflict,
        # and it is read and checked again; one that keeps losing gets the `ConflictError`
        # (nothing written), never rows checked against a tail that is not theirs.
        conflict: ConflictError | None = None
        for attempt in range(APPEND_ATTEMPTS):
            if attempt:  # writers that met here spread out (up to 1 ms, 2, 4, ... 256, at random)
                await asyncio.sleep(random.uniform(0.0, 0.001 * 2 ** min(attempt, 8)))
            stored = await self.backend.load(key)
            version = len(stored.rows)
            if refused := waiting_error(key, stored.metadata, version):
                raise refused  # its calls wait for decisions, not for "no result"
            answered = answer_gaps(rows, stored.rows)
            try:
                return await self.backend.append(
                    key, answered, expected if expected is not None else version
                )
            except ConflictError as err:
                if expected is not None:
                    raise
                conflict = err
        assert conflict is not None
        raise conflict

    def append(
        self, key: str, rows: Iterable[ChunkRow] | Session, *, expected_version: int | None = None
    ) -> int:
        """Append rows to a conversation (blocks; see `aappend`)."""
        return self._wait(self.aappend(key, rows, expected_version=expected_version))

    async def afork(self, key: str, new_key: str, *, version: int | None = None) -> Session:
        """Branch conversation `key` (at `version`, default its latest) into the new key
        `new_key`; the branch as a `Session`. Its lineage names the parent conversation. Its
        usage starts as the parent's whole total when forked, not the usage up to `version`
        (the store keeps one usage total a conversation, none a pass). `version` must be an
        int of 0 or more (`ConfigurationError` otherwise, before the store is asked); a `key`
        that holds no conversation is a `ConfigurationError` too, and makes no branch."""
        check_key(key)
        check_key(new_key, "new key")
        # A float, bool or str slips through a range check (1.5 made a head at a version no
        # row count matches): only an int names a version.
        if version is not None and (
            isinstance(version, bool) or not isinstance(version, int) or version < 0
        ):
            raise ConfigurationError(
                f"fork(version=) takes an int of 0 or more (or None: the latest), got "
                f"{version!r:.60}."
            )
        self._closing.check(self.url)
        at = await self.backend.fork(key, new_key, version)
        return Session._derive(
            await self._conversation_data(new_key),
            operator=f"fork:{key}@{at}",
            kind="user",
            parents=(),
            sandbox=None,
        )

    def fork(self, key: str, new_key: str, *, version: int | None = None) -> Session:
        """Branch a conversation into a new key (blocks; see `afork`)."""
        return self._wait(self.afork(key, new_key, version=version))

    async def adelete(self, key: str) -> bool:
        """Delete a conversation with its passes (also the records of passes on `key` that
        never committed, such as a first turn cancelled); True when the key held any of them.
        A pass still running on it then fails with `ConflictError` and writes nothing back."""
        key = check_key(key)
        self._closing.check(self.url)
        return await self.backend.delete(key)

    def delete(self, key: str) -> bool:
        """Delete a conversation with its passes (blocks)."""
        return self._wait(self.adelete(key))

    async def aprune(self, *, older_than_days: float) -> int:
        """Delete conversations not changed for `older_than_days` days, and the records of
        passes that never committed on keys without a conversation, as old; how many keys."""
        if isinstance(older_than_days, bool) or not isinstance(older_than_days, (int, float)):
            raise ConfigurationError("older_than_days must be a number of days.")
        if older_than_days < 0:
            raise ConfigurationError("older_than_days cannot be negative.")
        self._closing.check(self.url)
        return await self.backend.prune(time.time() - older_than_days * _DAY)

    def prune(self, *, older_than_days: float) -> int:
        """Delete conversations not changed for `older_than_days` days (blocks)."""
        return self._wait(self.aprune(older_than_days=older_than_days))

    # -- files -------------------------------------------------------------------------------
    async def aimport_jsonl(
        self, path: str | os.PathLike[str], *, key: str | None = None
    ) -> tuple[str, int]:
        """Import a JSONL session file (written with `persist=True`) as the new conversation
        `key` (default: the file's session id); `(key, version)`."""
        self._closing.check(self.url)
        from treadle.stores.transfer import import_jsonl

        return await import_jsonl(self.backend, path, key)

    def import_jsonl(
        self, path: str | os.PathLike[str], *, key: str | None = None
    ) -> tuple[str, int]:
        """Import a JSONL session file as a new conversation (blocks; see `aimport_jsonl`)."""
        return self._wait(self.aimport_jsonl(path, key=key))

    async def aexport_jsonl(self, key: str, path: str | os.PathLike[str]) -> Path:
        """Write conversation `key` as a JSONL session file (`treadle show` and
        `load_session` read it); the path."""
        self._closing.check(self.url)
        from treadle.stores.transfer import export_jsonl

        return await export_jsonl(self.backend, key, path)

    def export_jsonl(self, key: str, path: str | os.PathLike[str]) -> Path:
        """Write a conversation as a JSONL session file (blocks; see `aexport_jsonl`)."""
        return self._wait(self.aexport_jsonl(key, path))

    # -- closing -----------------------------------------------------------------------------
    async def asettled(self) -> None:
        """Wait until no commit is in flight on this store (bound the wait with
        `asyncio.timeout`: a cancelled wait leaves the commits running).

        A pass cancelled while its commit was in flight raises at once and leaves the commit to
        the store, which lands the whole turn or none; once settled, `pending(key)` lists the
        pass as `cancelled` when its turn did not land (unless another writer moved the
        conversation on meanwhile: docs/stores.md).
        """
        loop = asyncio.get_running_loop()
        # A commit whose loop was closed without running it to its end can never finish (the
        # database committed its transaction whole or not at all): it is not waited for.
        while commits := [
            c for c in inflight(self.backend) if not c.done() and not c.get_loop().is_closed()
        ]:
            mine = [c for c in commits if c.get_loop() is loop]
            if mine:  # asyncio.wait never cancels what it waits for
                await asyncio.wait(mine)
            else:  # commits of another loop (the sync API's): their ends are polled
                await asyncio.sleep(0.005)

    def settled(self) -> None:
        """Wait until no commit is in flight (blocks; see `asettled`)."""
        self._wait(self.asettled())

    async def aclose(self, grace: float = 30.0) -> None:
        """Wait for the commits in flight (`asettled`), then release the store's connections
        (safe to call twice).

        The wait is bounded: a commit still in flight after `grace` seconds (stuck on a lock
        another client holds) is left to the database, which commits its transaction whole or
        rolls it back when its connection goes; its pass is then recorded as that transaction
        leaves it (`done`, or `running` until its lease runs out and another process resumes it).
        """
        if not await self._closing.first(grace):  # closed by another call: it has ended now
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        ran = False
        try:
            try:
                async with asyncio.timeout(grace):
                    await self.asettled()
            except TimeoutError:
                log.warning(
                    "closing the store %s with %d commit(s) still in flight after %ss",
                    self.url,
                    sum(not c.done() for c in inflight(self.backend)),
                    grace,
                )
            # The rest of `grace` bounds the backend's own wait (SQLite's database thread,
            # still busy with a commit stuck on another client's lock, is left to end alone).
            await self.backend.aclose(grace=max(0.0, deadline - loop.time()))
            ran = True
        finally:
            self._closing.end(ran=ran)  # a close cancelled midway lets the next one run

    def close(self, grace: float = 30.0) -> None:
        """Release the store's connections (blocks; safe to call twice; see `aclose`)."""
        self._wait(self.aclose(grace))

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @staticmethod
    def _wait(coro: Coroutine[Any, Any, T]) -> T:
        return submit(coro).result()


def store_options(store: Store | None, conversation: str | PendingPass | None) -> dict[str, Any]:
    """The `store=` / `conversation=` options of an agent run's passes, checked at the call."""
    check_store_arguments(store, conversation)
    return {} if store is None else {"store": store, "conversation": conversation}


def check_store_arguments(store: Store | None, conversation: str | PendingPass | None) -> None:
    """ConfigurationError unless `store=` and `conversation=` are both absent or both usable."""
    if store is None and conversation is None:
        return
    if store is None or conversation is None:
        raise ConfigurationError(
            "store= and conversation= go together: give the Store and the conversation's key."
        )
    if not isinstance(store, Store):
        raise ConfigurationError(
            f"store must be a treadle Store (Store.sqlite(...)), got {type(store).__name__}."
        )
    if isinstance(conversation, PendingPass):
        return
    if not isinstance(conversation, str) or not conversation:
        raise ConfigurationError(
            "conversation must be a non-empty key (str) or an item of store.pending()."
        )
