"""`LoopHop`: run store operations on the loop that owns the connections, for callers on other
loops, with one wake-up of each loop per batch instead of one per operation.

A PostgreSQL store's pool lives on the Treadle runtime's loop; a pass running on another loop
(an application's own `asyncio.run`) hands each store call over and awaits its outcome. Passes
that end together make many such calls at once: they start on the owning loop after a single
thread-safe wake-up, and the outcomes finished in one iteration of that loop go back to each
caller's loop in one thread-safe call (as the SQLite store's thread does). An operation, once
handed over, runs to its end even if its caller is cancelled (its outcome is then dropped).
`close()` (when the owning loop stops) fails every operation still waiting, and every later
one, with `StoreError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from treadle.errors import StoreError

__all__ = ["LoopHop"]

T = TypeVar("T")

_Job = tuple[Callable[[], Awaitable[Any]], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]
_Outcome = tuple["asyncio.Future[Any]", Any, BaseException | None]


class LoopHop:
    """Hands operations to `home` (a running loop in another thread) in batches."""

    def __init__(self, home: asyncio.AbstractEventLoop) -> None:
        self.home = home
        self._inbox: deque[_Job] = deque()
        self._armed = False
        self._lock = threading.Lock()
        self._outbox: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
        self._flushing = False
        self._running: set[asyncio.Future[Any]] = set()
        self._closed = False

    async def close(self) -> None:
        """Fail the operations not started, cancel the running ones (their callers get a
        `StoreError`) and refuse later ones: on the home loop, before it stops."""
        with self._lock:
            self._closed = True
            jobs, self._inbox = self._inbox, deque()
        for _, loop, future in jobs:
            self._outbox.setdefault(loop, []).append((future, None, _stopped()))
        running = list(self._running)
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
        self._flush()  # now: the loop may stop before a scheduled flush runs

    async def run(self, fn: Callable[[], Awaitable[T]]) -> T:
        """`await fn()` on the home loop, from the caller's loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                raise _stopped()
            self._inbox.append((fn, loop, future))
            wake = not self._armed
            self._armed = True
        if wake:
            try:
                self.home.call_soon_threadsafe(self._start)
            except RuntimeError:  # the home loop has closed: nothing would run the job
                with self._lock:
                    self._armed = False
                    self._inbox.clear()
                raise _stopped() from None
        return await future

    def _start(self) -> None:
        with self._lock:
            jobs, self._inbox = self._inbox, deque()
            self._armed = False
        for fn, loop, future in jobs:
            task = asyncio.ensure_future(fn())
            self._running.add(task)
            task.add_done_callback(functools.partial(self._done, loop, future))

    def _done(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
        task: asyncio.Future[Any],
    ) -> None:
        self._running.discard(task)
        if task.cancelled():
            outcome: _Outcome = (future, None, StoreError("the store operation was cancelled."))
        elif task.exception() is not None:
            outcome = (future, None, task.exception())
        else:
            outcome = (future, task.result(), None)
        self._outbox.setdefault(loop, []).append(outcome)
        if not self.home.is_running():  # shutting down: a later callback might never run
            self._flush()
        elif not self._flushing:  # after the callbacks of this iteration: one call per loop
            self._flushing = True
            self.home.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        outbox, self._outbox = self._outbox, {}
        for loop, settled in outbox.items():
            with contextlib.suppress(RuntimeError):  # that loop has closed: no one waits
                loop.call_soon_threadsafe(_settle, settled)


def _stopped() -> StoreError:
    return StoreError("the store's event loop has stopped; open a new Store.")


def _settle(settled: list[_Outcome]) -> None:
    for future, value, error in settled:
        if future.done():  # its caller was cancelled (the operation still ran)
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
