"""Queue-per-conversation mode: a conversation lock held by a pass from its read to its commit.

With `Store.sqlite(..., on_conflict="queue")` (or `Store.postgres`, `Store.open`) a pass takes
its conversation's lock before it reads the conversation and gives it back once it has committed
(or ended without a commit), so concurrent passes on one key run one after another, each from
the rows the previous one committed, instead of the later one failing with `ConflictError`.

The lock holds across processes and dies with its holder:

- SQLite: an exclusive `flock` on a small file per key beside the database
  (`<db>.locks/<sha256 of the key>`). `flock` belongs to the open file, so two passes of one
  process exclude each other too. The lock is tried without blocking and retried with a growing
  pause (up to `_MAX_PAUSE`), so a waiting pass holds no thread and no event loop.
- PostgreSQL: a session advisory lock on a connection of its own (outside the pool: waiters
  holding pool connections would starve the holder's commit). Closing the connection, or the
  holder's process dying, releases it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from treadle.errors import ConfigurationError, StoreError

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = [
    "ON_CONFLICT",
    "FileKeyLock",
    "KeyLock",
    "OnConflict",
    "PostgresKeyLock",
    "RunOnHome",
    "check_on_conflict",
]

#: Runs a coroutine function on the loop that owns the store's connections; the flag says
#: whether the caller's cancellation cancels it (a lock being waited for) or not (a release).
RunOnHome = Callable[[Callable[[], Awaitable[Any]], bool], Awaitable[Any]]

#: What a pass does when another pass on its conversation is running: `"raise"` (optimistic
#: versioning: the later commit is a `ConflictError`) or `"queue"` (it waits its turn).
OnConflict = Literal["raise", "queue"]
ON_CONFLICT: tuple[OnConflict, ...] = ("raise", "queue")

_FIRST_PAUSE = 0.002
_MAX_PAUSE = 0.05


def check_on_conflict(value: object) -> OnConflict:
    """`value` if it is a mode a store knows, else a `ConfigurationError` naming them."""
    if value == "raise":
        return "raise"
    if value == "queue":
        return "queue"
    raise ConfigurationError(f"on_conflict must be 'raise' or 'queue', got {value!r}.")


class KeyLock(Protocol):
    """A held conversation lock."""

    async def release(self) -> None:
        """Give the lock back (safe to call twice; never raises)."""
        ...


class FileKeyLock:
    """A conversation's lock in a SQLite store: `flock` on its lock file (see the module)."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    async def acquire(cls, directory: Path, key: str) -> FileKeyLock:
        """Wait (without blocking the loop) until this process holds `key`'s lock."""
        name = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()

        def open_file() -> int:
            directory.mkdir(parents=True, exist_ok=True)
            return os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

        try:
            fd = await asyncio.to_thread(open_file)
        except OSError as err:
            raise StoreError(f"cannot open the lock file of conversation {key!r}: {err}.") from None
        held = cls(fd)
        pause = _FIRST_PAUSE
        try:
            while True:
                try:  # LOCK_NB: the call returns at once, so it may run on the loop
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return held
                except BlockingIOError:
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, _MAX_PAUSE)
        except BaseException:  # cancelled while waiting: the file must not leak
            await held.release()
            raise

    async def release(self) -> None:
        """Close the lock file, which releases the `flock` (safe to call twice)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            # Closing a file that was only locked, never written, does no I/O: safe on the loop,
            # and a pass ending under cancellation must release without awaiting a thread.
            with contextlib.suppress(OSError):
                os.close(fd)


class PostgresKeyLock:
    """A conversation's lock in a PostgreSQL store: a session advisory lock on a connection of
    its own (see the module), opened and closed on the runtime's loop by `run`."""

    def __init__(self, conn: AsyncConnection[Any], run: RunOnHome) -> None:
        self._conn: AsyncConnection[Any] | None = conn
        self._run = run

    @classmethod
    async def acquire(
        cls, dsn: str, key: str, connect_seconds: float, run: RunOnHome
    ) -> PostgresKeyLock:
        """Wait until this process holds `key`'s lock (the wait is on the server)."""
        import psycopg

        from treadle.stores.postgres_open import CONNECT_OPTIONS

        # The wait runs on the runtime's loop and its caller may be on another: a caller
        # cancelled just as the server grants the lock gets nothing back, and the connection
        # would stay open holding it (every later pass on the conversation waiting forever).
        # So the grant and the caller's giving up meet under a lock: whichever comes second
        # closes the connection.
        handoff = threading.Lock()
        abandoned = False
        granted: list[AsyncConnection[Any]] = []

        async def take() -> AsyncConnection[Any]:
            conn = await psycopg.AsyncConnection.connect(
                dsn, connect_timeout=max(1, int(connect_seconds)), **CONNECT_OPTIONS
            )
            try:
                # Seed 1, not the seed 0 a commit's transaction lock uses: the holder's own
                # commit, on a pool connection, must not wait for this lock.
                await conn.execute("SELECT pg_advisory_lock(hashtextextended(%s, 1))", (key,))
            except BaseException:  # cancelled or failed while waiting: drop the connection
                await conn.close()
                raise
            with handoff:
                if not abandoned:
                    granted.append(conn)
                    return conn
            await conn.close()  # its caller has given up: nobody would release it
            raise asyncio.CancelledError

        try:
            return cls(await run(take, True), run)
        except BaseException:
            with handoff:
                abandoned = True
                late = granted[:]
            for conn in late:  # granted as its caller gave up: give it back
                await cls(conn, run).release()
            raise

    async def release(self) -> None:
        """Close the lock's connection, which releases it (safe to call twice; never raises)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return

        async def close() -> None:
            await conn.close()

        with contextlib.suppress(Exception):
            await self._run(close, False)
