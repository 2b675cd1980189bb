"""`Settling`: the thread-safe result slot behind every `LazyValue`, lighter than a
`concurrent.futures.Future`.

A hundred thousand submitted passes each hold one until they settle. A `concurrent.futures.Future`
carries a `Condition` (with its `RLock`, five bound lock methods and a deque), a waiter list and a
callback list: 11 objects the garbage collector tracks and about 2.5 us to build, for a slot that
is set once. This one holds its state in five slots and shares one module lock for its few state
changes; a reader takes its thread's wake-up (`runtime/wakeup.py`) only when it actually blocks
(docs/performance.md, submitting 100,000 passes).

It keeps the `concurrent.futures.Future` contract that Treadle uses: `result(timeout)` raises
`TimeoutError` when not ready and `concurrent.futures.CancelledError` once cancelled; a second
`set_result` / `set_exception` raises `InvalidStateError`; `cancel()` on a finished value returns
False; done callbacks run on the settling thread (at once when added after it settled), and an
error one raises is logged, never propagated to the settling thread. Blocked readers are woken
after the callbacks ran, so a reader sees what they did.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from treadle.runtime.wakeup import Waiter, thread_waiter

__all__ = ["Settling"]

T = TypeVar("T")

log = logging.getLogger(__name__)

_PENDING, _FINISHED, _CANCELLED = 0, 1, 2

# One lock for every value's state change: each holds it for a few bytecodes, so sharing it costs
# nothing measurable and saves a lock (and the collector's tracking of it) per pending pass.
_state_lock = threading.Lock()


class Settling(Generic[T]):
    """A result slot set once (a value, an error or cancelled), readable from any thread."""

    __slots__ = ("__weakref__", "_callbacks", "_error", "_state", "_value", "_waiters")

    def __init__(self) -> None:
        self._state = _PENDING
        self._value: T | None = None
        self._error: BaseException | None = None
        # None, one callback, or a list of them (in the order they were added).
        self._callbacks: (
            Callable[[Settling[T]], object] | list[Callable[[Settling[T]], object]] | None
        ) = None
        self._waiters: list[Waiter] | None = None

    def done(self) -> bool:
        """True once settled (a value, an error or cancelled)."""
        return self._state != _PENDING

    def cancelled(self) -> bool:
        """True once cancelled."""
        return self._state == _CANCELLED

    def has_blocked_reader(self) -> bool:
        """True while a thread waits in `result` or `exception` (a hint, read without the lock)."""
        return bool(self._waiters)

    def result(self, timeout: float | None = None) -> T:
        """The value (blocking up to `timeout` seconds); re-raises the error it settled with."""
        try:
            if self._state == _PENDING:
                self._wait(timeout)
            return self._read()
        finally:
            # A raised error's traceback holds this frame: without `self` in it, a failed slot
            # is freed at once rather than kept in a cycle until the collector runs (as
            # `concurrent.futures.Future.result` does).
            del self

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error it settled with (None for a value), blocking up to `timeout` seconds."""
        if self._state == _PENDING:
            self._wait(timeout)
        if self._state == _CANCELLED:
            raise concurrent.futures.CancelledError()
        return self._error

    def add_done_callback(self, fn: Callable[[Settling[T]], object]) -> None:
        """Call `fn(self)` once settled, on the settling thread (now when settled already)."""
        with _state_lock:
            if self._state == _PENDING:
                # One callback is kept as itself (a lazy output's usage record, the usual and
                # only one): no list for each of a hundred thousand pending passes.
                callbacks = self._callbacks
                if callbacks is None:
                    self._callbacks = fn
                elif type(callbacks) is list:
                    callbacks.append(fn)
                else:
                    self._callbacks = [callbacks, fn]  # type: ignore[list-item]  # one callable
                return
        self._call(fn)

    def set_result(self, value: T) -> None:
        """Settle with `value`; `InvalidStateError` when already settled."""
        if not self._settle(_FINISHED, value, None):
            raise concurrent.futures.InvalidStateError(f"already settled: {self!r}")

    def set_exception(self, error: BaseException) -> None:
        """Settle with `error`; `InvalidStateError` when already settled."""
        if not self._settle(_FINISHED, None, error):
            raise concurrent.futures.InvalidStateError(f"already settled: {self!r}")

    def cancel(self) -> bool:
        """Settle as cancelled unless settled already; True when it is (now) cancelled."""
        return self._settle(_CANCELLED, None, None) or self._state == _CANCELLED

    def _settle(self, state: int, value: T | None, error: BaseException | None) -> bool:
        with _state_lock:
            if self._state != _PENDING:
                return False
            self._value, self._error, self._state = value, error, state
            callbacks, self._callbacks = self._callbacks, None
            waiters, self._waiters = self._waiters, None
        if type(callbacks) is list:
            for fn in callbacks:
                self._call(fn)
        elif callbacks is not None:
            self._call(callbacks)  # type: ignore[arg-type]  # one callable
        # Blocked readers after the callbacks: a reader's wake-up lets go of the GIL, and the
        # woken reader runs at once (`runtime/wakeup.py`); it must find what the callbacks record
        # (a pass's usage in its lineage) as it did when the settling thread kept the GIL.
        if waiters is not None:
            for waiter in waiters:
                waiter.wake()
        return True

    def _call(self, fn: Callable[[Settling[T]], object]) -> None:
        try:
            fn(self)
        except Exception:  # as concurrent.futures does: the settling thread carries on
            log.exception("a done callback of %r raised", self)

    def _wait(self, timeout: float | None) -> None:
        waiter = thread_waiter()  # busy: a read inside this one (a signal handler's) gets a lock
        try:
            with _state_lock:
                if self._state != _PENDING:
                    return
                if self._waiters is None:
                    self._waiters = [waiter]
                else:
                    self._waiters.append(waiter)
            deadline = None if timeout is None else time.monotonic() + max(timeout, 0)
            while True:
                left = None if deadline is None else max(deadline - time.monotonic(), 0)
                woken = waiter.wait(left)
                if self._state != _PENDING:  # set before any wake-up, under the lock
                    return
                if not woken and deadline is not None and time.monotonic() >= deadline:
                    raise concurrent.futures.TimeoutError()
                # else a wake-up left from an earlier read of this thread's, or a very long
                # timeout's next round: wait again
        except BaseException as err:  # the timeout, or a signal handler's (KeyboardInterrupt)
            with _state_lock:
                if self._waiters is not None and waiter in self._waiters:
                    self._waiters.remove(waiter)  # no longer a blocked reader
                if self._state != _PENDING and type(err) is concurrent.futures.TimeoutError:
                    return  # settled as the time ran out: the value is read
            raise
        finally:
            waiter.busy = False
            # A raised error's traceback holds this frame: not the thread's waiter with it (its
            # eventfd would stay open, and counted, until the collector freed the traceback).
            del waiter

    def _read(self) -> T:
        if self._state == _CANCELLED:
            raise concurrent.futures.CancelledError()
        if self._error is not None:
            try:
                raise self._error
            finally:
                del self  # no cycle through this frame (see `result`)
        return self._value  # type: ignore[return-value]  # set with the state

    def __repr__(self) -> str:
        state = ("pending", "finished", "cancelled")[self._state]
        return f"<Settling {state}>"
