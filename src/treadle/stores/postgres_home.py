"""Where a PostgreSQL store's pool lives and how its calls reach it (`PostgresHome`, the base
of `treadle.stores.postgres.PostgresBackend`).

The pool lives on the Treadle runtime's event loop (psycopg's async pool belongs to the loop
that opened it); a call from another loop awaits the runtime without blocking its own loop.
The first use connects once with a timeout, so a DSN that does not connect is a
`ConfigurationError` naming what failed, fast (`postgres_open.open_pool`). When the runtime's
loop stops, every caller still waiting on it gets a `StoreError`, and the pool closes.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from treadle.errors import ConfigurationError, StoreError
from treadle.runtime import get_runtime
from treadle.stores.batching import Batcher
from treadle.stores.hop import LoopHop
from treadle.stores.postgres_open import display_url, open_pool
from treadle.stores.queueing import HeldLocks, PostgresKeyLock
from treadle.stores.records import RowCache, StoredConversation

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
        self._cache = RowCache()  # touched only on the runtime loop
        self._loads: Batcher[str, StoredConversation] | None = None  # on the runtime loop
        self._commits: Batcher[tuple[Any, ...], int] | None = None
        self._hop: LoopHop | None = None  # how callers on other loops reach the runtime's
        self._handovers: list[Batcher[Any, Any] | LoopHop] = []  # closed when its loop stops
        self._locks = HeldLocks()  # queue mode: the conversation locks its passes hold
        self._waiting: set[asyncio.Future[Any]] = set()  # on the runtime loop: lock waits

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

    async def _on_runtime(self, fn: Callable[[], Awaitable[T]]) -> T:
        # An operation, once started, runs to its end even if its caller is cancelled meanwhile
        # (a pass recording its own cancellation must not be cut short by it).
        runtime = self._home()
        if runtime.in_loop_thread():
            return await asyncio.shield(asyncio.ensure_future(self._guarded(fn)))
        hop = self._hop
        if hop is None or hop.home is not runtime.loop:
            hop = self._hop = LoopHop(runtime.loop)
            self._handovers.append(hop)
        return await hop.run(lambda: self._guarded(fn))

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
        return StoreError(f"the PostgreSQL store {self._url} failed: {' '.join(str(err).split())}.")

    async def _connection_pool(self) -> AsyncConnectionPool[AsyncConnection[Any]]:
        if self._pool is not None:
            return self._pool
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._pool is None:
                self._pool = await open_pool(
                    self._dsn, self._url, self._pool_size, self._connect_timeout
                )
                # A store never closed still closes its pool when the runtime stops (its
                # connections and maintenance tasks live on the runtime's loop).
                self._home().add_shutdown_hook(self.aclose)
        return self._pool

    async def _run(self, fn: Callable[[AsyncConnection[Any]], Awaitable[T]]) -> T:
        async def body() -> T:
            pool = await self._connection_pool()
            async with pool.connection() as conn:
                return await fn(conn)

        return await self._on_runtime(body)

    async def aclose(self, grace: float = 30.0) -> None:
        """Close the pool (safe to call twice; `grace` is the protocol's: the pool's close
        bounds its own wait)."""
        if self._closed:
            return

        async def close() -> None:
            pool, self._pool = self._pool, None
            self._closed = True
            for wait in list(self._waiting):  # passes waiting for their turn: a StoreError
                wait.cancel()
            if pool is not None:
                await pool.close()

        runtime = self._runtime
        if runtime is not None and runtime.in_loop_thread():
            await close()  # the runtime's own shutdown hook lands here
        elif runtime is not None and runtime.alive:
            await runtime.submit(close()).wait()
        else:  # never connected, or its loop is gone along with the pool's connections
            self._closed, self._pool = True, None


async def _close_all(handovers: list[Batcher[Any, Any] | LoopHop]) -> None:
    """Fail every caller still waiting on a stopping runtime loop with a `StoreError`."""
    for part in handovers:
        await part.close()
