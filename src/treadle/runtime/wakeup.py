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
it cannot take the outer wait's wake-up. A forked child closes every eventfd it inherited (its
copies of the parent's threads' waiters wake nothing).
"""

from __future__ import annotations

import os
import select
import threading
import weakref
from typing import Protocol

__all__ = ["MAX_EVENT_WAITERS", "Waiter", "thread_waiter"]

MAX_EVENT_WAITERS = 32
"""Threads that may hold an eventfd at once; others wait on a lock (see above)."""

_MAX_POLL_MS = 2**31 - 1
"""`poll` takes a C int of milliseconds (about 24.8 days): a longer wait polls again."""


class Waiter(Protocol):
    """One blocked reader's wake-up: `wake` from any thread, `wait` on the reader's own."""

    busy: bool
    """True while a read uses it: `thread_waiter` hands it out busy, the read sets it back."""

    def wake(self) -> None:
        """Wake the reader (or make its next `wait` return at once)."""

    def wait(self, timeout: float | None) -> bool:
        """Block until woken (True) or up to `timeout` seconds passed (False; it may return
        False earlier for a very long timeout, and the caller looks at the clock); None: no
        limit."""


class _LockWaiter:
    """A fresh lock per wait, held until `wake` releases it (no eventfd here)."""

    __slots__ = ("_lock", "busy")

    def __init__(self) -> None:
        self.busy = True
        self._lock = threading.Lock()
        self._lock.acquire()

    def wake(self) -> None:
        self._lock.release()

    def wait(self, timeout: float | None) -> bool:
        return self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0))


class _EventWaiter:
    """A thread's eventfd, closed once nothing (its thread, a settler) holds the waiter, or in
    a forked child (then `_fd` is -1 and a wake-up does nothing)."""

    __slots__ = ("__weakref__", "_fd", "_poll", "busy")

    def __init__(self, fd: int) -> None:
        self.busy = False
        self._fd = fd
        self._poll: select.poll | None = None

    def wake(self) -> None:
        fd = self._fd
        if fd >= 0:
            os.eventfd_write(fd, 1)  # lets go of the GIL: the reader may run at once

    def wait(self, timeout: float | None) -> bool:
        if timeout is not None:
            poll = self._poll
            if poll is None:
                poll = self._poll = select.poll()
                poll.register(self._fd, select.POLLIN)
            # Milliseconds, rounded up so a short timeout does not spin; retried by `poll`
            # itself after a signal handler, with the time left.
            if not poll.poll(min(_MAX_POLL_MS, max(0, -int(-timeout * 1000 // 1)))):
                return False
        while True:
            try:
                os.eventfd_read(self._fd)  # blocks without the GIL (unless polled readable)
            except InterruptedError:
                # A signal's handler ran (and did not raise): `os.eventfd_read` does not retry
                # by itself as `Lock.acquire` does, and a read must not fail for it.
                continue
            return True

    def __del__(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
            _closed.append(fd)  # counted by the next `thread_waiter`: no lock taken here


class _Local(threading.local):
    waiter: _EventWaiter | None = None  # a class default: no AttributeError on a new thread


_local = _Local()
_live = 0
"""Eventfd waiters made (less those counted closed), under `_count_lock`."""
_count_lock = threading.Lock()
_closed: list[int] = []
"""Eventfds closed since `thread_waiter` last counted. A finaliser may run during any allocation,
also one made under `_count_lock` on the same thread: it appends here (atomic under the GIL)
rather than take the lock."""
_every: weakref.WeakSet[_EventWaiter] = weakref.WeakSet()
"""Every open eventfd waiter, for a forked child to close them."""


def thread_waiter() -> Waiter:
    """The calling thread's waiter, already busy: its eventfd's, or a lock's where there is
    none, or where the thread's is busy (a read inside a read: a signal handler's)."""
    global _live
    waiter = _local.waiter
    if waiter is not None and waiter._fd >= 0:
        if waiter.busy:
            return _LockWaiter()
        waiter.busy = True  # before the read lists it anywhere: see `Settling._wait`
        return waiter
    with _count_lock:  # no allocation of a tracked object in here (see `_closed`)
        while _closed:
            _closed.pop()
            _live -= 1
        full = _live >= MAX_EVENT_WAITERS
        if not full:
            _live += 1
    if full:
        return _LockWaiter()
    try:
        fd = os.eventfd(0, os.EFD_CLOEXEC)  # type: ignore[attr-defined,unused-ignore]
    except (AttributeError, OSError):  # not Linux, or no descriptor left: a lock, as before
        _closed.append(-1)
        return _LockWaiter()
    waiter = _local.waiter = _EventWaiter(fd)
    _every.add(waiter)
    waiter.busy = True
    return waiter


def _after_fork_in_child() -> None:
    # Only the forking thread lives on, but the child holds copies of every thread's eventfd:
    # the same files as the parent's, so a wake-up here would reach a parent's reader. Closed
    # here, and each waiter marked so (its `wake` does nothing, its finaliser closes nothing).
    global _live, _count_lock
    for waiter in list(_every):
        fd, waiter._fd = waiter._fd, -1
        if fd >= 0:
            os.close(fd)
    _every.clear()
    _local.waiter = None
    _live = 0
    _closed.clear()
    _count_lock = threading.Lock()  # another thread of the parent may have held it


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
