"""`treadle.runtime.streams.produce`: the one owned producer behind every streaming entry point."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from treadle.runtime.streams import produce


def _counter(cancelled: asyncio.Event) -> Callable[[Callable[[int], None]], Awaitable[None]]:
    """A producer sending 0, 1, 2, ... (1000 at the most) that sets `cancelled` when cancelled."""

    async def producer(send: Callable[[int], None]) -> None:
        try:
            for i in range(1000):
                send(i)
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    return producer


async def test_items_then_result() -> None:
    async def producer(send: Callable[[int], None]) -> str:
        for i in range(5):
            send(i)
            await asyncio.sleep(0)
        return "done"

    async with produce(producer) as items:
        assert [i async for i in items] == [0, 1, 2, 3, 4]
        assert items.result() == "done"


async def test_failure_arrives_after_the_items_sent_before_it() -> None:
    async def producer(send: Callable[[int], None]) -> None:
        send(1)
        raise ValueError("input iterable broke")

    async with produce(producer) as items:
        assert [i async for i in items] == [1]
        with pytest.raises(ValueError, match="input iterable broke"):
            items.result()


async def test_result_before_the_end_is_an_error() -> None:
    async def producer(send: Callable[[int], None]) -> None:
        send(1)
        await asyncio.Event().wait()

    async with produce(producer) as items:
        with pytest.raises(RuntimeError, match="not finished"):
            items.result()


async def test_leaving_early_cancels_and_awaits_the_producer() -> None:
    cancelled = asyncio.Event()
    producer = _counter(cancelled)

    async with produce(producer) as items:
        async for i in items:
            if i == 2:
                break
    assert cancelled.is_set()  # awaited before the block returned


async def test_an_abandoned_generator_is_closed_from_another_task() -> None:
    """`async for ...: break` without aclose: the loop finalises the generator in a new task."""
    cancelled = asyncio.Event()
    producer = _counter(cancelled)

    async def gen() -> AsyncIterator[int]:
        async with produce(producer) as items:
            async for i in items:
                yield i

    errors: list[object] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    async for i in gen():
        if i == 2:
            break
    gc.collect()
    await asyncio.wait_for(cancelled.wait(), 30)
    await asyncio.sleep(0.01)
    assert errors == []


async def test_a_send_after_the_consumer_left_raises() -> None:
    import anyio

    sends: list[Callable[[int], None]] = []

    async def producer(send: Callable[[int], None]) -> None:
        sends.append(send)
        await asyncio.Event().wait()

    async with produce(producer) as items:
        await asyncio.sleep(0)  # the producer has started and handed out its `send`
        del items
    with pytest.raises(anyio.BrokenResourceError):
        sends[0](1)  # a stray callback after the block: refused, never buffered
