"""The threads MCP schema checks run on off the loop: a few of its own for each server.

A check is peer-shaped work: one RE2 call cannot be stopped, so a check given up on at its
budget runs on, holding its thread, for seconds. Each server therefore has its own threads (at
most `CHECK_THREADS`, started when its checks need them and ended after `IDLE_SECONDS` without
work): one server's runaway checks hold only its own, and another server's checks never wait
behind them (with one shared pair, two runaway checks of one server made a quick check of
another fail at its budget). They are daemon threads, unlike a `ThreadPoolExecutor`'s (which
interpreter exit joins), so a check still running never keeps the process from exiting.

This module must never block the event loop: `run_check` only queues and waits.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["CHECK_THREADS", "IDLE_SECONDS", "BudgetExceeded", "CheckThreads", "run_check"]

#: Threads one server's checks may run on at once (their own: a runaway check holds one of
#: these, never a thread the runtime or another server needs).
CHECK_THREADS = 2
#: Seconds a check thread waits for work before it ends.
IDLE_SECONDS = 10.0


class BudgetExceeded(Exception):
    """A check ran past its time budget (raised from inside the validator, then reported)."""


class CheckThreads:
    """At most `CHECK_THREADS` daemon threads running one server's queued checks (`owner`, its
    label, names them)."""

    def __init__(self, owner: str, size: int = CHECK_THREADS) -> None:
        self._size = size
        self._owner = owner
        _made.add(self)
        self._reset()

    def _reset(self) -> None:
        self._queue: deque[tuple[Future[Any], Callable[[], Any]]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._threads = 0
        self._idle = 0

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        """Queue `call`; its future is settled on one of these threads."""
        future: Future[Any] = Future()
        with self._lock:
            self._queue.append((future, call))
            self._wake.notify()
            # more queued than idle threads to take them: one more thread, while allowed
            if len(self._queue) > self._idle and self._threads < self._size:
                self._threads += 1
                threading.Thread(
                    target=self._work,
                    name=f"treadle-mcp-check-{self._threads} {self._owner[:40]}",
                    daemon=True,
                ).start()
        return future

    def drop_queued(self) -> None:
        """Cancel every check not yet started (its server closed: nobody waits for it any
        more); one running ends at its own budget, and later checks run as before."""
        with self._lock:
            dropped, self._queue = list(self._queue), deque()
        for future, _ in dropped:
            future.cancel()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
                while not self._queue:
                    if not self._wake.wait(IDLE_SECONDS) and not self._queue:
                        self._idle -= 1
                        self._threads -= 1
                        return
                self._idle -= 1
                future, call = self._queue.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as error:  # handed to the waiting caller, as executors do
                    future.set_exception(error)
            del future, call  # the value is the caller's now: not kept alive while idle


_made: weakref.WeakSet[CheckThreads] = weakref.WeakSet()


def _forked() -> None:
    # The parent's threads did not survive the fork, and a lock may have been held by one.
    for threads in list(_made):
        threads._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)

# The threads of checks with no server of their own to run on.
_SHARED = CheckThreads("")


async def run_check(
    fn: Callable[..., Any], *args: Any, budget: float, threads: CheckThreads | None = None
) -> Any:
    """`fn(*args)` on one of `threads` (the server's own); `BudgetExceeded` when it has not
    answered in `budget` seconds (queued or running: one still running finishes on its thread,
    unheard, and never holds up interpreter exit)."""
    pool = threads if threads is not None else _SHARED
    future = asyncio.wrap_future(pool.submit(functools.partial(fn, *args)))
    try:
        return await asyncio.wait_for(future, budget)
    except TimeoutError:
        raise BudgetExceeded from None
