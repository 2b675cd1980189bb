"""Waking the runtime's loop only when it sleeps (`treadle.runtime.quiet_wake`): no callback
waits for an unrelated wake-up, whatever the timing, and a busy loop gets no self-pipe write."""

from __future__ import annotations

import asyncio
import random
import selectors
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from treadle.runtime.quiet_wake import QuietWake, Wake, _WatchedSelector, new_runtime_loop


def _quiet(wake: Wake) -> bool:
    return isinstance(getattr(wake, "__self__", None), QuietWake)


@pytest.fixture
def running() -> Iterator[tuple[asyncio.AbstractEventLoop, Wake]]:
    """A runtime loop on its own thread, with its quiet wake; stopped and closed after."""
    loop, quiet = new_runtime_loop()
    assert _quiet(quiet), "the stock policy's loop gets a QuietWake"
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop, quiet
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _writes(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Counts the loop's self-pipe writes from now on (in one list cell)."""
    count = [0]
    write = loop._write_to_self  # type: ignore[attr-defined]

    def counted() -> None:
        count[0] += 1
        write()

    loop._write_to_self = counted  # type: ignore[attr-defined]
    return count


class _YieldingSelector(_WatchedSelector):
    """Lets the other thread run on the loop's way into its sleep, before the watch starts: the
    moment a submission could be missed, met at every sleep instead of now and then."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        time.sleep(0)
        return super().select(timeout)


@pytest.mark.parametrize("yielding", [False, True], ids=["as-is", "yielding-before-sleep"])
def test_no_callback_waits_for_an_unrelated_wake_up(yielding: bool) -> None:
    # One thread schedules callbacks that keep the loop busy for a random while, each as the
    # last one ends, so every callback meets the loop on its way from busy to asleep. With no
    # timer and no other thread to wake the loop, a callback queued after the loop's last look
    # at its queue but unseen by the submitter as a sleep would hang its wait.
    if yielding:
        selector = _YieldingSelector()
        loop: asyncio.AbstractEventLoop = asyncio.SelectorEventLoop(selector)
        selector.ready = loop._ready  # type: ignore[attr-defined]
        quiet = QuietWake(loop, selector).call_soon
    else:
        loop, quiet = new_runtime_loop()
        assert _quiet(quiet)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    # Threads switch every microsecond (not every 5 ms): that moment is met often.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    lost = None
    try:
        for i in range(3000):
            ran = threading.Event()

            def work(ran: threading.Event = ran) -> None:
                sum(range(random.randrange(300)))
                ran.set()

            quiet(work)
            if not ran.wait(5):
                lost = i
                break
            sum(range(random.randrange(100)))  # the next one lands anywhere on the loop's way
    finally:
        sys.setswitchinterval(interval)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert lost is None, f"callback {lost} waited for a wake-up that never came"


def test_callbacks_from_many_threads_all_run(
    running: tuple[asyncio.AbstractEventLoop, Wake],
) -> None:
    _, quiet = running
    missing: list[int] = []

    def submitter(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(400):
            ran = threading.Event()
            quiet(ran.set)
            if not ran.wait(5):
                missing.append(i)
            if rng.random() < 0.3:
                time.sleep(rng.random() / 10000)

    threads = [threading.Thread(target=submitter, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert missing == []


def test_an_idle_loop_is_woken_at_once(
    running: tuple[asyncio.AbstractEventLoop, Wake],
) -> None:
    loop, quiet = running
    selector = getattr(quiet, "__self__")._selector  # noqa: B009 - the bound method's owner
    writes = _writes(loop)
    for _ in range(20):
        for _ in range(5000):  # until the loop is back in its selector (a loaded machine is slow)
            if selector.sleeping:
                break
            time.sleep(0.001)
        ran = threading.Event()
        quiet(ran.set)
        assert ran.wait(5), "the sleeping loop was not woken"
    assert writes[0] == 20


def test_a_busy_loop_gets_no_self_pipe_write(
    running: tuple[asyncio.AbstractEventLoop, Wake],
) -> None:
    loop, quiet = running
    writes = _writes(loop)
    busy, release = threading.Event(), threading.Event()
    ran = threading.Event()

    def hold() -> None:  # a callback of the loop's, running: the loop is busy, not asleep
        busy.set()
        release.wait(5)

    quiet(hold)
    assert busy.wait(5)
    before = writes[0]
    quiet(ran.set)  # queued while the loop runs `hold`
    release.set()
    assert ran.wait(5), "a callback queued while the loop was busy never ran"
    assert writes[0] == before


def test_a_closed_loop_refuses_like_call_soon_threadsafe() -> None:
    loop, quiet = new_runtime_loop()
    assert _quiet(quiet)
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        quiet(lambda: None)


def test_another_policys_loop_is_left_alone() -> None:
    class Policy(asyncio.DefaultEventLoopPolicy):
        """A policy of the program's own (as uvloop's is): its loop, woken as before."""

    old = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(Policy())
    try:
        loop, quiet = new_runtime_loop()
    finally:
        asyncio.set_event_loop_policy(old)
    try:
        assert quiet == loop.call_soon_threadsafe
        assert isinstance(loop, asyncio.AbstractEventLoop)
    finally:
        loop.close()


def test_a_policys_own_loop_class_is_kept() -> None:
    class Loop(asyncio.SelectorEventLoop):
        """A program's own loop class, set on the stock policy."""

    policy = asyncio.DefaultEventLoopPolicy()
    policy._loop_factory = Loop  # type: ignore[attr-defined]
    old = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(policy)
    try:
        loop, quiet = new_runtime_loop()
    finally:
        asyncio.set_event_loop_policy(old)
    try:
        assert type(loop) is Loop
        assert quiet == loop.call_soon_threadsafe
    finally:
        loop.close()


def test_the_runtime_passes_still_run_from_many_threads() -> None:
    # End to end through the runtime: submissions from threads while others' passes settle.
    from treadle.runtime.background import get_runtime

    runtime = get_runtime()
    assert _quiet(runtime._wake)

    async def value(i: int) -> int:
        await asyncio.sleep(random.random() / 1000)
        return i

    results: list[Any] = []

    def caller(base: int) -> None:
        results.extend(runtime.submit(value(base + i)).result(10) for i in range(200))

    threads = [threading.Thread(target=caller, args=(k * 1000,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == sorted(k * 1000 + i for k in range(4) for i in range(200))
