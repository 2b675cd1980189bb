"""Chained passes on real worker processes (`ProcessPool.run_chained`, `_Chain`): the next input
sent from the socket's read callback as a pass ends. Real workers, the fake OpenAI server over
loopback; the pool's `run_chained` is wrapped only to count the passes its callback chained."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mcp_helpers import alive
from treadle.distributed import PassItem, PassOutcome, map_outcomes
from treadle.distributed.process import ProcessPool
from treadle.testing import FakeOpenAIServer
from treadle.testing.sample_tools import shout_script, shouter


class _Stop(BaseException):
    """Not an Exception: what pytest's Failed or a library's own stop signal looks like."""


@pytest.fixture
def chained(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts of passes each `run_chained` call sent from the read callback (after its first)."""
    counts: list[int] = []
    original = ProcessPool.run_chained

    async def counting(
        self: ProcessPool,
        slot: int,
        item: PassItem,
        step: Callable[[PassOutcome], PassItem | PassOutcome],
    ) -> PassOutcome:
        counts.append(0)
        mine = len(counts) - 1

        def counted(outcome: PassOutcome) -> PassItem | PassOutcome:
            following = step(outcome)
            if isinstance(following, PassItem):
                counts[mine] += 1
            return following

        return await original(self, slot, item, counted)

    monkeypatch.setattr(ProcessPool, "run_chained", counting)
    return counts


async def _collect(
    base_url: str, source: Iterator[Any], *, workers: int, concurrency: int, **kw: Any
) -> tuple[list[PassOutcome], BaseException | None]:
    outcomes: list[PassOutcome] = []
    try:
        async with asyncio.timeout(120):  # a guard against a hang, not a timing
            async for outcome in map_outcomes(
                shouter(base_url),
                source,
                backend="process",
                workers=workers,
                concurrency=concurrency,
                **kw,
            ):
                outcomes.append(outcome)
    except TimeoutError:
        raise AssertionError("the map hung") from None
    except BaseException as err:  # the test asserts what the map raised
        return outcomes, err
    return outcomes, None


@pytest.mark.parametrize("kind", [_Stop, asyncio.CancelledError])
async def test_a_source_raising_a_base_exception_mid_chain_fails_the_map(
    kind: type[BaseException], chained: list[int]
) -> None:
    """The input iterable raises a BaseException that is not an Exception while a chain takes
    the next input in the read callback: the map ends with that error (a CancelledError from the
    iterable's own `next` as a RuntimeError, or the map would end as if cancelled and drop it),
    after the outcomes before it, and no worker is left."""

    def source() -> Iterator[str]:
        for i in range(200):
            if i == 120:
                raise kind("the source stopped")
            yield f"x{i}"

    with FakeOpenAIServer(script=shout_script) as server:
        outcomes, err = await _collect(
            server.base_url, source(), workers=2, concurrency=4, max_attempts=1
        )
    assert isinstance(err, BaseExceptionGroup), repr(err)
    if kind is _Stop:
        assert err.subgroup(_Stop) is not None
    else:
        found = err.subgroup(RuntimeError)
        assert found is not None
        assert isinstance(found.exceptions[0].__cause__, asyncio.CancelledError)
    assert sum(chained) > 0
    assert {o.status for o in outcomes} == {"ok"}
    assert all(o.index < 120 for o in outcomes)
    assert len({o.index for o in outcomes}) == len(outcomes)
    pids = {int(o.worker.rsplit(":", 1)[1]) for o in outcomes}
    assert pids and not [pid for pid in pids if alive(pid)]


def _said(outcome: PassOutcome) -> str:
    return str([m for m in outcome.messages if m["role"] == "user"][-1]["content"])


async def test_a_chain_keeps_the_input_order_on_one_worker(chained: list[int]) -> None:
    """One worker, one pass at a time: the chain sends each input as the pass before it ends,
    so the outcomes come in the source's order, each the pass of its own input."""
    with FakeOpenAIServer(script=shout_script) as server:
        outcomes, err = await _collect(
            server.base_url, iter([f"x{i}" for i in range(30)]), workers=1, concurrency=1
        )
    assert err is None
    assert [o.index for o in outcomes] == list(range(30))
    assert [_said(o) for o in outcomes] == [f"x{i}" for i in range(30)]
    assert {o.status for o in outcomes} == {"ok"}
    assert sum(chained) > 0


async def test_an_input_that_cannot_be_an_item_fails_alone_in_a_chain(chained: list[int]) -> None:
    """A chain takes an input that is neither a session nor a str: that input fails alone (the
    loop reports it), the chain goes on with the next, and the order on one worker holds."""
    inputs: list[Any] = [f"x{i}" for i in range(20)]
    inputs[7] = 42
    with FakeOpenAIServer(script=shout_script) as server:
        outcomes, err = await _collect(server.base_url, iter(inputs), workers=1, concurrency=1)
    assert err is None
    assert [o.index for o in outcomes] == list(range(20))
    failed = [o for o in outcomes if o.status != "ok"]
    assert [(o.index, o.status) for o in failed] == [(7, "error")]
    assert "Sessions or strs" in (failed[0].error or "")
    assert [_said(o) for o in outcomes if o.status == "ok"] == [
        f"x{i}" for i in range(20) if i != 7
    ]
    assert sum(chained) > 0


async def test_a_worker_killed_mid_chain_loses_no_input(chained: list[int]) -> None:
    """A worker SIGKILLed while its chains have passes in flight: those passes are retried on
    the new worker, and every input comes out once, ok, the lost attempt in its history."""
    killed: list[str] = []
    outcomes: list[PassOutcome] = []
    with FakeOpenAIServer(script=shout_script, latency_ms=30) as server:
        async with asyncio.timeout(120):  # a guard against a hang, not a timing
            async for outcome in map_outcomes(
                shouter(server.base_url),
                iter([f"x{i}" for i in range(60)]),
                backend="process",
                workers=2,
                concurrency=3,
            ):
                outcomes.append(outcome)
                if len(outcomes) == 10:  # the chains are running by now
                    killed.append(outcome.worker)
                    os.kill(int(outcome.worker.rsplit(":", 1)[1]), signal.SIGKILL)
    assert sorted(o.index for o in outcomes) == list(range(60))
    assert {o.status for o in outcomes} == {"ok"}
    assert all(_said(o) == f"x{o.index}" for o in outcomes)
    retried = [o for o in outcomes if o.attempts > 1]
    assert retried, "the killed worker had passes in flight"
    for outcome in retried:
        assert outcome.history[0]["status"] == "lost"
        assert outcome.history[0]["worker"] == killed[0]
        assert outcome.worker != killed[0]
    assert sum(chained) > 0
