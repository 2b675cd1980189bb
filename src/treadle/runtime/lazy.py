"""`LazyValue`: a handle on a coroutine running on the Treadle runtime.

A lazy value can be read from sync code (`result`, which blocks the calling thread) or awaited
from any event loop (which never blocks that loop). A blocking read from the runtime's own loop
thread raises `RuntimeLoopError` instead of deadlocking.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from treadle.errors import RuntimeLoopError

if TYPE_CHECKING:
    from treadle.runtime.background import Runtime

__all__ = ["LazyValue"]

T = TypeVar("T")


class LazyValue(Generic[T]):
    """The future result of a coroutine submitted to the runtime."""

    __slots__ = ("__weakref__", "_future", "_runtime", "_started", "_task")

    def __init__(self, future: concurrent.futures.Future[T], runtime: Runtime) -> None:
        self._future = future
        self._runtime = runtime
        self._task: asyncio.Task[T] | None = None
        self._started = False

    def done(self) -> bool:
        """True once the coroutine finished (with a value, an error, or cancelled)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> T:
        """Block until the value is ready and return it (re-raising the coroutine's error).

        Raises `TimeoutError` after `timeout` seconds, and `RuntimeLoopError` when called on the
        runtime's own loop thread before the value is ready (use `await` there).
        """
        future = self._future
        if not future.done():
            if self._runtime.in_loop_thread():
                raise RuntimeLoopError(
                    "a lazy value was read synchronously on the Treadle runtime's own event loop, "
                    "which would deadlock; use `await` on it instead."
                )
            try:
                return future.result(timeout)
            except concurrent.futures.TimeoutError:
                if future.done():  # the coroutine's own TimeoutError (ProviderTimeout...)
                    raise
                raise TimeoutError(
                    f"the value was not ready within {timeout} s; wait longer or await it."
                ) from None
        return future.result()

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
        self._runtime.call_soon(self._cancel_task)

    def _cancel_task(self) -> None:
        task = self._task
        if task is None or task.done():
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
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def _wake(_f: concurrent.futures.Future[T]) -> None:
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
