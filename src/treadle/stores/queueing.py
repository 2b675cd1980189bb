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

A lock is given back whatever happens to the loop that took it: a commit gives it back where it
completes (SQLite's database thread, PostgreSQL's runtime loop: `KeyLock.committing`), so a
loop closed with the commit in flight does not keep it; and a lock whose loop was closed before
its commit started (a pass left mid-tool, or waiting for its turn, by `run_until_complete` and
`loop.close()` without cancelling its tasks) is given back by a watcher thread (`watch`), which
runs only while this process holds a lock and looks every `_WATCH_PERIOD` seconds.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import contextvars
import fcntl
import hashlib
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from treadle.errors import ConfigurationError, StoreError

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = [
    "ON_CONFLICT",
    "FileKeyLock",
    "HeldLocks",
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
#: How often the watcher looks for locks whose loop has closed (only while any lock is held).
_WATCH_PERIOD = 0.1


def check_on_conflict(value: object) -> OnConflict:
    """`value` if it is a mode a store knows, else a `ConfigurationError` naming them."""
    if value == "raise":
        return "raise"
    if value == "queue":
        return "queue"
    raise ConfigurationError(f"on_conflict must be 'raise' or 'queue', got {value!r}.")


class KeyLock(Protocol):
    """A held conversation lock."""

    committing: bool
    """True once a commit took over giving it back (see `HeldLocks.take`)."""

    def drop(self) -> None:
        """Give the lock back now, from any thread (safe to call twice; never raises)."""
        ...

    async def release(self) -> None:
        """Give the lock back (safe to call twice; never raises)."""
        ...


class _Held(abc.ABC):
    """What both kinds of lock share: the loop that took it, and giving it back from any thread
    exactly once (`drop`), as the watcher and a commit's end may."""

    def __init__(self, owner: asyncio.AbstractEventLoop) -> None:
        self.owner = owner
        """The loop of the caller that took (or waits for) the lock."""
        self.committing = False
        self.key: str | None = None
        self.registry: HeldLocks | None = None  # the backend's, once its caller has it
        self._guard = threading.Lock()

    def _forget(self) -> None:
        """Leave the watcher (the lock is given back)."""
        _WATCH.discard(self)

    @abc.abstractmethod
    def drop(self) -> None:
        """Give the lock back now, from any thread (safe to call twice; never raises)."""

    @abc.abstractmethod
    async def release(self) -> None:
        """Give the lock back (safe to call twice; never raises)."""


class HeldLocks:
    """The conversation locks a backend's passes hold in this process, so a commit can give its
    pass's lock back where it completes (see the module). The lock a pass took is found through
    the pass's context (`_TAKEN`, which its commit task inherits), not by key: a PostgreSQL lock
    lost with its connection leaves two passes of one key in the process, each with its own."""

    def add(self, key: str, lock: _Held) -> None:
        """`lock`, of `key`, is held by the calling task (a pass, or an append)."""
        lock.key, lock.registry = key, self
        # A new mapping, not the one the context holds: a pass a tool starts (a sub-agent on
        # another conversation) must not replace the lock of the pass around it.
        _TAKEN.set({**(_TAKEN.get() or {}), (id(self), key): lock})

    def take(self, key: str) -> KeyLock | None:
        """The lock the calling pass holds for `key`, if any and no commit took it yet: the
        caller's commit now gives it back when it completes (`drop`), whatever happens to the
        caller's loop."""
        lock = (_TAKEN.get() or {}).get((id(self), key))
        if lock is None or lock.registry is not self or lock.committing:
            return None
        lock.committing = True
        return lock


#: The locks the current pass (and the passes around it) took, by registry and key (see
#: `HeldLocks`).
_TAKEN: contextvars.ContextVar[dict[tuple[int, str], _Held] | None] = contextvars.ContextVar(
    "treadle_locks", default=None
)


class _Watch:
    """Gives back the locks whose loop was closed before a commit took them (see the module):
    one daemon thread, started with the first lock held and asleep while none is."""

    def __init__(self) -> None:
        self._held: set[_Held] = set()
        self._cond = threading.Condition()
        self._pid: int | None = None

    def add(self, lock: _Held) -> None:
        with self._cond:
            self._held.add(lock)
            if self._pid != os.getpid():  # first use, or a forked child (no thread of ours)
                self._pid = os.getpid()
                threading.Thread(target=self._serve, name="treadle-lock-watch", daemon=True).start()
            elif len(self._held) == 1:
                self._cond.notify()

    def discard(self, lock: _Held) -> None:
        with self._cond:
            self._held.discard(lock)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._held:
                    self._cond.wait()
                orphans = [h for h in self._held if not h.committing and h.owner.is_closed()]
            for lock in orphans:  # nothing will ever run its holder's release
                lock.drop()
            time.sleep(_WATCH_PERIOD)


_WATCH = _Watch()


def _after_fork_in_child() -> None:
    """A forked child (a tool's `multiprocessing` helper) shares the parent's open lock files:
    an `flock` lives as long as any copy of its file is open, so the child would hold the
    parent's conversations for as long as it lives (even after the parent ended). It closes its
    copies, without unlocking (that would unlock the parent's), and forgets them."""
    held, _WATCH._held = _WATCH._held, set()
    _WATCH._cond = threading.Condition()
    _WATCH._pid = None
    for lock in held:
        if isinstance(lock, FileKeyLock):
            fd, lock._fd = lock._fd, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


os.register_at_fork(after_in_child=_after_fork_in_child)


class FileKeyLock(_Held):
    """A conversation's lock in a SQLite store: `flock` on its lock file (see the module)."""

    def __init__(self, fd: int, owner: asyncio.AbstractEventLoop) -> None:
        super().__init__(owner)
        self._fd: int | None = fd

    @classmethod
    async def acquire(
        cls, directory: Path, key: str, closed: Callable[[], str | None]
    ) -> FileKeyLock:
        """Wait (without blocking the loop) until this process holds `key`'s lock; a
        `StoreError` as soon as `closed()` names the store closed meanwhile."""
        name = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()

        # The file is opened on a worker thread; a caller cancelled meanwhile gets nothing
        # back, so the open and the caller's giving up meet under a lock: whichever comes
        # second closes the file (else each such pass kept a descriptor for good).
        handoff = threading.Lock()
        abandoned = False
        opened: list[int] = []
        caller = asyncio.get_running_loop()

        def open_file() -> int:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(directory / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            with handoff:
                if not abandoned and not caller.is_closed():  # closed: nobody takes it
                    opened.append(fd)
                    return fd
            os.close(fd)
            return -1

        try:
            fd = await asyncio.to_thread(open_file)
        except OSError as err:
            raise StoreError(f"cannot open the lock file of conversation {key!r}: {err}.") from None
        except BaseException:
            with handoff:
                abandoned = True
                late = opened[:]
            for fd in late:
                os.close(fd)
            raise
        held = cls(fd, asyncio.get_running_loop())
        _WATCH.add(held)  # its loop may close while it waits, or holds
        pause = _FIRST_PAUSE
        try:
            while True:
                try:  # LOCK_NB: the call returns at once, so it may run on the loop
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return held
                except BlockingIOError:
                    if (store := closed()) is not None:  # nobody could commit what it would run
                        raise StoreError(
                            f"the store {store} was closed while this pass waited for its turn."
                        ) from None
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, _MAX_PAUSE)
        except BaseException:  # cancelled while waiting: the file must not leak
            await held.release()
            raise

    def drop(self) -> None:
        """Close the lock file, which releases the `flock` (any thread; safe to call twice)."""
        with self._guard:
            fd, self._fd = self._fd, None
        if fd is not None:
            self._forget()
            # Closing a file that was only locked, never written, does no I/O: safe on the loop,
            # and a pass ending under cancellation must release without awaiting a thread.
            with contextlib.suppress(OSError):
                os.close(fd)

    async def release(self) -> None:
        """Close the lock file, which releases the `flock` (safe to call twice)."""
        self.drop()


class PostgresKeyLock(_Held):
    """A conversation's lock in a PostgreSQL store: a session advisory lock on a connection of
    its own (see the module), opened and closed on the runtime's loop (`home`)."""

    def __init__(
        self,
        conn: AsyncConnection[Any],
        run: RunOnHome,
        owner: asyncio.AbstractEventLoop,
        home: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(owner)
        self._conn: AsyncConnection[Any] | None = conn
        self._run = run
        self._home = home

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
        # closes the connection. A caller whose loop closes never gives up: the grant is
        # watched from the start (see the module).
        handoff = threading.Lock()
        abandoned = False
        granted: list[PostgresKeyLock] = []
        owner = asyncio.get_running_loop()

        async def take() -> PostgresKeyLock:
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
            held = cls(conn, run, owner, asyncio.get_running_loop())
            with handoff:
                if not abandoned:
                    granted.append(held)
                    _WATCH.add(held)
                    return held
            await held.release()  # its caller has given up: nobody would release it
            raise asyncio.CancelledError

        try:
            return await run(take, True)  # type: ignore[no-any-return]
        except BaseException:
            with handoff:
                abandoned = True
                late = granted[:]
            for held in late:  # granted as its caller gave up: give it back
                await held.release()
            raise

    async def lost(self) -> str | None:
        """Why the lock is no longer held (its connection ended: the server terminated it, a
        failover), or None: one round trip on its connection, on the runtime's loop."""
        import psycopg

        conn = self._conn
        if conn is None:
            return "it was given back"
        try:
            await conn.execute("SELECT 1")
        except psycopg.Error as err:
            return " ".join(str(err).split()) or type(err).__name__
        return None

    def drop(self) -> None:
        """Close the lock's connection on its loop, which releases it (any thread; safe to call
        twice; never raises)."""
        with self._guard:
            conn, self._conn = self._conn, None
        if conn is None:
            return
        self._forget()
        with contextlib.suppress(RuntimeError):  # the runtime's loop is gone, and the socket
            asyncio.run_coroutine_threadsafe(_unlock_and_close(conn), self._home)

    async def release(self) -> None:
        """Close the lock's connection, which releases it (safe to call twice; never raises)."""
        with self._guard:
            conn, self._conn = self._conn, None
        if conn is None:
            return
        self._forget()

        async def close() -> None:
            await _unlock_and_close(conn)

        try:
            await self._run(close, False)
        except Exception:  # the store closed meanwhile (it runs no more work): close it anyway
            with contextlib.suppress(RuntimeError):  # the runtime's loop is gone, and the socket
                asyncio.run_coroutine_threadsafe(_unlock_and_close(conn), self._home)


async def _unlock_and_close(conn: AsyncConnection[Any]) -> None:
    """Unlock, then close: the server frees a closed connection's locks only as its backend
    exits, a moment later; unlocked first, the lock is free when this returns."""
    with contextlib.suppress(Exception):  # a lost connection holds nothing
        await conn.execute("SELECT pg_advisory_unlock_all()")
    await conn.close()
