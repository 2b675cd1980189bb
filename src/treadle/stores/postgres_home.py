"""Where a PostgreSQL store's pools live and how its calls reach them (`PostgresHome`, the
base of `treadle.stores.postgres.PostgresBackend`).

The store's first pool lives on the Treadle runtime's event loop (psycopg's async pool belongs
to the loop that opened it): the sync API's calls run there, and a call from another loop
awaits the runtime without blocking its own loop. A loop that uses the store enough gets a
pool of its own (`treadle.stores.postgres_loops`: how many, and when each closes), so its hot
path (the batched reads and commits) no longer crosses threads. The first use connects once
with a timeout, so a DSN that does not connect is a `ConfigurationError` naming what failed,
fast (`postgres_open.prepare`). When the runtime's loop stops, every caller still waiting on it
gets a `StoreError`, and the store closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from treadle.errors import ConfigurationError, StoreError, WriteOutcomeUnknown
from treadle.runtime import get_runtime
from treadle.stores import postgres_loops
from treadle.stores.batching import Batcher
from treadle.stores.hop import LoopHop
from treadle.stores.postgres_loops import LoopPool, PoolRefused, SharedRowCache
from treadle.stores.postgres_open import alive, connect, display_url, open_pool, prepare
from treadle.stores.queueing import HeldLocks, PostgresKeyLock
from treadle.stores.records import StoredConversation

if TYPE_CHECKING:
    from psycopg import AsyncConnection
    from psycopg_pool import AsyncConnectionPool

    from treadle.runtime.background import Runtime

__all__ = ["PostgresHome"]

T = TypeVar("T")


class PostgresHome:
    """A PostgreSQL store's pool on the runtime's loop, and the way there from any loop."""

    def __init__(self, dsn: str, *, pool_size: int = 10, connect_timeout: float = 5.0) -> None:
        if not isinstance(dsn, str) or not dsn:
            raise ConfigurationError("Store.postgres needs a DSN, e.g. postgresql://host/db.")
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
            raise ConfigurationError("pool_size must be a positive int.")
        if not isinstance(connect_timeout, (int, float)) or connect_timeout <= 0:
            raise ConfigurationError("connect_timeout must be a positive number of seconds.")
        self._url = display_url(dsn)
        self._dsn = dsn
        self._pool_size = pool_size
        self._connect_timeout = float(connect_timeout)
        self._pool: AsyncConnectionPool[AsyncConnection[Any]] | None = None
        self._opening: asyncio.Lock | None = None
        self._closed = False
        self._runtime: Runtime | None = None  # where the pool lives, once it does
        self._cache = SharedRowCache()  # one for every loop's reads and commits
        self._prepared = False  # the schema exists (checked by the first connection)
        self._loop_pools: dict[asyncio.AbstractEventLoop, LoopPool] = {}  # see _local
        self._loop_pools_lock = threading.RLock()  # _gone runs under it (a sweep)
        self._sweeper: Runtime | None = None  # the runtime looking for closed loops, if any
        self._loads: Batcher[str, StoredConversation] | None = None  # on the runtime loop
        self._commits: Batcher[tuple[Any, ...], int] | None = None
        self._hop: LoopHop | None = None  # how callers on other loops reach the runtime's
        self._handovers: list[Batcher[Any, Any] | LoopHop] = []  # closed when its loop stops
        self._locks = HeldLocks()  # queue mode: the conversation locks its passes hold
        self._waiting: set[asyncio.Future[Any]] = set()  # on the runtime loop: lock waits
        self._running: set[asyncio.Future[Any]] = set()  # on the runtime loop: see `_on_runtime`
        self._closing_writes: tuple[asyncio.Future[Any], ...] = ()  # what `aclose` waits for
        self._in_use: set[AsyncConnection[Any]] = set()  # the runtime pool's, lent out now

    @property
    def url(self) -> str:
        """`postgresql://user@host:port/dbname` (never the password)."""
        return self._url

    # -- the pool, on the runtime loop ---------------------------------------------------------
    def _home(self) -> Runtime:
        """The runtime whose loop holds the pool (a stopped one's pool is left behind)."""
        runtime = self._runtime
        if runtime is None or not (runtime.alive or runtime.in_loop_thread()):
            self._pool, self._opening = None, None  # its loop is gone: connect anew
            self._loads = self._commits = None
            runtime = self._runtime = get_runtime()
            # Its callers on other loops must not wait forever for work its loop will never
            # finish: when it stops, each gets a StoreError (before the pool closes).
            self._handovers = []
            runtime.add_shutdown_hook(functools.partial(_close_all, self._handovers))
        return runtime

    # -- a calling loop's own pool (see treadle.stores.postgres_loops) --------------------------
    def _local(self) -> LoopPool | None:
        """The running loop's own pool, once the loop has made enough calls to get one; None
        on the runtime's loop, for a loop past the cap, and until then (the hop is taken)."""
        loop = asyncio.get_running_loop()
        pool = self._loop_pools.get(loop)
        if pool is None:
            runtime = self._runtime
            if self._closed or (runtime is not None and runtime.loop is loop):
                return None
            pool = self._new_loop_pool(loop)
            if pool is None:
                return None
        if pool.calls < postgres_loops.OWN_POOL_AFTER:
            pool.calls += 1
            return None
        return None if pool.closed or pool.refused else pool

    def _new_loop_pool(self, loop: asyncio.AbstractEventLoop) -> LoopPool | None:
        runtime = self._home()
        if runtime.loop is loop:
            return None
        self._sweep_closed()
        with self._loop_pools_lock:
            if len(self._loop_pools) >= postgres_loops.LOOP_POOLS:
                return None  # past the cap: this loop takes the hop
            pool = LoopPool(loop, self._pool_size, self._connect, self._forget_pool)
            self._loop_pools[loop] = pool
            start_sweep = self._sweeper is not runtime
            self._sweeper = runtime
        if start_sweep:  # the runtime's loop looks for loops closed without closing theirs
            runtime.loop.call_soon_threadsafe(self._sweep_later)
        return pool

    async def _connect(self) -> AsyncConnection[Any]:
        """A new connection of a loop's own pool (the schema checked first, once)."""
        if not self._prepared:
            await prepare(self._dsn, self._url, self._connect_timeout)
            self._prepared = True
        return await connect(self._dsn, self._connect_timeout)

    def _forget_pool(self, pool: LoopPool) -> None:
        with self._loop_pools_lock:
            if self._loop_pools.get(pool.loop) is pool:
                del self._loop_pools[pool.loop]

    def _sweep_closed(self) -> bool:
        """Close the sockets of pools whose loop has closed; whether any pool is left."""
        for pool in list(self._loop_pools.values()):
            if pool.loop.is_closed():
                pool.abandon()
        return bool(self._loop_pools)

    def _sweep_later(self) -> None:
        """On the runtime's loop, every `SWEEP_SECONDS` while any loop has a pool (a runtime
        that stops takes its sweep along: the next loop's pool starts one on the new one)."""
        with self._loop_pools_lock:
            go_on = self._sweep_closed()
            if not go_on:
                self._sweeper = None
        if go_on:
            asyncio.get_running_loop().call_later(postgres_loops.SWEEP_SECONDS, self._sweep_later)

    @contextlib.asynccontextmanager
    async def _connection(self, local: LoopPool | None) -> AsyncIterator[AsyncConnection[Any]]:
        """A connection of the loop's own pool (`local`), or of the runtime's."""
        if local is not None:
            async with local.connection() as conn:
                yield conn
        else:
            pool = await self._connection_pool()
            async with pool.connection() as conn:
                if alive(conn):
                    self._in_use.add(conn)  # the close may ask the server to cancel its work
                    try:
                        yield conn
                    finally:
                        self._in_use.discard(conn)
                    return
                await conn.close()  # the server ended it while idle (a restart): discarded
            await pool.check()  # the others it ended too are replaced, not handed out later
            async with pool.connection() as conn:
                self._in_use.add(conn)
                try:
                    yield conn
                finally:
                    self._in_use.discard(conn)

    async def _on_runtime(self, fn: Callable[[], Awaitable[T]]) -> T:
        # An operation, once started, runs to its end even if its caller is cancelled meanwhile
        # (a pass recording its own cancellation must not be cut short by it).
        runtime = self._home()
        if runtime.in_loop_thread():
            return await asyncio.shield(asyncio.ensure_future(self._tracked(fn)))
        hop = self._hop
        if hop is None or hop.home is not runtime.loop:
            hop = self._hop = LoopHop(runtime.loop)
            self._handovers.append(hop)
        return await hop.run(lambda: self._tracked(fn))

    async def _tracked(self, fn: Callable[[], Awaitable[T]]) -> T:
        """`_guarded(fn)` as a task the store's close knows (on the runtime's loop): it lets
        the task end within its grace and has the server cancel it past that, as a loop's pool
        does with its own (`LoopPool.close`, `postgres_loops.stop_writes`)."""
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            return await self._guarded(fn)
        except asyncio.CancelledError:
            # No caller cancels this task (it is shielded from them, or the hop's own): the
            # close did, the server not answering (or the runtime stops): a typed error.
            if self._closed:
                raise WriteOutcomeUnknown(str(postgres_loops.WRITE_GIVEN_UP)) from None
            raise
        finally:
            self._running.discard(task)

    async def _on_home(self, fn: Callable[[], Awaitable[T]], cancellable: bool) -> T:
        # A conversation lock: waiting for it is cancelled with its caller; anything else (a
        # release) runs to its end like every operation.
        if not cancellable:
            return await self._on_runtime(fn)
        runtime = self._home()
        if runtime.in_loop_thread():
            return await self._guarded(fn)
        return await runtime.submit(self._guarded(fn)).wait()

    async def lock(self, key: str) -> PostgresKeyLock:
        """Hold `key`'s conversation lock (queue mode; see `treadle.stores.queueing`)."""
        await self._on_runtime(self._connection_pool)  # the schema exists, the DSN connects
        held = await PostgresKeyLock.acquire(
            self._dsn, key, self._connect_timeout, self._on_home_waiting
        )
        self._locks.add(key, held)
        return held

    async def _on_home_waiting(self, fn: Callable[[], Awaitable[T]], cancellable: bool) -> T:
        # A lock's wait, in a task of its own on the runtime's loop that closing the store
        # cancels: a pass waiting for its turn then fails with a StoreError at once instead of
        # waiting for the holder to end (its wait is on the server, on a connection of its own).
        async def tracked() -> T:
            wait = asyncio.ensure_future(fn())
            self._waiting.add(wait)
            try:
                return await wait
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed and wait.cancelled() and task is not None and not task.cancelling():
                    raise StoreError(
                        f"the store {self._url} was closed while this pass waited for its turn."
                    ) from None
                raise
            finally:
                self._waiting.discard(wait)

        return await self._on_home(tracked, cancellable)

    async def _guarded(self, fn: Callable[[], Awaitable[T]]) -> T:
        import psycopg

        if self._closed:
            raise StoreError(f"the store {self._url} is closed; open a new Store.")
        try:
            return await fn()
        except psycopg.Error as err:
            raise self._failed(err) from None

    def _failed(self, err: BaseException) -> StoreError:
        import psycopg

        if self._closed and isinstance(err, psycopg.errors.QueryCanceled):  # by the close
            return StoreError(str(postgres_loops.WRITE_CLOSED))
        return StoreError(f"the PostgreSQL store {self._url} failed: {' '.join(str(err).split())}.")

    async def _connection_pool(self) -> AsyncConnectionPool[AsyncConnection[Any]]:
        if self._pool is not None:
            return self._pool
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._pool is None:
                self._pool = await open_pool(
                    self._dsn, self._url, self._pool_size, self._connect_timeout,
                    prepared=self._prepared,
                )  # fmt: skip
                self._prepared = True
                # A store never closed still closes its pool when the runtime stops (its
                # connections and maintenance tasks live on the runtime's loop).
                self._home().add_shutdown_hook(self.aclose)
        return self._pool

    async def _run(self, fn: Callable[[AsyncConnection[Any]], Awaitable[T]]) -> T:
        local = self._local()

        async def body(where: LoopPool | None = local) -> T:
            async with self._connection(where) as conn:
                return await fn(conn)

        if local is None:
            return await self._on_runtime(body)
        # Once started, it runs to its end even if its caller is cancelled (as on the runtime).
        try:
            return await local.run(self._guarded(body))
        except PoolRefused:  # nothing was sent: the runtime's pool waits for a connection
            return await self._on_runtime(functools.partial(body, None))

    async def aclose(self, grace: float = 30.0) -> None:
        """Close the pools (safe to call twice): calls waiting, and reads, fail at once with
        `StoreError`; writes running end as they would within `grace` seconds, and what still
        runs then is cancelled by the server (on the runtime's pool as on a loop's own:
        `LoopPool.close`). One deadline for every pool: they close at once, each given what
        is left of `grace`, and the close returns once all have (another loop's too)."""
        if self._closed:
            return
        deadline = time.monotonic() + max(0.0, grace)

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        async def close() -> None:
            self._closed = True  # no call starts (one waiting for the runtime fails at once)
            for wait in list(self._waiting):  # passes waiting for their turn: a StoreError
                wait.cancel()
            # As on a loop's own pool (`LoopPool.close`): the reads fail at once, the writes
            # running (an append, a commit, a pass record) end as they would within the grace;
            # past that the server cancels what still runs and each write ends on its answer
            # (`stop_writes`), so none is reported failed after the server committed it.
            loads, commits = self._loads, self._commits
            if loads is not None:
                await loads.close(postgres_loops.READ_CLOSED)
            writes = (*self._running, *(commits.tasks if commits is not None else ()))
            if writes:
                self._closing_writes = writes
                await asyncio.wait(writes, timeout=left())
                await postgres_loops.stop_writes(writes, lambda: list(self._in_use))
                self._closing_writes = ()
            if commits is not None:
                await commits.close(
                    postgres_loops.READ_CLOSED, running=postgres_loops.WRITE_GIVEN_UP
                )
            running = list(self._running)
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running)
            pool, self._pool = self._pool, None
            if pool is not None:
                await pool.close()

        self._closed = True  # no loop gets a new pool, no call starts
        others = self._close_other_loops(left)
        parts = [pool.close(left()) for pool in self._pools_of(asyncio.get_running_loop())]
        runtime = self._runtime
        if runtime is not None and runtime.in_loop_thread():
            parts.append(close())  # the runtime's own shutdown hook lands here
        elif runtime is not None and runtime.alive:
            parts.append(runtime.submit(close()).wait())
        else:  # never connected, or its loop is gone along with the pool's connections
            self._pool = None
        ended = await asyncio.gather(*parts, return_exceptions=True)
        await _wait_for_loops(others, left)
        for outcome in ended:
            if isinstance(outcome, BaseException):
                raise outcome

    def _pools_of(self, loop: asyncio.AbstractEventLoop) -> list[LoopPool]:
        return [pool for pool in list(self._loop_pools.values()) if pool.loop is loop]

    def _close_other_loops(
        self, left: Callable[[], float]
    ) -> list[tuple[threading.Event, asyncio.Future[None], asyncio.AbstractEventLoop]]:
        """Start closing every other loop's own pool on its loop (a closed loop's sockets at
        once): each close, with the event set once it has begun on its loop."""
        here = asyncio.get_running_loop()
        started: list[tuple[threading.Event, asyncio.Future[None], asyncio.AbstractEventLoop]] = []
        for pool in list(self._loop_pools.values()):
            if pool.loop is here:
                continue
            if pool.loop.is_closed():
                pool.abandon()
                continue
            begun = threading.Event()

            async def closing(pool: LoopPool = pool, begun: threading.Event = begun) -> None:
                begun.set()
                await pool.close(left())

            coro = closing()
            try:
                future = asyncio.run_coroutine_threadsafe(coro, pool.loop)
            except RuntimeError:  # its loop closed just now
                coro.close()
                pool.abandon()
                continue
            started.append((begun, asyncio.wrap_future(future), pool.loop))
        return started


async def _wait_for_loops(
    closes: list[tuple[threading.Event, asyncio.Future[None], asyncio.AbstractEventLoop]],
    left: Callable[[], float],
) -> None:
    """Wait for other loops' pools to close: within the grace, then (past it) the server's
    answers to the cancels of the writes still running there (`CANCEL_SECONDS` and a second
    to close the connections) for each close that has begun. A loop that never ran its close
    (blocked) is not waited for past the grace, and one closed meanwhile not at all (its
    pool's sockets are closed by `_until_loop_ends` or the sweep): nothing hangs on them."""

    def waited() -> list[asyncio.Future[None]]:
        return [f for _, f, loop in closes if not f.done() and not loop.is_closed()]

    while (pending := waited()) and left() > 0:  # a closed loop is seen within a round
        await asyncio.wait(pending, timeout=min(left(), _LOOP_ROUND_SECONDS))
    begun = [f for started, f, _ in closes if started.is_set() and f in waited()]
    if begun:
        await asyncio.wait(begun, timeout=postgres_loops.CANCEL_SECONDS + 1.0)
    for _, future, _ in closes:
        if future.done() and not future.cancelled():
            future.exception()  # retrieved: a close that failed is not logged as unretrieved


#: How often a close waiting for other loops' pools looks for loops closed meanwhile.
_LOOP_ROUND_SECONDS = 0.1


async def _close_all(handovers: list[Batcher[Any, Any] | LoopHop]) -> None:
    """Fail every caller still waiting on a stopping runtime loop with a `StoreError`."""
    for part in handovers:
        await part.close()
