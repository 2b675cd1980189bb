"""`LazyValue`: a handle on a coroutine running on the Treadle runtime.

A lazy value can be read from sync code (`result`, which blocks the calling thread) or awaited
from any event loop (which never blocks that loop). A blocking read on a thread running an event
loop (the runtime's or any other) raises `RuntimeLoopError` instead of stalling or deadlocking that
loop; a read in a forked child of a value that was pending at fork time raises at once (the
runtime that would settle it does not exist there). A blocking read on a worker thread lends that
thread's limiter slot to others while it waits (see `treadle.runtime.threads`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from treadle.errors import RuntimeLoopError
from treadle.runtime.settling import Settling
from treadle.runtime.threads import in_worker_thread, lending_slot

if TYPE_CHECKING:
    from treadle.runtime.background import Runtime

__all__ = ["LazyValue"]

T = TypeVar("T")
U = TypeVar("U")
V = TypeVar("V")


class LazyValue(Generic[T]):
    """The future result of a coroutine submitted to the runtime."""

    __slots__ = (
        "__weakref__", "_also", "_cancel_asked", "_future", "_runtime", "_source", "_started",
        "_task",
    )  # fmt: skip

    def __init__(self, future: Settling[T], runtime: Runtime) -> None:
        self._future = future
        self._runtime = runtime
        self._task: asyncio.Task[T] | None = None
        self._started = False
        self._cancel_asked = False  # cancelled before the runtime started it (a full start gate)
        self._source: LazyValue[Any] | None = None
        self._also: LazyValue[Any] | None = None  # a join's second source

    def done(self) -> bool:
        """True once the coroutine finished (with a value, an error, or cancelled)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> T:
        """Block until the value is ready and return it (re-raising the coroutine's error).

        Raises `TimeoutError` after `timeout` seconds, and `RuntimeLoopError` when called before
        the value is ready on a thread running an event loop (use `await` there) or in a forked
        child for a value that was pending at fork time.
        """
        future = self._future
        if not future.done():
            self._check_blocking_read()
            try:
                if not in_worker_thread():  # the usual reader: no slot to lend, no context manager
                    return future.result(timeout)
                with lending_slot():
                    return future.result(timeout)
            except concurrent.futures.TimeoutError:
                if future.done():  # the coroutine's own TimeoutError (ProviderTimeout...)
                    raise
                raise TimeoutError(
                    f"the value was not ready within {timeout} s; wait longer or await it."
                ) from None
        return future.result()

    def _check_blocking_read(self) -> None:
        if self._runtime.forked_away():
            raise RuntimeLoopError(
                f"this value was still pending when process {self._runtime.pid} forked; the "
                "runtime that would finish it does not exist in this child process. Read it in "
                "the parent, or start the work again in the child."
            )
        if self._runtime.in_loop_thread():
            raise RuntimeLoopError(
                "a lazy value was read synchronously on the Treadle runtime's own event loop, "
                "which would deadlock; use `await` on it instead."
            )
        # Asked without `get_running_loop`'s RuntimeError: on a thread with no loop (every
        # blocking reader) raising and catching it cost about a microsecond a read.
        if asyncio._get_running_loop() is None:
            return
        raise RuntimeLoopError(
            "a pending lazy value was read synchronously inside a running event loop, which "
            "would block that loop until the pass ends; use `await session` (or `await value`) "
            "there instead."
        )

    def then(self, fn: Callable[[T], U]) -> LazyValue[U]:
        """A lazy value that settles with `fn(value)` once this one settles (errors pass on).

        Returns at once. `fn` runs on whichever thread settles this value, so it must be quick and
        must not block (it derives a value; it does no I/O). Cancelling the derived value
        cancels this one.
        """
        future: Settling[U] = Settling()
        derived: LazyValue[U] = LazyValue(future, self._runtime)
        derived._source = self

        def settle(done: Settling[T]) -> None:
            if done.cancelled():
                future.cancel()
                return
            error = done.exception()
            if error is not None:
                future.set_exception(error)
                return
            try:
                future.set_result(fn(done.result()))
            except BaseException as err:  # the derivation's own error is the derived value's
                future.set_exception(err)

        self._future.add_done_callback(settle)
        return derived

    def join(self, other: LazyValue[V], fn: Callable[[T, V], U]) -> LazyValue[U]:
        """A lazy value that settles with `fn(mine, theirs)` once both values settled.

        Returns at once. The first error (or cancellation) of either side settles it at once,
        without waiting for the other. `fn` runs on whichever thread settles last, so like
        `then`'s it must be quick. Cancelling the joined value cancels both sides.
        """
        future: Settling[U] = Settling()
        joined: LazyValue[U] = LazyValue(future, self._runtime)
        joined._source, joined._also = self, other
        lock = threading.Lock()
        mine, theirs = self._future, other._future

        def settle(_done: Settling[Any]) -> None:
            with lock:  # both sides may settle at once, on two threads
                if future.done():
                    return
                for side in (mine, theirs):
                    if side.done() and side.cancelled():
                        future.cancel()
                        return
                    error = side.exception() if side.done() else None
                    if error is not None:
                        future.set_exception(error)
                        return
                if not (mine.done() and theirs.done()):
                    return
                try:
                    future.set_result(fn(mine.result(), theirs.result()))
                except BaseException as err:  # the derivation's own error is the joined value's
                    future.set_exception(err)

        mine.add_done_callback(settle)
        theirs.add_done_callback(settle)
        return joined

    def exception(self) -> BaseException | None:
        """The coroutine's error once done (None when it succeeded); does not block."""
        if not self._future.done():
            return None
        if self._future.cancelled():
            return concurrent.futures.CancelledError()
        return self._future.exception()

    def cancel(self) -> None:
        """Ask the coroutine to stop (thread-safe). The value settles once it has cleaned up."""
        if self._future.done():
            return
        if self._source is not None:
            self._source.cancel()
            if self._also is not None:
                self._also.cancel()
            return
        self._runtime.call_soon(self._cancel_task)

    def _cancel_task(self) -> None:
        task = self._task
        if task is None:  # not started yet: the runtime cancels it as it starts
            self._cancel_asked = True
            return
        if task.done():
            return
        if not self._started:
            # A task cancelled before its first step never runs its body, so the coroutine could
            # not turn the cancellation into a clean stop; deliver it once the body has started.
            self._runtime.loop.call_soon(self._cancel_task)
            return
        task.cancel()

    def add_done_callback(self, fn: Callable[[LazyValue[T]], Any]) -> None:
        """Call `fn(self)` when done, on whichever thread settles the value."""
        self._future.add_done_callback(lambda _f: fn(self))

    async def wait(self, *, propagate_cancel: bool = True) -> T:
        """Await the value from any event loop without blocking it.

        With `propagate_cancel` (the default), cancelling the awaiting task cancels the
        coroutine too; internal waits (one pass waiting for its input) pass False so a shared
        input is never cancelled by one of its consumers.
        """
        future = self._future
        if future.done():
            return future.result()
        if self._runtime.forked_away():
            self._check_blocking_read()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def _wake(_f: Settling[T]) -> None:
            def _set() -> None:
                if not waiter.done():
                    waiter.set_result(None)

            # RuntimeError: the awaiting loop has closed meanwhile; nobody is left to wake.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_set)

        future.add_done_callback(_wake)
        try:
            await waiter
        except asyncio.CancelledError:
            if propagate_cancel:
                self.cancel()
            raise
        return future.result()

    def __await__(self) -> Generator[Any, None, T]:
        return self.wait().__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<LazyValue {state}>"
