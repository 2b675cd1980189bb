"""The Treadle runtime: one background event loop on a daemon thread per process.

Passes run here as tasks, so thousands overlap while callers hold lazy handles. The runtime starts
on first use, drains and shuts down cleanly at interpreter exit, and is fork-safe: a child process
made with `os.fork()` starts a fresh runtime on first use instead of inheriting a dead thread.
Nothing here may block the loop; blocking waits happen only on callers' threads.

User code never takes the loop down: a `SystemExit` or `KeyboardInterrupt` escaping a pass fails
that pass only (as `SessionFailedError`); should the loop thread die anyway, every pending value
fails with a clear error and the next `get_runtime()` starts a fresh runtime. The exit drain runs
from `threading`'s exit hooks, which Python runs before any `atexit` callback, so passes finish
(for up to the drain time) before sandbox finalizers release their workspaces.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import contextvars
import logging
import os
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from treadle.errors import SessionFailedError
from treadle.runtime import progress
from treadle.runtime.busy_gc import BusyCollector
from treadle.runtime.lazy import LazyValue
from treadle.runtime.quiet_wake import new_runtime_loop
from treadle.runtime.settling import Settling
from treadle.runtime.start_gate import STALL_SECONDS, max_started_default
from treadle.runtime.threads import in_worker_thread, thread_stats

__all__ = [
    "DEFAULT_DRAIN_SECONDS",
    "Runtime",
    "add_shutdown_hook",
    "get_runtime",
    "shutdown",
    "stats",
    "submit",
]

T = TypeVar("T")
log = logging.getLogger("treadle.runtime")

#: How long the exit handler lets running passes finish before cancelling them
#: (override with the TREADLE_DRAIN_SECONDS environment variable).
DEFAULT_DRAIN_SECONDS = 10.0

ShutdownHook = Callable[[], Awaitable[None]]
_Item = tuple[Coroutine[Any, Any, Any], LazyValue[Any], contextvars.Context, bool]
"""A pass submitted from another thread: its coroutine, its value, its caller's context, and
whether a pass's own worker thread submitted it (a sync tool running a sub-agent)."""

INBOX_LINGER_SECONDS = 0.002
"""While passes arrive in a burst, how often the loop looks for more without being woken."""


class Runtime:
    """A background asyncio event loop on a daemon thread, owning every task submitted to it."""

    def __init__(self, max_started: int | None = None) -> None:
        """`max_started`: passes from other threads running at once (None: the
        `TREADLE_MAX_STARTED_PASSES` environment variable or `DEFAULT_MAX_STARTED`; 0: no cap)."""
        # `_wake(fn)`: `fn` on the loop from another thread, unwoken while busy (`quiet_wake`).
        self.loop, self._wake = new_runtime_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lazies: dict[asyncio.Task[Any], Settling[Any]] = {}
        self._hooks: list[ShutdownHook] = []
        self._closed = False
        self._dead: BaseException | None = None
        # Set as the loop thread's `_run` returns: `alive` reads it instead of asking the thread
        # (`Thread.is_alive` takes its lock: about 1 us on every submission).
        self._exited = False
        # Submitted from another thread but not started yet: failed (and closed) if the loop
        # dies before it gets to them, so no reader waits on work that will never run.
        self._unstarted: dict[Settling[Any], Coroutine[Any, Any, Any]] = {}
        self._state = threading.Lock()
        self._pid = os.getpid()
        # Passes submitted from other threads wait here; one wake-up of the loop starts every
        # one queued by then (a fan-out of thousands is not thousands of self-pipe writes and
        # thread switches).
        self._inbox: deque[_Item] = deque()
        self._inbox_armed = False
        # Moved from the inbox, waiting for a start (see `DEFAULT_MAX_STARTED`); loop thread only.
        self._waiting: deque[_Item] = deque()
        self._max_started = max_started_default() if max_started is None else max_started
        self._ended = 0  # passes ended so far (the stall check compares it between looks)
        # `_ended` plus `progress.steps()` at the last look (None: no look armed).
        self._stall_seen: int | None = None
        self._allowance = 0  # starts let past the cap by stall checks (until no pass waits)
        self._collector = BusyCollector()  # the collector's threshold under load (`busy_gc`)
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="treadle-runtime", daemon=True
        )
        self._thread.start()
        # Compared on every submission and blocking read: not `Thread.ident`'s property call.
        self._ident = self._thread.ident
        started.wait()

    def _run(self, started: threading.Event) -> None:
        try:
            self._serve(started)
        finally:
            self._exited = True

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        try:
            self.loop.run_forever()
        except BaseException as err:
            self._died(err)
            log.error("the Treadle runtime loop died (%r); a fresh runtime starts on next use", err)
            self._bury()
        else:
            if not self._closed:
                self._died(RuntimeError("the runtime loop stopped"))
                self._bury()

    def _bury(self) -> None:
        """After the loop died: cancel what was left (files close without a trailer), close."""
        loop = self.loop
        try:
            # One step first: a task cancelled before its first step never runs its body, so
            # its pass could not close its file (and its coroutine would never be awaited).
            loop.run_until_complete(asyncio.sleep(0))
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=5))
            loop.run_until_complete(loop.shutdown_asyncgens())
        except BaseException:  # dying twice: leave the rest to the collector
            log.exception("cleaning up after the dead Treadle runtime loop failed")
        finally:
            if not loop.is_running():
                loop.close()
            with self._state:
                lost, self._unstarted = list(self._unstarted.values()), {}
            for coro in lost:
                coro.close()

    def _died(self, err: BaseException) -> None:
        with self._state:
            self._dead = err
            unstarted = list(self._unstarted)
        failure = SessionFailedError(
            f"the Treadle runtime thread died ({type(err).__name__}: {err}) while this work was "
            "pending, so it was lost; the next use starts a fresh runtime."
        )
        failure.__cause__ = err
        for future in [*self._lazies.values(), *unstarted]:
            if not future.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_exception(failure)

    @property
    def closed(self) -> bool:
        """True once `shutdown` ran."""
        return self._closed

    @property
    def alive(self) -> bool:
        """True while the loop thread runs and `shutdown` has not been called."""
        return not self._closed and self._dead is None and not self._exited

    @property
    def pid(self) -> int:
        """The process that started this runtime."""
        return self._pid

    def forked_away(self) -> bool:
        """True in a forked child: this runtime's thread lives only in the parent."""
        return self._pid != os.getpid()

    def in_loop_thread(self) -> bool:
        """True when called on the runtime's own loop thread."""
        return threading.get_ident() == self._ident

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the loop thread soon (directly when already there)."""
        if self.in_loop_thread():
            self.loop.call_soon(fn)
        else:
            self._wake(fn)

    def submit(self, coro: Coroutine[Any, Any, T]) -> LazyValue[T]:
        """Schedule `coro` on the runtime and return its `LazyValue` at once."""
        return self._submit(coro, os.getpid())

    def _submit(self, coro: Coroutine[Any, Any, T], pid: int) -> LazyValue[T]:
        # `pid` is this process's id, read by the caller (once per submission: a system call).
        future: Settling[T] = Settling()
        lazy = LazyValue(future, self)
        on_loop = threading.get_ident() == self._ident  # asked once: per-pass cost
        with self._state:
            refused = self._closed or self._dead is not None or self._pid != pid
            if not refused and not on_loop:
                self._unstarted[future] = coro
        if refused:
            coro.close()
            raise RuntimeError("the Treadle runtime has shut down; no new work can start.")
        if on_loop:
            self._start(coro, lazy)
            return lazy
        # Passes submitted from other threads start in batches (one wake-up of the loop for many
        # submits); each starts in a copy of its own caller's contextvars, so the caller's
        # tracing context is what its pass sees (otel scenarios in tests).
        item = (coro, lazy, contextvars.copy_context(), in_worker_thread())
        self._inbox.append(item)
        if not self._inbox_armed:  # else a wake-up is on its way and will see this one too
            self._inbox_armed = True
            try:
                self._wake(self._start_inbox)
            except RuntimeError:  # the loop closed meanwhile (it died): nothing will run this
                self._inbox_armed = False
                with self._state:
                    self._unstarted.pop(future, None)
                with contextlib.suppress(ValueError):
                    self._inbox.remove(item)
                coro.close()
                raise
        return lazy

    def _start_inbox(self) -> None:
        inbox = self._inbox
        if len(inbox) < 2:
            self._inbox_armed = False  # before draining: a later submit arms a new wake-up
        elif not self._closed:
            # A burst is being submitted: stay armed and look again shortly, so the submitting
            # thread does not write the self-pipe for every pass. Each write lets go of the GIL,
            # and while the loop is busy the submitter then waits a whole switch interval (5 ms)
            # to get it back (see docs/performance.md).
            self.loop.call_later(INBOX_LINGER_SECONDS, self._start_inbox)
        else:
            self._inbox_armed = False
        waiting = self._waiting
        while inbox:
            item = inbox.popleft()
            if item[3]:  # a pass's sub-pass: its parent holds a start already, waiting for it
                item[2].run(self._start, item[0], item[1])
            else:
                waiting.append(item)
        self._start_waiting()
        self._collector.update(len(self._tasks) + len(waiting))

    def _start_waiting(self) -> None:
        """Start waiting passes while fewer than the cap (plus the stall allowance) run."""
        waiting = self._waiting
        room = (
            len(waiting)
            if self._max_started <= 0 or self._closed
            else self._max_started + self._allowance - len(self._tasks)
        )
        while waiting and room > 0:
            coro, lazy, context, _ = waiting.popleft()
            context.run(self._start, coro, lazy)
            room -= 1
        if not waiting:
            self._allowance = 0
        elif self._stall_seen is None:
            self._stall_seen = self._ended + progress.steps()
            self.loop.call_later(STALL_SECONDS, self._check_stall)

    def _check_stall(self) -> None:
        seen, self._stall_seen = self._stall_seen, None
        if seen == self._ended + progress.steps() and self._waiting:
            # No started pass ended and no reply came since the last look: another batch starts
            # (STALL_SECONDS).
            self._allowance += max(1, self._max_started // 4)
        self._start_waiting()

    def _start(self, coro: Coroutine[Any, Any, T], lazy: LazyValue[T]) -> None:
        with self._state:
            if self._unstarted.pop(lazy._future, None) is None and lazy._future.done():
                coro.close()  # failed already by `_died`
                return
        task = self.loop.create_task(_started(coro, lazy, self))
        lazy._task = task
        if lazy._cancel_asked:  # cancelled while it waited to start
            self.loop.call_soon(lazy._cancel_task)
        self._tasks.add(task)
        self._lazies[task] = lazy._future
        # Errors, cancellations (also before the first step), a death and a value no thread
        # waits for settle here; a value a blocked thread waits for settles inside the task
        # (`_finished`), which takes this callback off.
        task.add_done_callback(self._settle)

    def _ended_one(self, task: asyncio.Task[Any]) -> Settling[Any] | None:
        """Forget `task`, start what waited for its place; its value's slot (None: forgotten)."""
        self._tasks.discard(task)
        future = self._lazies.pop(task, None)
        self._ended += 1
        if self._waiting:
            self._start_waiting()
        if self._collector.raised is not None:
            self._collector.update(len(self._tasks) + len(self._waiting))
        return future

    def _finished(self, task: asyncio.Task[T], value: T) -> None:
        """A started pass returned `value` to a blocked reader: settle it now, inside its task's
        last step.

        A done callback runs one loop iteration later (one more `epoll_wait` and pass of the
        loop, about 2 µs), and the blocked reader waited for it; taken off here, the task ends
        with no callback to run (docs/performance.md, the lazy facade's hand-off)."""
        task.remove_done_callback(self._settle)
        future = self._ended_one(task)
        if future is not None and not future.done():  # else failed already by `_died`
            future.set_result(value)

    def _settle(self, task: asyncio.Task[Any]) -> None:
        future = self._ended_one(task)
        if future is None or future.done():  # failed already by `_died`
            return
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
        """Number of submitted tasks not ended yet (running, or waiting to start)."""
        return len(self._tasks) + len(self._waiting) + len(self._inbox)

    def shutdown(self, drain_seconds: float = DEFAULT_DRAIN_SECONDS) -> None:
        """Let running tasks finish for up to `drain_seconds`, cancel the rest, stop the loop."""
        if self._pid != os.getpid():
            return
        with self._state:  # as `_submit` checks it: a submission is refused or seen by the drain
            if self._closed:
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
        # Closed: every waiting pass starts now and drains like the others, and so does one
        # accepted just before the close that reaches the inbox while the drain waits.
        end = self.loop.time() + drain_seconds
        while True:  # a first look even with no time to drain: a waiting pass is cancelled
            self._start_inbox()
            if (left := end - self.loop.time()) <= 0:
                break
            if tasks := set(self._tasks):
                await asyncio.wait(tasks, timeout=left)
            elif self._unstarted:  # accepted, on its way to the inbox
                await asyncio.sleep(0.001)
            else:
                break
        if still := set(self._tasks):
            for task in still:
                task.cancel()
            await asyncio.wait(still, timeout=5)
        for hook in self._hooks:
            try:
                await hook()
            except Exception:  # a failing hook must not stop the others from closing
                log.exception("a Treadle shutdown hook failed")
        self._collector.update(0)  # the program's own thresholds back
        await self.loop.shutdown_asyncgens()
        await self.loop.shutdown_default_executor()


async def _started(coro: Coroutine[Any, Any, T], lazy: LazyValue[T], runtime: Runtime) -> T:
    lazy._started = True
    try:
        value = await coro
    except (SystemExit, KeyboardInterrupt) as err:
        # asyncio re-raises these out of `run_forever`, which would kill the loop thread and
        # every other pass with it; they end this work only, and every read re-raises this.
        raise SessionFailedError(
            f"user code raised {type(err).__name__}({err}) inside this pass, which ended it; "
            "other passes were not affected."
        ) from err
    task = lazy._task
    # A thread blocked on the value (the serial facade's reader) is woken in this step. Else the
    # done callback settles it a loop iteration later, as before: passes stepping later in this
    # iteration must not see it done before a cancel asked before they started reaches them.
    if task is not None and lazy._future.has_blocked_reader():
        runtime._finished(task, value)
    return value


_lock = threading.Lock()
_runtime: Runtime | None = None


def get_runtime() -> Runtime:
    """The process's runtime, started on first use (and anew in a forked child)."""
    return _runtime_of(os.getpid())


def _runtime_of(pid: int) -> Runtime:
    # `pid` is `os.getpid()`, asked by the caller, not a copy the fork hook keeps: a child forked
    # by a C extension's fork() runs no Python at-fork hook, and only its process id tells it
    # that the runtime it inherited has no thread here.
    global _runtime
    rt = _runtime
    if rt is not None and rt.alive and rt._pid == pid:
        return rt
    with _lock:
        rt = _runtime
        if rt is None or not rt.alive or rt._pid != pid:
            if rt is not None and rt._dead is not None and rt._pid == pid:
                log.warning("the Treadle runtime thread had died; starting a fresh runtime")
            rt = Runtime()
            _runtime = rt
        return rt


def stats() -> dict[str, int]:
    """Operator counters: pending passes on the runtime and abandoned sync-call threads."""
    rt = _runtime
    pending = rt.pending if rt is not None and rt.alive else 0
    return {"pending": pending, **thread_stats()}


def submit(coro: Coroutine[Any, Any, T]) -> LazyValue[T]:
    """Schedule `coro` on the process's runtime and return its `LazyValue` at once."""
    pid = os.getpid()  # once for both checks: a system call (0.7 µs here) per submission
    return _runtime_of(pid)._submit(coro, pid)


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


def _register_exit_drain() -> None:
    # `threading` runs its exit hooks before any `atexit` callback (weakref finalizers and the
    # sandbox closers included), so passes drain while their sandboxes are still open. The hook
    # is how `concurrent.futures` drains its pools; fall back to `atexit` where it is missing.
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(shutdown)
        return
    try:
        register(shutdown)
    except RuntimeError:  # imported while the interpreter is already shutting down
        atexit.register(shutdown)


os.register_at_fork(after_in_child=_after_fork_in_child)
_register_exit_drain()
