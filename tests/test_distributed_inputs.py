"""The scheduler's input path (`treadle.distributed.driver.drive`) under a dense interleaving:
pending sessions (passes still running on the runtime against the fake server) among plain
inputs, every input at its own position, none lost, none run twice.

The pool here runs in this process and answers each pass after a loop turn or three (it echoes
the input's rows): worker processes answer a few passes a millisecond, too seldom to hit the
windows these tests are about (a consumer taking an input while another's pending input has not
got its position yet), which this pool hits within a few hundred inputs. Everything else is real:
the sessions are outputs of real passes, still pending when the driver takes them.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from treadle import Agent, Provider, Session
from treadle.distributed.driver import drive
from treadle.distributed.outcome import PassItem, PassOutcome
from treadle.testing import FakeOpenAIServer, Reply


def _held_script(request: dict[str, Any]) -> Reply:
    """Answer after the delay the user message names (`w3 2`: 2 ms)."""
    text = next(m.get("content") for m in reversed(request["messages"]) if m["role"] == "user")
    return Reply.text("ready").with_latency(float(str(text).split()[1]))


def _echo(item: PassItem) -> PassOutcome:
    """The outcome an echo pass gives: the item's own messages back."""
    return PassOutcome(
        index=item.index,
        session_id=item.session_id,
        status="ok",
        attempts=item.attempt,
        worker="here:0",
        messages=item.messages,
    )


class _EchoPool:
    """One slot in this process: a pass's outcome is its input's rows, a loop turn or three on."""

    size = 1

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.seen: list[int] = []

    def worker_name(self, slot: int) -> str:
        return "here:0"

    async def run(self, slot: int, item: PassItem) -> PassOutcome:
        self.seen.append(item.index)
        for _ in range(self.rng.randrange(1, 4)):
            await asyncio.sleep(0)
        return _echo(item)

    async def restart(self, slot: int) -> None:
        raise AssertionError("no worker is lost here")


class _ChainedEchoPool(_EchoPool):
    """`_EchoPool` that also chains passes as the process pool does (`run_chained`): each
    outcome goes to the scheduler's `step` from a loop callback, a turn or three on, and the
    item it returns runs next, with no task of the scheduler resumed in between."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.chained = 0  # passes started from a callback (the chain's, not the scheduler's)

    async def run_chained(
        self, slot: int, item: PassItem, step: Callable[[PassOutcome], PassItem | PassOutcome]
    ) -> PassOutcome:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PassOutcome] = loop.create_future()

        def answer(item: PassItem, turns: int) -> None:
            if future.done():  # the map was closed: its task no longer waits
                return
            if turns:
                loop.call_soon(answer, item, turns - 1)
                return
            try:
                following = step(_echo(item))
            except Exception as err:
                future.set_exception(err)
                return
            if isinstance(following, PassItem):
                self.chained += 1
                start(following)
            else:
                future.set_result(following)

        def start(item: PassItem) -> None:
            self.seen.append(item.index)
            answer(item, self.rng.randrange(0, 3))

        loop.call_soon(start, item)
        return await future


def _inputs(producer: Agent, rng: random.Random, n: int, share: float) -> Iterator[Any]:
    """`n` inputs: a `share` of them pending sessions (started as they are taken, each held
    0-4 ms by the server), the others strings; input `i`'s last user row starts `w<i> `."""
    for i in range(n):
        if rng.random() < share:
            yield producer(Session.from_user_message(f"w{i} {rng.randrange(0, 5)}"))
        else:
            yield f"w{i} 0"


def _check(outcomes: list[PassOutcome], pool: _EchoPool, n: int) -> None:
    assert sorted(o.index for o in outcomes) == list(range(n)), "an input lost or run twice"
    assert sorted(pool.seen) == list(range(n))
    for o in outcomes:
        assert o.messages is not None
        last = [m["content"] for m in o.messages if m["role"] == "user"][-1]
        assert last.split()[0] == f"w{o.index}", (o.index, last)


@pytest.mark.parametrize("pool_type", [_EchoPool, _ChainedEchoPool])
@pytest.mark.parametrize(
    ("n", "share", "concurrency"), [(300, 0.4, 8), (200, 0.7, 4), (150, 0.2, 16), (300, 0.0, 8)]
)
async def test_pending_and_plain_inputs_from_an_iterable(
    n: int, share: float, concurrency: int, pool_type: type[_EchoPool]
) -> None:
    with FakeOpenAIServer(script=_held_script) as server:
        producer = Agent(
            "producer", "Say ready.", provider=Provider(model="f", base_url=server.base_url)
        )
        for seed in range(4):
            pool = pool_type(seed)
            source = _inputs(producer, random.Random(seed), n, share)
            outcomes = [
                o
                async for o in drive(
                    pool, source, concurrency=concurrency, max_attempts=2, call_timeout=None
                )
            ]
            _check(outcomes, pool, n)
            if isinstance(pool, _ChainedEchoPool):  # the chain ran, not only the tasks
                assert pool.chained > n // 10


async def test_pending_and_plain_inputs_from_an_async_source() -> None:
    with FakeOpenAIServer(script=_held_script) as server:
        producer = Agent(
            "producer", "Say ready.", provider=Provider(model="f", base_url=server.base_url)
        )

        async def source(seed: int) -> AsyncIterator[Any]:
            for value in _inputs(producer, random.Random(seed), 200, 0.4):
                if seed % 2:
                    await asyncio.sleep(0)
                yield value

        for seed in range(4):
            pool = _EchoPool(seed)
            outcomes = [
                o
                async for o in drive(
                    pool, source(seed), concurrency=8, max_attempts=2, call_timeout=None
                )
            ]
            _check(outcomes, pool, 200)


@pytest.mark.parametrize("pool_type", [_EchoPool, _ChainedEchoPool])
async def test_an_input_that_cannot_be_an_item_fails_alone_among_pending_ones(
    pool_type: type[_EchoPool],
) -> None:
    with FakeOpenAIServer(script=_held_script) as server:
        producer = Agent(
            "producer", "Say ready.", provider=Provider(model="f", base_url=server.base_url)
        )

        def source() -> Iterator[Any]:
            for i, value in enumerate(_inputs(producer, random.Random(5), 120, 0.5)):
                yield 42 if i % 10 == 3 else value

        pool = pool_type(5)
        outcomes = [
            o async for o in drive(pool, source(), concurrency=8, max_attempts=2, call_timeout=None)
        ]
    assert sorted(o.index for o in outcomes) == list(range(120))
    for o in outcomes:
        if o.index % 10 == 3:
            assert o.status == "error" and "Sessions or strs" in str(o.error)
        else:
            assert o.status == "ok" and o.messages is not None
            assert [m for m in o.messages if m["role"] == "user"][-1]["content"].startswith(
                f"w{o.index} "
            )


@pytest.mark.parametrize("mixed", [False, True])
async def test_a_chain_pulls_no_more_than_the_undelivered_bound(mixed: bool) -> None:
    """A caller that takes its outcomes slowly: the chained passes stop at the bound the
    scheduler keeps (passes in flight plus outcomes not yet taken, 2 x concurrency), as its
    tasks do, and every input still comes out once. Mixed: every other input a session, which a
    chain takes but hands to the loop, and that input counts against the bound too."""
    most = 0
    for seed, slow in [(seed, slow) for seed in range(6) for slow in (0, 1, 2, 5)]:
        pulled = 0

        def source() -> Iterator[Any]:
            nonlocal pulled
            for i in range(200):
                pulled += 1
                if mixed and i % 2:
                    yield Session.from_user_message(f"w{i} 0")
                else:
                    yield f"w{i} 0"

        pool = _ChainedEchoPool(seed)
        outcomes: list[PassOutcome] = []
        async for outcome in drive(
            pool, source(), concurrency=4, max_attempts=2, call_timeout=None
        ):
            outcomes.append(outcome)
            most = max(most, pulled - len(outcomes))
            for _ in range(slow):  # the caller is slow: the passes run ahead meanwhile
                await asyncio.sleep(0)
        assert sorted(o.index for o in outcomes) == list(range(200))
        assert pool.chained > 0
    assert most <= 2 * 4


async def test_an_input_iterable_failing_mid_chain_fails_the_map_after_earlier_outcomes() -> None:
    """The iterable raises while a chain takes the next input: the map raises that error, and
    the outcome the chain held when it took the input was delivered first."""

    def source() -> Iterator[str]:
        for i in range(40):
            yield f"w{i} 0"
        raise RuntimeError("the source broke")

    pool = _ChainedEchoPool(3)
    outcomes: list[PassOutcome] = []
    # In the scheduler's task group, as when its tasks take the input (test_distributed_driver).
    with pytest.raises(ExceptionGroup) as raised:
        async for outcome in drive(
            pool, source(), concurrency=4, max_attempts=2, call_timeout=None
        ):
            outcomes.append(outcome)
    errors = raised.value.subgroup(RuntimeError)
    assert errors is not None and "the source broke" in str(errors.exceptions[0])
    assert sorted(o.index for o in outcomes) == list(range(40))
    assert pool.chained > 0


@pytest.mark.parametrize("pool_type", [_EchoPool, _ChainedEchoPool])
async def test_a_sync_source_raising_cancelled_error_fails_the_map(
    pool_type: type[_EchoPool],
) -> None:
    """`next` of a sync iterable never awaits, so a CancelledError from it is the iterable's
    own error: the map fails with it (as a RuntimeError), on the tasks' path and the chain's,
    where raised as it is the consumer's task would end as cancelled and the map as if done."""

    def source() -> Iterator[str]:
        for i in range(40):
            yield f"w{i} 0"
        raise asyncio.CancelledError("the source stopped")

    outcomes: list[PassOutcome] = []
    with pytest.raises(ExceptionGroup) as raised:
        async for outcome in drive(
            pool_type(5), source(), concurrency=4, max_attempts=2, call_timeout=None
        ):
            outcomes.append(outcome)
    errors = raised.value.subgroup(RuntimeError)
    assert errors is not None
    assert isinstance(errors.exceptions[0].__cause__, asyncio.CancelledError)
    assert sorted(o.index for o in outcomes) == list(range(40))
