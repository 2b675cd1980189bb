"""Worker threads for blocking work: per-loop limiters whose slots user code cannot keep hostage.

Blocking work (sync tools, sync callbacks and guardrails, sync executors, file I/O) runs on anyio
worker threads under a `LoopThreadLimiter`: one `anyio.CapacityLimiter` per event loop and kind of
work. Two rules keep a bounded pool from ever deadlocking the runtime:

- A worker thread that blocks reading a pending lazy value (a sync tool reading its sub-agent's
  result) gives its slot back while it waits (`lending_slot`): the limiter grows by one until the
  read returns. So passes started and read from worker threads nest at any depth and count; the
  cap bounds only threads that are *running* user code.
- The runtime's own I/O (the JSONL writer, sandbox file I/O) has limiters of its own, never the
  ones user code runs under, so persistence never waits behind user code.

A call whose wait is abandoned (a timeout) gives its slot back at once: Python threads cannot be
killed, so a runaway thread keeps running; `thread_stats()` counts those for operators.
This module never blocks an event loop and never uses a loop's default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import anyio
import anyio.to_thread

__all__ = [
    "INTERNAL_IO_THREADS",
    "USER_CODE_THREADS",
    "LoopThreadLimiter",
    "internal_io",
    "lending_slot",
    "load_async_backend",
    "run_internal_io",
    "run_user_code",
    "thread_stats",
]


_backend_loaded = False


def load_async_backend() -> None:
    """Import anyio's asyncio backend (once; every pass calls this as it starts).

    Not at import (20 ms of every program's first import), and not on anyio's own first use
    either: that can be a pass's shielded cleanup after the process ran out of file descriptors
    (EMFILE), where the import cannot open its source file and a raw OSError would replace the
    pass's typed error. A pass starting is before it opened anything.
    """
    global _backend_loaded
    if not _backend_loaded:
        import anyio._backends._asyncio  # noqa: F401

        _backend_loaded = True


T = TypeVar("T")
log = logging.getLogger("treadle.runtime")

#: Most sync callbacks, guardrails and sync executors running at once on one event loop.
USER_CODE_THREADS = 40
#: Threads per event loop for the runtime's own file I/O (the JSONL writer).
INTERNAL_IO_THREADS = 16


class _ThreadState(threading.local):
    """What a worker thread running a pass's user code holds (nothing on other threads)."""

    # A class default: a thread that never set its slot reads None without `getattr`'s
    # AttributeError (raised and caught inside it: about 4k instructions, twice for every
    # lazy pass, at its submit and at its read; docs/performance.md, the facade's hand-off).
    slot: tuple[asyncio.AbstractEventLoop, anyio.CapacityLimiter] | None = None


_local = _ThreadState()
_stats_lock = threading.Lock()
_abandoned_total = 0
_abandoned_running = 0


class LoopThreadLimiter:
    """One `anyio.CapacityLimiter` of `total` threads per running event loop."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a thread limiter needs at least one thread")
        self.total = total
        self._lock = threading.Lock()
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter]
        self._by_loop = weakref.WeakKeyDictionary()

    def get(self) -> anyio.CapacityLimiter:
        """The limiter for the current event loop (created on first use)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            limiter = self._by_loop.get(loop)
            if limiter is None:
                limiter = anyio.CapacityLimiter(self.total)
                self._by_loop[loop] = limiter
            return limiter

    async def run(self, fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False) -> T:
        """Run `fn(*args)` on a worker thread under this limiter.

        With `abandon_on_cancel`, a cancelled wait returns at once while the thread runs on; the
        thread is counted in `thread_stats()` until it returns.
        """
        limiter = self.get()
        call = _Call(fn, args, asyncio.get_running_loop(), limiter)
        try:
            return await anyio.to_thread.run_sync(
                call.run, limiter=limiter, abandon_on_cancel=abandon_on_cancel
            )
        except anyio.get_cancelled_exc_class():
            if abandon_on_cancel:
                call.abandon()
            raise


class _Call:
    """One call on a worker thread: marks the thread with its limiter, notes abandonment."""

    __slots__ = ("_abandoned", "_args", "_done", "_fn", "_limiter", "_lock", "_loop", "_started")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop,
        limiter: anyio.CapacityLimiter,
    ) -> None:
        self._fn, self._args, self._loop, self._limiter = fn, args, loop, limiter
        self._lock = threading.Lock()
        self._done = False
        self._started = False
        self._abandoned = False

    def run(self) -> Any:
        with self._lock:
            if self._abandoned:  # the caller left before this thread picked the call up
                return None
            self._started = True
        _local.slot = (self._loop, self._limiter)
        try:
            return self._fn(*self._args)
        finally:
            _local.slot = None
            with self._lock:
                self._done = True
                abandoned = self._abandoned
            if abandoned:
                _count_abandoned(-1)

    def abandon(self) -> None:
        with self._lock:
            if self._done or self._abandoned:
                return
            self._abandoned = True
            if not self._started:
                return
        _count_abandoned(+1)
        name = getattr(self._fn, "__name__", None) or repr(self._fn)
        log.warning(
            "a sync call (%s) ignored cancellation and was abandoned on its thread, which keeps "
            "running; see treadle.runtime.stats()",
            name,
        )


def _count_abandoned(delta: int) -> None:
    global _abandoned_total, _abandoned_running
    with _stats_lock:
        _abandoned_running += delta
        if delta > 0:
            _abandoned_total += delta


def thread_stats() -> dict[str, int]:
    """Operator counters: sync calls abandoned after a timeout (`abandoned_total`) and how many
    of their threads are still running (`abandoned_running`)."""
    with _stats_lock:
        return {"abandoned_total": _abandoned_total, "abandoned_running": _abandoned_running}


def _resize(limiter: anyio.CapacityLimiter, delta: int) -> None:
    limiter.total_tokens = max(1, int(limiter.total_tokens) + delta)


def in_worker_thread() -> bool:
    """True on a worker thread running user code for a pass (a sync tool, callback, guardrail)."""
    return _local.slot is not None


@contextlib.contextmanager
def lending_slot() -> Iterator[None]:
    """Around a blocking wait on a worker thread: lend this thread's limiter slot to others.

    Outside a limited worker thread this does nothing. The limiter grows by one for the wait
    and shrinks back after; the waiting thread resumes at once (never queues for a slot), so the
    pool is briefly over its cap rather than ever deadlocked.
    """
    slot = _local.slot
    if slot is None:
        yield
        return
    loop, limiter = slot
    try:
        loop.call_soon_threadsafe(_resize, limiter, +1)
    except RuntimeError:  # the loop has closed: nothing left to lend to
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_resize, limiter, -1)


_USER_CODE = LoopThreadLimiter(USER_CODE_THREADS)
_INTERNAL_IO = LoopThreadLimiter(INTERNAL_IO_THREADS)


def internal_io() -> LoopThreadLimiter:
    """The limiter of the runtime's own file I/O (never shared with user code)."""
    return _INTERNAL_IO


async def run_user_code(fn: Callable[..., T], *args: Any) -> T:
    """Run a sync user callback (guardrail, `on_message`, `on_event`, budget callback, sync
    executor) on the user-code threads; waits for it (callbacks are not abandoned)."""
    return await _USER_CODE.run(functools.partial(fn, *args))


async def run_internal_io(fn: Callable[..., T], *args: Any) -> T:
    """Run the runtime's own blocking file I/O on its reserved threads."""
    return await _INTERNAL_IO.run(functools.partial(fn, *args))
