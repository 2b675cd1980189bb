"""The garbage collector's first threshold, raised while thousands of passes are in flight.

With thousands of passes pending, nearly every object a pass allocates outlives the youngest
generation (a pass lasts seconds), so CPython's default first threshold (700 allocations) runs a
young collection every few hundred microseconds and promotes the passes' objects wholesale to the
oldest generation, where they trigger full collections walking every live object: the held
outputs, the started passes and the waiting ones. At 10,000 passes the collector took 40% of the
client's CPU (docs/performance.md, issue 33). While at least `BUSY_PASSES` passes are pending the
runtime raises the first threshold to `DEFAULT_BUSY_THRESHOLD` (the `TREADLE_BUSY_GC_THRESHOLD`
environment variable, 0 to leave the collector alone) and the third to `BUSY_FULL_THRESHOLD`
(fewer full collections while a burst is submitted), and puts them back once fewer than a quarter
of that remain, unless the program changed the thresholds meanwhile.

Passes that run on the caller's own event loop (`stream_session_loop`, `arun_session_loop`,
`Agent.stream`) never pass through the runtime: `RUNNING_PASS` counts every pass running in the
process, on any loop, for a second collector with the same rule from `BUSY_RUNNING` running
passes (scenario 12's 1,000 concurrent streams spent a quarter of their client CPU in the
collector without it).

The thresholds are process-wide, so the program's own cyclic garbage would live as long as the
passes' objects: while they are raised a watch thread reads the process's resident memory
(`/proc/self/statm`) every `WATCH_SECONDS`, and once it grew by more than `MEMORY_MARGIN` since
the raise or the last collection, runs a collection of the two younger generations and glibc's
`malloc_trim` (freed memory left resident would be reused by the next garbage unseen). Where it
cannot watch (no `/proc/self/statm`, no `malloc_trim`: not Linux with glibc) the thresholds are
not raised.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref
from collections.abc import Callable

from treadle.runtime.environment import int_setting

__all__ = [
    "BUSY_FULL_THRESHOLD",
    "BUSY_PASSES",
    "BUSY_RUNNING",
    "DEFAULT_BUSY_THRESHOLD",
    "MEMORY_MARGIN",
    "RUNNING_PASS",
    "BusyCollector",
]

log = logging.getLogger("treadle.runtime")

BUSY_PASSES = 1000
"""Passes pending at once (started or waiting to start) from which the threshold is raised."""
BUSY_RUNNING = 100
"""Passes running at once (started, on any loop) from which the threshold is raised: fewer than
`BUSY_PASSES`, since a running pass holds far more (its connection, buffers, coroutine chain) than
one waiting to start, and a fan-out's start-up allocations come before its last pass started."""
DEFAULT_BUSY_THRESHOLD = 20_000
"""The collector's first threshold while busy (allocations between young collections)."""
MEMORY_MARGIN = 32 * 1024 * 1024
"""Resident memory the process may grow by while the thresholds are raised before the watch runs a
collection (then measured again from what remains): the raise holds at most about this much more
garbage than CPython's thresholds would, plus what the program allocates in one `WATCH_SECONDS`."""
WATCH_SECONDS = 0.01
"""How often the watch reads the resident memory while the thresholds are raised (one read costs
about 30 µs on a loaded machine: 0.3% of a core)."""
BUSY_FULL_THRESHOLD = 100
"""The third threshold while busy (middle collections between full ones; CPython's is 10). A
burst of submissions makes every object new, so full collections, each walking every pending
pass, came every few thousand passes and the submitting thread paid for them: at 100,000
submissions 2 full collections, 1.6 of the submitter's 4.0 s of CPU (docs/performance.md)."""


class BusyCollector:
    """Raises and restores the collector's first threshold as the runtime's load crosses
    `BUSY_PASSES` (loop thread only)."""

    def __init__(self, threshold: int | None = None) -> None:
        """`threshold`: the first threshold while busy (None: the environment or the default;
        0: never change it)."""
        self.threshold = _from_environment() if threshold is None else threshold
        self.raised: tuple[int, int, int] | None = None
        """The thresholds to put back (None: not raised)."""
        self.set_to: tuple[int, int, int] = (0, 0, 0)
        """The thresholds Treadle set when it raised them."""

    def update(self, pending: int) -> None:
        """Raise or restore the threshold for `pending` passes in flight."""
        if self.raised is None:
            if pending >= BUSY_PASSES and self.threshold > 0:
                before = gc.get_threshold()
                # The program's own higher setting stays.
                if 0 < before[0] < self.threshold and _WATCH.acquire():
                    # The third only from CPython's default: a program's own choice stays.
                    full = BUSY_FULL_THRESHOLD if before[2] == _DEFAULT_FULL else before[2]
                    self.set_to = (self.threshold, before[1], full)
                    gc.set_threshold(*self.set_to)
                    self.raised = before
                    _RAISED.add(self)
        elif pending < BUSY_PASSES // 4:
            self.restore()

    def restore(self) -> None:
        """Put the thresholds back now, unless the program set its own since (any of the three
        values: only the exact tuple Treadle set is undone)."""
        before, self.raised = self.raised, None
        if before is None:
            return
        _RAISED.discard(self)
        _WATCH.release()
        if gc.get_threshold() == self.set_to:
            gc.set_threshold(*before)


def _from_environment() -> int:
    return int_setting("TREADLE_BUSY_GC_THRESHOLD", DEFAULT_BUSY_THRESHOLD)


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident() -> int | None:
    """The process's resident memory in bytes (None: not readable here)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def _load_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)`, which gives freed memory back to the system (None elsewhere)."""
    try:
        import ctypes  # only once the thresholds are raised: importing treadle stays light

        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, ImportError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class _MemoryWatch:
    """A thread, running while any collector holds the thresholds raised, that collects once the
    resident memory grew by more than `MEMORY_MARGIN` (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._stop: threading.Event | None = None
        self._trim: Callable[[], object] | None = None
        self._trim_loaded = False
        self.collections = 0
        """Collections the watch ran (for tests and measurements)."""

    def acquire(self) -> bool:
        """Hold the watch running; False where it cannot watch (then do not raise): no
        `/proc/self/statm` or no `malloc_trim` (not Linux with glibc)."""
        with self._lock:
            if self._holders == 0:
                if not self._trim_loaded:
                    self._trim, self._trim_loaded = _load_trim(), True
                start = _resident()
                if start is None or self._trim is None:
                    return False
                self._start(start, self._trim)
            self._holders += 1
            return True

    def _start(self, start: int, trim: Callable[[], object]) -> None:
        stop = self._stop = threading.Event()
        # Its own thread: the program may allocate without ever yielding to a loop.
        threading.Thread(
            target=self._watch, args=(stop, start, trim), name="treadle-gc-watch", daemon=True
        ).start()

    def after_fork_in_child(self) -> None:
        """Forget the parent's holders (the watch thread did not survive the fork)."""
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        self._holders = 0
        self._stop = None

    def release(self) -> None:
        """Drop one hold; the thread ends with the last."""
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._stop is not None:
                self._stop.set()
                self._stop = None

    def _watch(self, stop: threading.Event, base: int, trim: Callable[[], object]) -> None:
        while not stop.wait(WATCH_SECONDS):
            now = _resident()
            if now is None:
                return
            if now - base > MEMORY_MARGIN:
                if gc.isenabled():  # a program that disabled the collector keeps it so
                    gc.collect(1)
                    self.collections += 1
                    # Freed memory stays resident (and garbage made next would reuse it unseen)
                    # until given back.
                    trim()
                base = _resident() or now  # what the collection left is the new start
            elif now < base:
                base = now


_WATCH = _MemoryWatch()
_RAISED: weakref.WeakSet[BusyCollector] = weakref.WeakSet()
"""Collectors holding the thresholds raised now."""
_DEFAULT_FULL = 10
"""CPython's third threshold."""


def _after_fork_in_child() -> None:
    # A child forked while busy has none of the parent's passes running (their threads are
    # gone) and no watch thread: it starts from the thresholds the program had.
    _WATCH.after_fork_in_child()
    for collector in list(_RAISED):
        before, collector.raised = collector.raised, None
        if before is not None and gc.get_threshold() == collector.set_to:
            gc.set_threshold(*before)
    _RAISED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _RunningPasses:
    """Counts passes in flight in the process, on any loop and thread (`with RUNNING_PASS:`
    around a pass), for a collector with the rule of `BusyCollector` at `BUSY_RUNNING`."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()  # passes run on the runtime's thread and on callers' loops
        self._collector: BusyCollector | None = None  # made on first use (reads the environment)

    def __enter__(self) -> None:
        with self._lock:
            self.count += 1
            collector = self._collector
            if collector is None:
                collector = self._collector = BusyCollector()
            if self.count >= BUSY_RUNNING or collector.raised is not None:
                collector.update(self.count * BUSY_PASSES // BUSY_RUNNING)

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.count -= 1
            collector = self._collector
            if collector is not None and collector.raised is not None:
                collector.update(self.count * BUSY_PASSES // BUSY_RUNNING)


RUNNING_PASS = _RunningPasses()
"""`with RUNNING_PASS:` around a running pass (the engine's `run_pass`); `.count` is how many."""
