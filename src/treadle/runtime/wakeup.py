"""How a thread blocked on a `Settling` is woken: with the GIL let go during the wake.

A blocked reader (the serial facade's caller reading a pass's session) used to wait on a
`threading.Lock` that the runtime's loop thread released. `Lock.release` wakes the reader while
the loop thread still holds the GIL: where both threads share a CPU, the woken reader preempts
the loop thread, finds the GIL taken and sleeps again, to be woken a second time when the loop
thread lets the GIL go in its next `epoll_wait`. The submission side did the same once more. A
trivial submit-and-read cost 5.7 context switches where 2 are needed (`perf` scheduler trace,
docs/performance.md).

Here each thread that blocks gets one `eventfd` (Linux), kept for the thread's life: the reader
blocks in `os.eventfd_read` and the settler wakes it with `os.eventfd_write`. Both let go of the
GIL around their system call, so a reader woken during the write finds the GIL free and runs;
the loop thread takes it back when the reader next blocks. Where `os.eventfd` does not exist or
cannot be made (not Linux, no free descriptor), or `MAX_EVENT_WAITERS` threads hold one already
(a pool of hundreds of reading threads must not take hundreds of the process's descriptors),
the reader waits on a `threading.Lock` as before.

An eventfd can hold a wake-up that came after its reader stopped waiting (it timed out as the
value settled): the reader's next wait then returns at once, and `Settling` checks its value's
state after every wake-up, so such a wake-up only costs one more look. A wait begun while the
thread's eventfd is in use (a signal handler reading a value inside another read) gets a lock, so
it cannot take the outer wait's wake-up.
"""

from __future__ import annotations

import os
import select
import threading
from typing import Protocol

__all__ = ["MAX_EVENT_WAITERS", "Waiter", "thread_waiter"]

MAX_EVENT_WAITERS = 32
"""Threads that may hold an eventfd at once; others wait on a lock (see above)."""


class Waiter(Protocol):
    """One blocked reader's wake-up: `wake` from any thread, `wait` on the reader's own."""

    busy: bool
    """True while a wait uses it (`Settling._wait` sets it; a lock's is never read)."""

    def wake(self) -> None:
        """Wake the reader (or make its next `wait` return at once)."""

    def wait(self, timeout: float | None) -> bool:
        """Block until woken (True) or `timeout` seconds passed (False); None: no limit."""


class _LockWaiter:
    """A fresh lock per wait, held until `wake` releases it (no eventfd here)."""

    __slots__ = ("_lock", "busy")

    def __init__(self) -> None:
        self.busy = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def wake(self) -> None:
        self._lock.release()

    def wait(self, timeout: float | None) -> bool:
        return self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0))


class _EventWaiter:
    """A thread's eventfd, closed once nothing (its thread, a settler) holds the waiter."""

    __slots__ = ("_fd", "_generation", "_poll", "busy")

    def __init__(self, fd: int) -> None:
        self.busy = False
        self._fd = fd
        self._generation = _generation
        self._poll: select.poll | None = None

    def wake(self) -> None:
        os.eventfd_write(self._fd, 1)

    def wait(self, timeout: float | None) -> bool:
        if timeout is None:
            os.eventfd_read(self._fd)  # blocks without the GIL; retried after signal handlers
            return True
        poll = self._poll
        if poll is None:
            poll = self._poll = select.poll()
            poll.register(self._fd, select.POLLIN)
        # `poll` takes milliseconds; rounded up so a short timeout does not spin.
        if not poll.poll(max(0, -int(-timeout * 1000 // 1))):
            return False
        os.eventfd_read(self._fd)  # readable: returns at once with the count, resetting it
        return True

    def __del__(self) -> None:
        global _live
        if self._generation == _generation:  # else a forked child's copy: closed at the fork
            os.close(self._fd)
            with _count_lock:
                _live -= 1


class _Local(threading.local):
    waiter: _EventWaiter | None = None  # a class default: no AttributeError on a new thread


_local = _Local()
_generation = 0
"""Counts forks into this process: a waiter of another generation is the parent's."""
_live = 0
"""Eventfd waiters of this generation not yet closed."""
_count_lock = threading.Lock()


def thread_waiter() -> Waiter:
    """The calling thread's waiter: its eventfd's, or a lock's where there is none."""
    global _live
    waiter = _local.waiter
    if waiter is not None and waiter._generation == _generation:
        return _LockWaiter() if waiter.busy else waiter
    with _count_lock:
        if _live >= MAX_EVENT_WAITERS:
            return _LockWaiter()
        _live += 1
    try:
        fd = os.eventfd(0, os.EFD_CLOEXEC)  # type: ignore[attr-defined,unused-ignore]
    except (AttributeError, OSError):  # not Linux, or no descriptor left: a lock, as before
        with _count_lock:
            _live -= 1
        return _LockWaiter()
    waiter = _local.waiter = _EventWaiter(fd)
    return waiter


def _after_fork_in_child() -> None:
    # The forking thread's eventfd is shared with the parent's same thread: a wake-up meant for
    # one would be read by the other. The child closes its copy and makes its own when needed.
    global _generation, _live, _count_lock
    _generation += 1
    _live = 0  # the parent's other threads do not exist here
    _count_lock = threading.Lock()  # another thread of the parent may have held it
    waiter = _local.waiter
    if waiter is not None:
        _local.waiter = None
        os.close(waiter._fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
