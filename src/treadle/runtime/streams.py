"""One owned producer task feeding an async iterator: `produce`.

Streaming entry points (`stream_session_loop`, `map_iter`, the distributed driver) all run work in
the background and hand its items to a consumer as they come. `produce` is the one way they do
it: the producer coroutine runs in a task group owned by the `async with` block and sends items
through an unbounded memory stream (a plain function call, so sync callbacks can send); the block
iterates them. Leaving the block early cancels the producer and waits for it, so work never
outlives its consumer. A producer's failure does not cancel the consumer mid-item: it is re-raised
to the consumer after every item sent before it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

__all__ = ["Produced", "produce"]

T = TypeVar("T")
R = TypeVar("R")


class Produced(Generic[T, R]):
    """The items of a running producer (iterate it) and, once drained, its return value."""

    def __init__(self, items: MemoryObjectReceiveStream[T]) -> None:
        self._items = items
        self._done = False
        self._value: R | None = None
        self._error: BaseException | None = None

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[T]:
        while True:
            # A ready item is taken without a scheduling point (as `asyncio.Queue.get` does), so
            # a consumer that stops after N items does not let the producer race further ahead.
            try:
                item = self._items.receive_nowait()
            except anyio.WouldBlock:
                try:
                    item = await self._items.receive()
                except anyio.EndOfStream:
                    return
            except anyio.EndOfStream:
                return
            yield item

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
    sender, receiver = anyio.create_memory_object_stream[T](math.inf)
    produced: Produced[T, R] = Produced(receiver)

    async def run() -> None:
        with sender:  # closing it ends the consumer's iteration
            try:
                produced._value = await producer(sender.send_nowait)
                produced._done = True
            except Exception as err:  # handed to the consumer after the items sent before it
                produced._error = err

    with sender, receiver:  # the sender too: a producer cancelled before it ran never closes it
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
