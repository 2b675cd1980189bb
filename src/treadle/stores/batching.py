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
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from treadle.runtime.threads import run_internal_io
from treadle.session import ChunkRow
from treadle.stores.records import decode_row, rows_text

__all__ = ["OFF_LOOP_ROWS", "Batcher", "decode_rows", "encode_rows", "off_loop"]

A = TypeVar("A")
R = TypeVar("R")
T = TypeVar("T")

#: Batches of more rows than this are encoded or decoded on a worker thread (smaller ones take
#: less time than the hop to a thread and back).
OFF_LOOP_ROWS = 512


async def off_loop(rows: int, fn: Callable[[], T]) -> T:
    """`fn()`, on a worker thread when it handles more than `OFF_LOOP_ROWS` rows."""
    if rows > OFF_LOOP_ROWS:
        return await run_internal_io(fn)
    return fn()


async def encode_rows(rows: Sequence[ChunkRow]) -> list[tuple[str, str]]:
    """`(kind, payload JSON)` of every row; a large batch is encoded off the loop."""
    return await off_loop(len(rows), lambda: rows_text(rows))


async def decode_rows(found: Sequence[tuple[str, str | bytes]], key: str) -> tuple[ChunkRow, ...]:
    """Validated rows from `(kind, payload)` pairs; a large batch is decoded off the loop."""
    return await off_loop(len(found), lambda: tuple(decode_row(k, p, key) for k, p in found))


class Batcher(Generic[A, R]):
    """Requests made while a batch runs go together into the next one.

    `run(requests)` does the work of a batch and returns one result per request, in order (an
    exception in the list is that request's error; an exception raised is every request's).
    At most `concurrency` batches run at once and none holds more than `limit` requests. Used
    from one event loop (the store's home loop).
    """

    def __init__(
        self,
        run: Callable[[list[A]], Awaitable[Sequence[R | BaseException]]],
        *,
        limit: int = 256,
        concurrency: int = 2,
    ) -> None:
        self._run = run
        self._limit = limit
        self._concurrency = concurrency
        self._queue: list[tuple[A, asyncio.Future[R]]] = []
        self._running = 0
        self._tasks: set[asyncio.Task[None]] = set()  # strong references while they run

    async def __call__(self, request: A) -> R:
        """Queue `request` and await its result."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        if self._running < self._concurrency:
            self._running += 1
            task = asyncio.ensure_future(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await future

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = self._queue[: self._limit]
                del self._queue[: self._limit]
                try:
                    results: Sequence[R | BaseException] = await self._run([r for r, _ in batch])
                except BaseException as err:  # every request of the batch fails with it
                    results = [err] * len(batch)
                    if not isinstance(err, Exception):  # cancelled (the loop stops): end
                        _settle(batch, results)
                        _settle(self._queue, [err] * len(self._queue))
                        self._queue.clear()
                        raise
                _settle(batch, results)
        finally:
            self._running -= 1


def _settle(
    batch: Sequence[tuple[object, asyncio.Future[R]]], results: Sequence[R | BaseException]
) -> None:
    for (_, future), result in zip(batch, results, strict=True):
        if future.done():
            continue
        if isinstance(result, asyncio.CancelledError):
            future.cancel()
        elif isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
