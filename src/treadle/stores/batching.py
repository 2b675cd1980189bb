"""Group work that queues up together: many passes ending (or starting) at once share one
database round trip, and large batches of rows are encoded or decoded off the event loop.

`Batcher` collects the requests made while a batch is in flight and runs them as the next batch
(group commit, as the SQLite thread does with its transactions); each caller awaits its own
result or error. `off_loop` runs the JSON work of a large batch of rows on the runtime's own
worker threads, so reading or writing a 50,000-row conversation never stalls the loop (and the
other passes on it) for the time it takes to encode or decode every row.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from treadle.errors import StoreError
from treadle.runtime.threads import run_internal_io
from treadle.session import ChunkRow
from treadle.stores.records import decode_row, rows_text

__all__ = ["OFF_LOOP_CHARS", "OFF_LOOP_ROWS", "Batcher", "decode_rows", "encode_rows", "off_loop"]

A = TypeVar("A")
R = TypeVar("R")
T = TypeVar("T")

#: Batches of more rows than this are encoded or decoded on a worker thread (smaller ones take
#: less time than the hop to a thread and back).
OFF_LOOP_ROWS = 512

#: ... and so are batches of more characters of text than this, however few their rows (a
#: megabyte of JSON takes about a millisecond).
OFF_LOOP_CHARS = 1 << 20


async def off_loop(rows: int, fn: Callable[[], T], *, chars: int = 0) -> T:
    """`fn()`, on a worker thread when it handles more than `OFF_LOOP_ROWS` rows or (when the
    caller knows it) more than `OFF_LOOP_CHARS` characters of text."""
    if rows > OFF_LOOP_ROWS or chars > OFF_LOOP_CHARS:
        return await run_internal_io(fn)
    return fn()


async def encode_rows(rows: Sequence[ChunkRow]) -> list[tuple[str, str]]:
    """`(kind, payload JSON)` of every row; a large batch is encoded off the loop."""
    return await off_loop(len(rows), lambda: rows_text(rows))


async def decode_rows(found: Sequence[tuple[str, str | bytes]], key: str) -> tuple[ChunkRow, ...]:
    """Validated rows from `(kind, payload)` pairs; a large batch is decoded off the loop."""
    return await off_loop(len(found), lambda: tuple(decode_row(k, p, key) for k, p in found))


#: A queued request: its value, the caller's loop, and the caller's future (or the callback
#: `submit_then` was given).
_Request = tuple[A, asyncio.AbstractEventLoop, "asyncio.Future[R] | Callable[[Any], None]"]


class Batcher(Generic[A, R]):
    """Requests made while a batch runs go together into the next one.

    `run(requests)` does the work of a batch and returns one result per request, in order (an
    exception in the list is that request's error; an exception raised is every request's).
    At most `concurrency` batches run at once and none holds more than `limit` requests.
    Batches run on `home` (default: the loop of the first call); a caller on another loop (in
    another thread) queues its request with one thread-safe wake-up of `home` for the requests
    that queue together, and the outcomes of a batch go back to each caller's loop in one
    thread-safe call: no task or future on `home` per request. A request, once queued, runs
    even if its caller is cancelled meanwhile (its outcome is then dropped). `close()` (when
    the home loop stops) fails every waiting caller, and every later one, with `StoreError`.
    """

    def __init__(
        self,
        run: Callable[[list[A]], Awaitable[Sequence[R | BaseException]]],
        *,
        limit: int = 256,
        concurrency: int = 2,
        home: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._run = run
        self._limit = limit
        self._concurrency = concurrency
        self._home = home
        self._lock = threading.Lock()  # the queue and counters, for callers on other threads
        self._queue: list[_Request[A, R]] = []
        self._running = 0  # drains started or about to be (a wake-up on its way counts)
        self._tasks: set[asyncio.Task[None]] = set()  # strong references while they run
        self._closed = False
        self._why: StoreError | None = None  # what `close` was given: the callers' error
        self._why_running: StoreError | None = None  # ... for the batches it cancels

    @property
    def home(self) -> asyncio.AbstractEventLoop | None:
        """The loop the batches run on (None before the first call sets it)."""
        return self._home

    @property
    def tasks(self) -> tuple[asyncio.Task[None], ...]:
        """The batches running now (their drains)."""
        return tuple(self._tasks)

    async def close(
        self, why: StoreError | None = None, *, running: StoreError | None = None
    ) -> None:
        """Fail the queued requests, cancel the running batches and refuse later requests: on
        the home loop, before it stops (or as the store closes). Each caller gets a
        `StoreError`: `why` (by default: the home loop stops), or `running` (by default `why`)
        for those of a batch it cancels."""
        with self._lock:
            self._closed = True
            self._why, self._why_running = why, running
            rest, self._queue = self._queue, []
        _deliver(rest, [self._stopped()] * len(rest))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def __call__(self, request: A) -> R:
        """Queue `request` and await its result."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue_request(request, future)
        return await future

    def submit_then(self, request: A, then: Callable[[R | BaseException], None]) -> None:
        """Queue `request`; `then(outcome)` (its result or its error) is called on this loop in
        the one call that settles its batch here: no future, no task, no loop callback of its
        own. `then` must not raise (what it raises goes to the loop's exception handler).
        Raises `StoreError` at once (and never calls `then`) when the batcher is closed."""
        self._queue_request(request, then)

    def _queue_request(self, request: A, target: asyncio.Future[R] | Callable[[Any], None]) -> None:
        loop = asyncio.get_running_loop()
        home = self._home
        if home is None:
            home = self._home = loop
        with self._lock:
            if self._closed:
                raise self._stopped()
            self._queue.append((request, loop, target))
            start = self._running < self._concurrency
            if start:
                self._running += 1
        if start:
            if loop is home:
                self._spawn()
            else:
                try:
                    home.call_soon_threadsafe(self._spawn)
                except RuntimeError:  # the home loop has closed: nothing would run it
                    with self._lock:
                        self._running -= 1
                        self._queue = [q for q in self._queue if q[2] is not target]
                    raise _stopped() from None

    def _spawn(self) -> None:
        task = asyncio.ensure_future(self._drain())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        while True:
            with self._lock:
                batch = self._queue[: self._limit]
                del self._queue[: self._limit]
                if not batch:
                    self._running -= 1
                    return
            try:
                results: Sequence[R | BaseException] = await self._run([r for r, _, _ in batch])
            except BaseException as err:  # every request of the batch fails with it
                if self._closed and isinstance(err, asyncio.CancelledError):
                    # Cancelled by `close`, not by its callers (who may share its loop).
                    err = self._stopped(running=True)
                results = [err] * len(batch)
                if not isinstance(err, Exception):  # cancelled or destroyed (the loop stops)
                    with self._lock:
                        rest, self._queue = self._queue, []
                        self._running -= 1
                    _deliver([*batch, *rest], [*results, *[err] * len(rest)])
                    raise
            _deliver(batch, results)

    def _stopped(self, *, running: bool = False) -> StoreError:
        """The error of a caller failed by `close` (a new one each: each caller raises its
        own)."""
        why = (self._why_running if running else None) or self._why
        if why is None:
            return _stopped()
        return type(why)(str(why))  # its type too (`WriteOutcomeUnknown` says what it is)


def _stopped() -> StoreError:
    return StoreError("the store's event loop has stopped; open a new Store.")


def _deliver(batch: Sequence[_Request[A, R]], results: Sequence[R | BaseException]) -> None:
    """Settle each caller's future on its own loop: at once on this one, in one thread-safe
    call for each other loop. No loop need be running here: a batch destroyed with its stopped
    home loop (its coroutine closed by the garbage collector) still settles its callers."""
    try:
        here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
    for (_, loop, target), result in zip(batch, results, strict=True):
        stopped = loop is not here and isinstance(result, asyncio.CancelledError)
        if stopped or isinstance(result, GeneratorExit):
            # The caller was not cancelled; the batch was (its home loop stops).
            result = StoreError("the store operation was cancelled: its event loop stopped.")
        by_loop.setdefault(loop, []).append((target, result))
    for loop, settled in by_loop.items():
        if loop is here:
            _settle(settled)
        else:
            with contextlib.suppress(RuntimeError):  # that loop has closed: no one waits
                loop.call_soon_threadsafe(_settle, settled)


def _settle(settled: Sequence[tuple[asyncio.Future[R] | Callable[[Any], None], Any]]) -> None:
    for target, result in settled:
        if not isinstance(target, asyncio.Future):  # `submit_then`'s callback
            if isinstance(result, asyncio.CancelledError):  # the batch's loop stops
                result = StoreError("the store operation was cancelled: its event loop stopped.")
            try:
                target(result)
            except Exception as err:  # the other callers are still settled
                asyncio.get_running_loop().call_exception_handler(
                    {"message": "a store batch's callback raised", "exception": err}
                )
            continue
        future = target
        if future.done():  # its caller was cancelled (the request still ran)
            continue
        if isinstance(result, asyncio.CancelledError):
            future.cancel()
        elif isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
