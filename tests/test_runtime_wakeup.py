"""How a blocked reader is woken (`treadle.runtime.wakeup`): a thread's eventfd, written with the
GIL let go, and the lock it falls back to; the cases where a wake-up could reach the wrong wait."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from treadle.runtime import wakeup
from treadle.runtime.settling import Settling

linux_only = pytest.mark.skipif(not hasattr(os, "eventfd"), reason="eventfd is Linux's")


def _settle_later(slot: Settling[Any], value: Any, after: float = 0.05) -> threading.Thread:
    """A started thread that sets `value` on `slot` after `after` seconds."""

    def settle() -> None:
        time.sleep(after)
        slot.set_result(value)

    thread = threading.Thread(target=settle)
    thread.start()
    return thread


def _own_waiter() -> wakeup.Waiter:
    """This thread's waiter, as a read gets it, handed back (not busy) at once."""
    waiter = wakeup.thread_waiter()
    waiter.busy = False
    return waiter


def _in_a_forked_child(check: Callable[[], bool]) -> bool:
    """`check()` run in a forked child, its answer reported through a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.write(write, b"1" if check() else b"0")
        finally:
            os._exit(0)
    os.close(write)
    try:
        return os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def _fds() -> int:
    """The process's open eventfds (nothing else in a test process makes them)."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own descriptor)
            count += os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[eventfd]"
    return count


@linux_only
def test_a_thread_keeps_one_eventfd_for_all_its_reads() -> None:
    first = _own_waiter()
    assert type(first).__name__ == "_EventWaiter"
    for value in range(20):
        slot: Settling[int] = Settling()
        thread = _settle_later(slot, value, after=0.001)
        assert slot.result(30) == value
        thread.join()
    assert _own_waiter() is first


@linux_only
def test_a_left_over_wake_up_does_not_end_the_next_wait_early() -> None:
    """A wake-up that reached the eventfd after its wait ended (the value settled as the read
    timed out) makes the thread's next wait look again, not return or time out wrongly."""
    _own_waiter().wake()  # as a settler would have, for a wait that is over
    pending: Settling[int] = Settling()
    with pytest.raises(TimeoutError):
        pending.result(0.05)  # the left-over wake-up is read; the slot is still pending
    _own_waiter().wake()
    slot: Settling[str] = Settling()
    thread = _settle_later(slot, "late")
    assert slot.result() == "late"  # no limit: it waited for the value, past the wake-up
    thread.join()
    assert not slot.has_blocked_reader()


@linux_only
def test_a_timed_out_reader_is_no_longer_listed_and_a_later_value_still_arrives() -> None:
    slot: Settling[int] = Settling()
    with pytest.raises(TimeoutError):
        slot.result(0.01)
    assert not slot.has_blocked_reader()
    slot.set_result(3)
    assert slot.result(0) == 3


def test_without_eventfd_the_reader_waits_on_a_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any) -> int:
        raise OSError(24, "Too many open files")

    results: list[Any] = []

    def read() -> None:  # a new thread: no eventfd of its own yet
        results.append(type(_own_waiter()).__name__)
        slot: Settling[int] = Settling()
        thread = _settle_later(slot, 5)
        results.append(slot.result(30))
        thread.join()

    monkeypatch.setattr(os, "eventfd", refuse, raising=False)
    reader = threading.Thread(target=read)
    reader.start()
    reader.join()
    assert results == ["_LockWaiter", 5]


@linux_only
def test_reading_threads_past_the_cap_wait_on_locks_and_threads_give_their_fds_back() -> None:
    """Hundreds of reading threads must not take hundreds of descriptors: past
    `MAX_EVENT_WAITERS` they wait on locks, and a thread's eventfd closes when it ends."""
    count = wakeup.MAX_EVENT_WAITERS + 20
    before = _fds()
    slot: Settling[int] = Settling()
    kinds: list[str] = []
    got: list[int] = []
    ready = threading.Barrier(count + 1)

    def read() -> None:
        kinds.append(type(_own_waiter()).__name__)
        ready.wait()
        got.append(slot.result(30))

    readers = [threading.Thread(target=read) for _ in range(count)]
    for reader in readers:
        reader.start()
    ready.wait()
    assert _fds() - before <= wakeup.MAX_EVENT_WAITERS
    slot.set_result(9)
    for reader in readers:
        reader.join()
    assert got == [9] * count
    assert kinds.count("_LockWaiter") >= count - wakeup.MAX_EVENT_WAITERS
    del readers
    assert _fds() <= before + 1  # this test thread's own, at most


@linux_only
@pytest.mark.skipif(sys.platform == "win32", reason="fork")
def test_a_forked_child_does_not_share_its_parents_eventfd() -> None:
    """The forking thread's eventfd would be the same file in both processes: a wake-up for one
    could be read by the other. The child makes its own."""
    parent = _own_waiter()

    def in_the_child() -> bool:
        child = _own_waiter()
        slot: Settling[int] = Settling()
        _settle_later(slot, 1, after=0.02)
        return child is not parent and slot.result(10) == 1

    assert _in_a_forked_child(in_the_child)
    parent.wake()  # the parent's own is still open and its own
    pending: Settling[int] = Settling()
    with pytest.raises(TimeoutError):
        pending.result(0.01)


@linux_only
@pytest.mark.skipif(sys.platform == "win32", reason="signals")
def test_ctrl_c_during_a_read_raises_and_a_read_inside_a_signal_handler_gets_its_own_wake_up() -> (
    None
):
    """A signal handler that reads a value while the main thread is blocked in a read gets a
    lock, not the thread's eventfd (its wait would take the outer read's wake-up); and
    KeyboardInterrupt leaves the interrupted read, which is no longer a blocked reader."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread")
    outer: Settling[str] = Settling()
    inner: Settling[str] = Settling()
    seen: list[Any] = []

    def handler(*_: Any) -> None:
        seen.append(type(_own_waiter()).__name__)
        _settle_later(outer, "outer", after=0.02)
        _settle_later(inner, "inner", after=0.05)
        seen.append(inner.result(30))

    timers = [threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR1)) for _ in range(2)]
    old = signal.signal(signal.SIGUSR1, handler)
    try:
        timers[0].start()
        assert outer.result(30) == "outer"
        assert seen == ["_LockWaiter", "inner"]
        signal.signal(signal.SIGUSR1, signal.default_int_handler)
        stuck: Settling[str] = Settling()
        timers[1].start()
        with pytest.raises(KeyboardInterrupt):
            stuck.result(30)
        assert not stuck.has_blocked_reader()
    finally:
        for timer in timers:  # no signal may come once the default action (exit) is back
            timer.cancel()
            if timer.is_alive():
                timer.join()
        signal.signal(signal.SIGUSR1, old)


def test_a_blocked_reader_wakes_after_the_done_callbacks_ran() -> None:
    """What a done callback records (a pass's usage in its lineage) is there when a blocked
    reader wakes, even when the callback lets go of the GIL."""
    slot: Settling[int] = Settling()
    recorded: list[int] = []

    def record(done: Settling[int]) -> None:
        time.sleep(0.05)  # lets go of the GIL: a reader woken already would run now
        recorded.append(done.result())

    slot.add_done_callback(record)
    seen: list[list[int]] = []
    ready = threading.Event()

    def read() -> None:
        ready.set()
        slot.result(30)
        seen.append(list(recorded))

    reader = threading.Thread(target=read)
    reader.start()
    ready.wait()
    while not slot.has_blocked_reader():
        time.sleep(0.001)
    slot.set_result(4)
    reader.join()
    assert seen == [[4]]


@linux_only
@pytest.mark.skipif(sys.platform == "win32", reason="signals")
def test_a_signal_handler_that_returns_does_not_end_a_read_without_a_timeout() -> None:
    """`os.eventfd_read` fails with EINTR when a handler ran; a read retries, as `Lock.acquire`
    did (a SIGALRM timer or a SIGCHLD handler made passes fail with InterruptedError)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread")
    calls: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: calls.append(1))
    timers = [
        threading.Timer(after, os.kill, (os.getpid(), signal.SIGUSR1)) for after in (0.02, 0.04)
    ]
    slot: Settling[str] = Settling()
    thread = _settle_later(slot, "value", after=0.15)
    try:
        for timer in timers:
            timer.start()
        assert slot.result() == "value"
        assert calls == [1, 1]
    finally:
        for timer in timers:  # no signal may come once the default action (exit) is back
            timer.cancel()
            timer.join()
        thread.join()
        signal.signal(signal.SIGUSR1, old)


@linux_only
def test_a_waiter_is_handed_out_busy_and_a_read_inside_it_gets_a_lock() -> None:
    """Busy from the moment a read has it, before the read lists it on a value: a nested read
    (a signal handler's, a finaliser's) in between must not share its eventfd."""
    outer = wakeup.thread_waiter()
    try:
        assert outer.busy and type(outer).__name__ == "_EventWaiter"
        assert type(wakeup.thread_waiter()).__name__ == "_LockWaiter"
    finally:
        outer.busy = False
    assert wakeup.thread_waiter() is outer
    outer.busy = False


@linux_only
def test_a_waiter_finalised_while_its_count_is_being_taken_does_not_deadlock() -> None:
    """The collector may free a dead waiter during any allocation, also on a thread inside
    `thread_waiter`'s counting: its finaliser takes no lock (it deadlocked there)."""
    box: list[wakeup.Waiter] = []
    maker = threading.Thread(target=lambda: box.append(_own_waiter()))
    maker.start()
    maker.join()

    def finalise_under_the_lock() -> None:
        with wakeup._count_lock:
            box.clear()  # the last reference: the finaliser runs here

    finaliser = threading.Thread(target=finalise_under_the_lock, daemon=True)
    finaliser.start()
    finaliser.join(10)
    assert not finaliser.is_alive()


def test_a_timeout_longer_than_poll_takes_still_waits_for_the_value() -> None:
    """`poll` takes a C int of milliseconds (24.8 days); `Lock.acquire` took far more."""
    for timeout in (30 * 86400.0, 1e7, threading.TIMEOUT_MAX):
        slot: Settling[float] = Settling()
        thread = _settle_later(slot, timeout, after=0.01)
        assert slot.result(timeout) == timeout
        thread.join()


@linux_only
@pytest.mark.skipif(sys.platform == "win32", reason="fork")
def test_a_forked_child_closes_every_eventfd_it_inherited() -> None:
    gate: Settling[None] = Settling()
    started = threading.Barrier(5)

    def read() -> None:
        started.wait()
        with contextlib.suppress(Exception):
            gate.result(30)

    readers = [threading.Thread(target=read) for _ in range(4)]
    for reader in readers:
        reader.start()
    started.wait()
    while len(gate._waiters or ()) < 4:
        time.sleep(0.001)

    def in_the_child() -> bool:
        inherited = list(gate._waiters or ())
        gate.cancel()  # wakes the parent's readers' copies: must write nowhere
        return _fds() == 0 and all(getattr(w, "_fd", -1) == -1 for w in inherited)

    try:
        assert _in_a_forked_child(in_the_child)
    finally:
        gate.set_result(None)
        for reader in readers:
            reader.join()
