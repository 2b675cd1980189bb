"""One owned producer task feeding an async iterator: `produce`.

Streaming entry points (`stream_session_loop`, `map_iter`, the distributed driver) all run work in
the background and hand its items to a consumer as they come. `produce` is the one way they do
it: the producer coroutine runs in a task group owned by the `async with` block and sends items
through an unbounded queue (a plain function call, so sync callbacks can send); the block
iterates them. Leaving the block early cancels the producer and waits for it, so work never
outlives its consumer. A producer's failure does not cancel the consumer mid-item: it is re-raised
to the consumer after every item sent before it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Generic, TypeVar

import anyio

__all__ = ["Produced", "produce"]

T = TypeVar("T")
R = TypeVar("R")


class Produced(Generic[T, R]):
    """The items of a running producer (iterate it) and, once drained, its return value."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None  # the consumer, waiting for an item
        self._ended = False  # the producer finished (no more items will come)
        self._left = False  # the consumer left (a later send is an error)
        self._done = False
        self._value: R | None = None
        self._error: BaseException | None = None

    def _send(self, item: T) -> None:
        # A plain deque and one waiter future, not an anyio memory stream: a streamed pass sends
        # a handful of events per reply, and with 1,000 streams at once the stream's checkpoint,
        # backend lookup and event per wait were a measurable share of the time to first token
        # (docs/performance.md, scenario 12).
        if self._left:
            raise anyio.BrokenResourceError("the consumer of this stream has left")
        if self._ended:
            raise anyio.ClosedResourceError("this producer has finished")
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _end(self) -> None:
        self._ended = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        items = self._items
        while True:
            # A ready item is taken without a scheduling point (as `asyncio.Queue.get` does), so
            # a consumer that stops after N items does not let the producer race further ahead.
            if items:
                yield items.popleft()
                continue
            if self._ended or self._left:
                return
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def result(self) -> R:
        """The producer's return value; re-raises its exception. Call after iterating to the end."""
        if self._error is not None:
            raise self._error
        if not self._done:
            raise RuntimeError("the producer has not finished; iterate every item first.")
        return self._value  # type: ignore[return-value]


@asynccontextmanager
async def produce(
    producer: Callable[[Callable[[T], None]], Awaitable[R]],
) -> AsyncIterator[Produced[T, R]]:
    """Run `producer(send)` in an owned task group; yield a `Produced` of what it sends.

    `send` never blocks (the stream is unbounded: producers bound their own work). Iteration ends
    when the producer returns or raises; `Produced.result()` then gives its value or error.
    """
    produced: Produced[T, R] = Produced()

    async def run() -> None:
        try:
            produced._value = await producer(produced._send)
            produced._done = True
        except Exception as err:  # handed to the consumer after the items sent before it
            produced._error = err
        finally:
            produced._end()  # ends the consumer's iteration

    try:
        # asyncio's task group, not anyio's: an abandoned async generator is closed by the event
        # loop in a task of its own, and anyio's cancel scopes refuse to exit in a foreign task.
        left: BaseException | None = None
        async with asyncio.TaskGroup() as group:
            task = group.create_task(run())
            try:
                yield produced
            except BaseException as err:  # kept out of the group, which would wrap it
                left = err
            finally:
                task.cancel()  # the consumer left early: the producer must not outlive it
        if left is not None:
            raise left
    finally:
        produced._left = True  # a send from here on (a stray callback) raises
