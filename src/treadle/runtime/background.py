"""The Treadle runtime: one background event loop on a daemon thread per process.

Passes run here as tasks, so thousands overlap while callers hold lazy handles. The runtime starts
on first use, drains and shuts down cleanly at interpreter exit, and is fork-safe: a child process
made with `os.fork()` starts a fresh runtime on first use instead of inheriting a dead thread.
Nothing here may block the loop; blocking waits happen only on callers' threads.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from treadle.runtime.lazy import LazyValue

__all__ = [
    "DEFAULT_DRAIN_SECONDS",
    "Runtime",
    "add_shutdown_hook",
    "get_runtime",
    "shutdown",
    "submit",
]

T = TypeVar("T")
log = logging.getLogger("treadle.runtime")

#: How long the exit handler lets running passes finish before cancelling them
#: (override with the TREADLE_DRAIN_SECONDS environment variable).
DEFAULT_DRAIN_SECONDS = 10.0

ShutdownHook = Callable[[], Awaitable[None]]


class Runtime:
    """A background asyncio event loop on a daemon thread, owning every task submitted to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._hooks: list[ShutdownHook] = []
        self._closed = False
        self._pid = os.getpid()
        # Passes submitted from other threads wait here; one wake-up of the loop starts every
        # one queued by then (a fan-out of thousands is not thousands of self-pipe writes and
        # thread switches).
        self._inbox: deque[tuple[Coroutine[Any, Any, Any], LazyValue[Any]]] = deque()
        self._inbox_armed = False
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="treadle-runtime", daemon=True
        )
        self._thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        self.loop.run_forever()

    @property
    def closed(self) -> bool:
        """True once `shutdown` ran."""
        return self._closed

    def in_loop_thread(self) -> bool:
        """True when called on the runtime's own loop thread."""
        return threading.get_ident() == self._thread.ident

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the loop thread soon (directly when already there)."""
        if self.in_loop_thread():
            self.loop.call_soon(fn)
        else:
            self.loop.call_soon_threadsafe(fn)

    def submit(self, coro: Coroutine[Any, Any, T]) -> LazyValue[T]:
        """Schedule `coro` on the runtime and return its `LazyValue` at once."""
        if self._closed:
            coro.close()
            raise RuntimeError("the Treadle runtime has shut down; no new work can start.")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        lazy = LazyValue(future, self)
        if self.in_loop_thread():
            self._start(coro, lazy)
            return lazy
        self._inbox.append((coro, lazy))
        if not self._inbox_armed:  # else a wake-up is on its way and will see this one too
            self._inbox_armed = True
            self.loop.call_soon_threadsafe(self._start_inbox)
        return lazy

    def _start_inbox(self) -> None:
        self._inbox_armed = False  # before draining: a later submit arms a new wake-up
        inbox = self._inbox
        while inbox:
            coro, lazy = inbox.popleft()
            self._start(coro, lazy)

    def _start(self, coro: Coroutine[Any, Any, T], lazy: LazyValue[T]) -> None:
        task = self.loop.create_task(_started(coro, lazy))
        lazy._task = task
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._settle(t, lazy._future))

    def _settle(self, task: asyncio.Task[T], future: concurrent.futures.Future[T]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            future.cancel()
            return
        error = task.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(task.result())

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the runtime and block the calling thread until it finishes."""
        return self.submit(coro).result(timeout)

    def add_shutdown_hook(self, hook: ShutdownHook) -> None:
        """Register an async callable run on the loop at shutdown (closing pooled clients)."""
        self._hooks.append(hook)

    @property
    def pending(self) -> int:
        """Number of submitted tasks still running."""
        return len(self._tasks)

    def shutdown(self, drain_seconds: float = DEFAULT_DRAIN_SECONDS) -> None:
        """Let running tasks finish for up to `drain_seconds`, cancel the rest, stop the loop."""
        if self._closed or self._pid != os.getpid():
            return
        self._closed = True
        if self.in_loop_thread():
            raise RuntimeError("the Treadle runtime cannot shut itself down from its own loop.")
        if self._thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(self._drain(drain_seconds), self.loop)
            with contextlib.suppress(Exception):
                done.result(drain_seconds + 10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()

    async def _drain(self, drain_seconds: float) -> None:
        tasks = set(self._tasks)
        if tasks:
            _, still = await asyncio.wait(tasks, timeout=drain_seconds)
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still, timeout=5)
        for hook in self._hooks:
            try:
                await hook()
            except Exception:  # a failing hook must not stop the others from closing
                log.exception("a Treadle shutdown hook failed")
        await self.loop.shutdown_asyncgens()
        await self.loop.shutdown_default_executor()


async def _started(coro: Coroutine[Any, Any, T], lazy: LazyValue[T]) -> T:
    lazy._started = True
    return await coro


_lock = threading.Lock()
_runtime: Runtime | None = None


def get_runtime() -> Runtime:
    """The process's runtime, started on first use (and anew in a forked child)."""
    global _runtime
    rt = _runtime
    if rt is not None and not rt.closed and rt._pid == os.getpid():
        return rt
    with _lock:
        rt = _runtime
        if rt is None or rt.closed or rt._pid != os.getpid():
            rt = Runtime()
            _runtime = rt
        return rt


def submit(coro: Coroutine[Any, Any, T]) -> LazyValue[T]:
    """Schedule `coro` on the process's runtime and return its `LazyValue` at once."""
    return get_runtime().submit(coro)


def add_shutdown_hook(hook: ShutdownHook) -> None:
    """Register an async callable run on the runtime loop when the runtime shuts down."""
    get_runtime().add_shutdown_hook(hook)


def shutdown(drain_seconds: float | None = None) -> None:
    """Drain and stop the process's runtime (the next use starts a new one)."""
    global _runtime
    with _lock:
        rt, _runtime = _runtime, None
    if rt is not None:
        if drain_seconds is None:
            drain_seconds = float(os.environ.get("TREADLE_DRAIN_SECONDS", DEFAULT_DRAIN_SECONDS))
        rt.shutdown(drain_seconds)


def _after_fork_in_child() -> None:
    # The runtime thread does not exist in the child; forget it (and the lock, which may have
    # been held by another parent thread at fork time).
    global _runtime, _lock
    _runtime = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown)
