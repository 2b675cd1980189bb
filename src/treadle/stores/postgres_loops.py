"""A PostgreSQL store's connections on the loops that call it (`LoopPool`): a loop that uses the
store enough gets a small pool of its own, so its passes' reads and commits run where they are
awaited, without crossing to the runtime's thread and back for each batch.

The rules (see docs/stores.md, "Connections"):

- A loop's first `OWN_POOL_AFTER` calls reach the runtime's pool by the hop
  (`treadle.stores.hop.LoopHop`); from then on the loop uses its own pool of up to `pool_size`
  connections, opened one at a time as its work needs them (none before). A loop that does
  little (an `asyncio.run` per request) so never connects on its own.
- At most `LOOP_POOLS` loops hold a pool at once; calls from further loops take the hop.
- A loop's pool closes when the loop ends: `asyncio.run` (and any runner that shuts down the
  loop's async generators) closes it after the loop's leftover tasks have ended; a loop closed
  without that (`loop.close()` with tasks pending) has its connections' sockets closed by the
  store's sweep on the runtime's loop (`SWEEP_SECONDS`), so they never outlive it long.
- A pool has no task of its own: a connection is opened by the call that needs it, so nothing
  of the pool is cancelled when `asyncio.run` cancels the loop's leftover tasks.
- Closing the pool fails each call waiting for a connection, and each batch queued or running
  on it, with `StoreError`.

Rows read are cached once for the whole store (`SharedRowCache`, safe across threads): a read
always asks the database for the conversation's head and fetches rows past what the cache
holds, so a commit made on one loop is seen by a read on any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Sequence,
)  # fmt: skip
from typing import TYPE_CHECKING, Any, TypeVar

from treadle.errors import ConfigurationError, StoreError, WriteOutcomeUnknown
from treadle.session import ChunkRow, Usage
from treadle.stores.batching import Batcher
from treadle.stores.postgres_open import alive
from treadle.stores.records import RowCache, StoredConversation

if TYPE_CHECKING:
    from psycopg import AsyncConnection

__all__ = [
    "CANCEL_ROUND_SECONDS", "CANCEL_SECONDS", "LOOP_POOLS", "OWN_POOL_AFTER", "READ_CLOSED",
    "SWEEP_SECONDS", "WRITE_CLOSED", "WRITE_GIVEN_UP", "LoopPool", "PoolRefused",
    "SharedRowCache", "stop_writes",
]  # fmt: skip

T = TypeVar("T")

#: How many loops at once have a pool of their own (the runtime's loop, which has the store's
#: first pool, not counted).
LOOP_POOLS = 4

#: A loop's calls that take the hop to the runtime's pool before it gets its own.
OWN_POOL_AFTER = 16

#: How often the runtime's loop looks for loops closed with their pool still open.
SWEEP_SECONDS = 1.0

#: Past the close's grace, how long the writes still running are given to end once the server
#: is asked to cancel their statements (it answers at once unless it is unreachable).
CANCEL_SECONDS = 5.0

#: ... asked again this often (a write between two statements as it was asked goes on to
#: the next one).
CANCEL_ROUND_SECONDS = 0.25

#: While this pool's connections serve its calls, how long after a refused connect it waits for
#: them instead of trying to open more.
REFUSED_BACKOFF_SECONDS = 1.0


class LoopPool:
    """One calling loop's connections (up to `size`) and batchers: used only on `loop`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        size: int,
        connect: Callable[[], Awaitable[AsyncConnection[Any]]],
        gone: Callable[[LoopPool], None],
    ) -> None:
        self.loop = loop
        self.calls = 0  # calls made from this loop (counted up to `OWN_POOL_AFTER`)
        self.closed = False
        self.batchers: tuple[Batcher[str, StoredConversation], Batcher[Any, int]] | None = None
        self._size = size
        self._connect = connect
        self._gone = gone
        self._idle: list[AsyncConnection[Any]] = []
        self._open: set[AsyncConnection[Any]] = set()  # idle or in use
        self._opening = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._running: set[asyncio.Task[Any]] = set()  # operations started by `run`
        self._refused_until = 0.0  # loop time before which no new connection is tried
        self.refused: str | None = None
        """Why the server refused this pool its first connection: the loop then uses the
        runtime's pool (see `_get`)."""
        self._pid = os.getpid()  # a forked child must not end its parent's connections
        self._end = _until_loop_ends(self)
        with contextlib.suppress(StopIteration):
            # Started here, on the loop: the loop now knows the generator, and closes it (which
            # closes the pool) when it shuts down its async generators (`asyncio.run` does,
            # after its leftover tasks have ended).
            self._end.asend(None).send(None)

    @property
    def connections(self) -> int:
        """Connections open now (idle or in use)."""
        return len(self._open)

    async def run(self, operation: Coroutine[Any, Any, T]) -> T:
        """Await `operation` as a task of this pool: once started, it runs to its end even if
        its caller is cancelled; closing the pool lets it end (within the close's grace)."""
        task = asyncio.ensure_future(operation)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled() and self.closed:  # cancelled by `close`, not by its caller
                raise WriteOutcomeUnknown(str(WRITE_GIVEN_UP)) from None
            raise

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection[Any]]:
        """A connection of this pool for the block (opened if none is idle and there is room,
        else the next one given back)."""
        conn = await self._get()
        try:
            yield conn
        finally:
            await self._put(conn)

    async def _get(self) -> AsyncConnection[Any]:
        while True:
            if self.closed:
                raise _closed()
            if self.refused:
                raise PoolRefused(self.refused)
            while self._idle:
                conn = self._idle.pop()  # the most recently used: its caches are warm
                if alive(conn):
                    return conn
                self._discard(conn)  # the server ended it while it sat idle (a restart)
            now = self.loop.time()
            room = len(self._open) + self._opening < self._size
            if room and now >= self._refused_until:
                self._opening += 1
                try:
                    conn = await self._connect()
                except ConfigurationError:  # the store's first connection: fails fast
                    self._wake()
                    raise
                except Exception as err:
                    # Refused (the server's or a role's connection limit, no descriptor
                    # left). With connections of its own in use, the pool waits for one to
                    # come back; with none, it gives up its place: this call and the loop's
                    # later ones take the runtime's pool, which waits for a connection (and
                    # may hold the idle ones the server counts against this pool).
                    if not self._open and self._opening == 1:  # this call's own attempt
                        self.refused = " ".join(str(err).split()) or type(err).__name__
                        self._wake()
                        raise PoolRefused(self.refused) from err
                    self._refused_until = self.loop.time() + REFUSED_BACKOFF_SECONDS
                    self._wake()
                    continue
                except BaseException:
                    self._wake()  # a caller waiting for room may try in its place
                    raise
                finally:
                    self._opening -= 1
                if self.closed:  # closed meanwhile: nobody will give it back
                    await conn.close()
                    raise _closed()
                self._refused_until = 0.0
                self._open.add(conn)
                return conn
            if room and not self._open and not self._opening:
                # Refused a moment ago, and the connections it waited for are gone since
                # (broken, not given back): nothing will wake a waiter; try again then.
                await asyncio.sleep(self._refused_until - now)
                continue
            waiter: asyncio.Future[None] = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken as it was cancelled: the turn goes to the next one
                else:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
                raise

    async def _put(self, conn: AsyncConnection[Any]) -> None:
        from psycopg.pq import TransactionStatus

        reusable = not (self.closed or conn.closed or conn.broken)
        if reusable and conn.info.transaction_status == TransactionStatus.IDLE:
            self._idle.append(conn)
        else:  # closed, broken, or left mid-statement (its caller cancelled): not reused
            self._open.discard(conn)
            with contextlib.suppress(Exception):
                await conn.close()
        self._wake()

    def _discard(self, conn: AsyncConnection[Any]) -> None:
        """Forget a connection the server has ended and close its socket."""
        self._open.discard(conn)
        with contextlib.suppress(Exception):
            conn.pgconn.finish()

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self, grace: float = 30.0) -> None:
        """Close the pool, on `loop`: calls waiting for a connection, and batches queued, fail
        with `StoreError` at once, and so do reads running; the writes running (a commit, an
        append, a pass record) end as they would, within `grace` seconds; past that the server
        is asked to cancel what still runs, and each write ends on its answer (`stop_writes`),
        so none is reported failed after the server committed it. Then the connections close."""
        if self.closed:
            return
        self.closed = True
        self._gone(self)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(_closed())
        loads, commits = self.batchers or (None, None)
        if loads is not None:
            await loads.close(READ_CLOSED)  # a read has nothing to finish
        writes = [*self._running, *(commits.tasks if commits is not None else ())]
        if writes:
            await asyncio.wait(writes, timeout=max(0.0, grace))
            await stop_writes(writes, lambda: [c for c in self._open if c not in self._idle])
        if commits is not None:
            await commits.close(READ_CLOSED, running=WRITE_GIVEN_UP)
        running = list(self._running)
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
        idle, self._idle = self._idle, []
        for conn in idle:  # those in use are closed as they come back (`_put`)
            self._open.discard(conn)
            if self._pid == os.getpid():
                with contextlib.suppress(Exception):
                    await conn.close()
        with contextlib.suppress(RuntimeError, StopIteration):  # no need to close it again
            self._end.aclose().send(None)

    def abandon(self) -> None:
        """Close the sockets of a pool whose loop has closed (any thread): nothing will ever run
        on that loop again, so nothing else uses them."""
        self.closed = True
        self._gone(self)
        conns, self._open, self._idle = list(self._open), set(), []
        if self._pid != os.getpid():  # a forked child: the sockets are its parent's too
            conns = []
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.pgconn.finish()
        with contextlib.suppress(RuntimeError, StopIteration):  # its `finally` awaits nothing
            self._end.aclose().send(None)


async def stop_writes(
    writes: Sequence[asyncio.Future[Any]],
    in_use: Callable[[], Iterable[AsyncConnection[Any]]],
) -> None:
    """Past a close's grace: ask the server to cancel the statements running on the connections
    `in_use`, round after round, until `writes` have ended (or `CANCEL_SECONDS` have passed).

    Each write then ends on the server's answer: cancelled (its transaction rolled back, a
    `StoreError`) or committed (its result). Cancelling a write's task instead would report it
    failed even when the server had committed it and its answer was on its way (psycopg
    raises the cancellation whatever the answer): the close does that only with what the
    server leaves unanswered (its outcome unknown: `WRITE_GIVEN_UP`)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + CANCEL_SECONDS
    while (pending := [w for w in writes if not w.done()]) and (left := end - loop.time()) > 0:
        await asyncio.gather(*(_cancel(conn, left) for conn in in_use()))
        await asyncio.wait(pending, timeout=min(CANCEL_ROUND_SECONDS, left))


async def _cancel(conn: AsyncConnection[Any], seconds: float) -> None:
    with contextlib.suppress(Exception):  # gone meanwhile, or no answer: the caller goes on
        await conn.cancel_safe(timeout=seconds)


async def _until_loop_ends(pool: LoopPool) -> AsyncGenerator[None, None]:
    """Closes `pool` when its loop shuts down its async generators (see `LoopPool`)."""
    try:
        yield
    finally:
        if not pool.closed:
            if _running_loop() is pool.loop:
                await pool.close()
            else:  # closed from elsewhere (the sweep found its loop closed)
                pool.abandon()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class PoolRefused(StoreError):
    """A loop's pool could not open a connection and holds none: its call (nothing sent yet)
    goes to the runtime's pool instead."""


#: What a read running, or a call waiting (a commit still queued too), fails with as the store
#: closes: the store closed, not the loop stopped (it has not), and nothing of the call written
#: (an append still reading the conversation it checks its rows against has not begun its write).
READ_CLOSED = StoreError("the store was closed before this call ended; nothing of it was written.")

#: What a write not ended within the close's grace fails with once the server has cancelled it
#: (its transaction rolled back: see `stop_writes`).
WRITE_CLOSED = StoreError(
    "the store was closed and this write, not ended within the close's grace, was cancelled by"
    " the server; its transaction was rolled back."
)

#: ... and one the server did not answer for (see `stop_writes`): its outcome is unknown.
WRITE_GIVEN_UP = WriteOutcomeUnknown(
    "the store was closed and this write, not ended within the close's grace, was given up: the"
    " server did not answer the request to cancel it, so it may have committed or not."
)


def _closed() -> StoreError:
    return StoreError("the store's connections on this event loop are closed; open a new Store.")


class SharedRowCache(RowCache):
    """`RowCache` for every loop of a store: each call holds a lock (a read on one loop may
    update it while a commit on another extends it)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()

    def usage(self, key: str, text: str | None) -> Usage:
        """See `RowCache.usage`."""
        with self._lock:
            return super().usage(key, text)

    def keep_usage(self, key: str, text: str, usage: Usage) -> None:
        """See `RowCache.keep_usage`."""
        with self._lock:
            super().keep_usage(key, text, usage)

    def get(self, key: str, created_at: float, version: int) -> tuple[ChunkRow, ...]:
        """See `RowCache.get`."""
        with self._lock:
            return super().get(key, created_at, version)

    def put(self, key: str, created_at: float, rows: tuple[ChunkRow, ...]) -> None:
        """See `RowCache.put`."""
        with self._lock:
            super().put(key, created_at, rows)

    def extend(
        self, key: str, base: int, rows: Sequence[ChunkRow], created_at: float | None = None
    ) -> None:
        """See `RowCache.extend`."""
        with self._lock:
            super().extend(key, base, rows, created_at)

    def drop(self, key: str) -> None:
        """See `RowCache.drop`."""
        with self._lock:
            super().drop(key)

    def clear(self) -> None:
        """See `RowCache.clear`."""
        with self._lock:
            super().clear()
