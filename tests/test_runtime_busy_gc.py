"""The collector's first threshold is raised while thousands of passes are in flight and put back
after (issue 33: young collections promoted every pass's objects to full collections)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import time
from collections.abc import Iterator

import pytest

from treadle.runtime.background import Runtime
from treadle.runtime.busy_gc import (
    BUSY_FULL_THRESHOLD,
    BUSY_PASSES,
    DEFAULT_BUSY_THRESHOLD,
    BusyCollector,
)


@pytest.fixture(autouse=True)
def thresholds() -> Iterator[tuple[int, int, int]]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's default, whatever the test run set
    yield gc.get_threshold()
    gc.set_threshold(*before)


def test_raised_while_busy_and_restored_after() -> None:
    collector = BusyCollector(threshold=5000)
    collector.update(BUSY_PASSES - 1)
    assert gc.get_threshold() == (700, 10, 10)
    collector.update(BUSY_PASSES)
    assert gc.get_threshold() == (5000, 10, BUSY_FULL_THRESHOLD)
    collector.update(BUSY_PASSES // 2)  # hysteresis: still busy enough
    assert gc.get_threshold() == (5000, 10, BUSY_FULL_THRESHOLD)
    collector.update(BUSY_PASSES // 4 - 1)
    assert gc.get_threshold() == (700, 10, 10)


def test_full_collections_wait_longer_while_busy_unless_the_program_asked_rarer() -> None:
    collector = BusyCollector(threshold=5000)
    gc.set_threshold(700, 10, 500)  # the program's own rarer full collections stay
    collector.update(BUSY_PASSES)
    assert gc.get_threshold() == (5000, 10, 500)
    collector.update(0)
    assert gc.get_threshold() == (700, 10, 500)
    collector.update(BUSY_PASSES)
    gc.set_threshold(5000, 10, 20)  # changed by the program while raised: not undone
    collector.update(0)
    assert gc.get_threshold() == (5000, 10, 20)


def test_the_programs_own_setting_wins() -> None:
    collector = BusyCollector(threshold=5000)
    gc.set_threshold(50_000, 10, 10)  # already higher: left alone
    collector.update(BUSY_PASSES)
    assert collector.raised is None and gc.get_threshold()[0] == 50_000
    gc.set_threshold(700, 10, 10)
    collector.update(BUSY_PASSES)
    gc.set_threshold(1234, 5, 5)  # changed by the program while raised: not undone
    collector.update(0)
    assert gc.get_threshold() == (1234, 5, 5)


def test_zero_leaves_the_collector_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    assert BusyCollector(threshold=0).threshold == 0
    collector = BusyCollector(threshold=0)
    collector.update(10 * BUSY_PASSES)
    assert gc.get_threshold() == (700, 10, 10)
    monkeypatch.setenv("TREADLE_BUSY_GC_THRESHOLD", "0")
    assert BusyCollector().threshold == 0
    monkeypatch.setenv("TREADLE_BUSY_GC_THRESHOLD", "lots")
    assert BusyCollector().threshold == DEFAULT_BUSY_THRESHOLD


def test_the_runtime_raises_it_for_a_burst_and_restores_it() -> None:
    release = threading.Event()

    async def blocked() -> None:
        while not release.is_set():
            await asyncio.sleep(0.05)

    rt = Runtime(max_started=64)
    try:
        lazies = [rt.submit(blocked()) for _ in range(BUSY_PASSES)]
        for _ in range(500):  # until the loop took the whole burst in
            if rt.pending == BUSY_PASSES and not rt._inbox:
                break
            time.sleep(0.01)
        seen = _first_threshold_on(rt)
        release.set()
        for lv in lazies:
            lv.result(timeout=120)
        after = _first_threshold_on(rt)
    finally:
        rt.shutdown(5)
    assert seen == DEFAULT_BUSY_THRESHOLD
    assert after == 700


def _first_threshold_on(rt: Runtime) -> int:
    """The collector's first threshold, read on the runtime's loop (after what it queued)."""
    done: concurrent.futures.Future[int] = concurrent.futures.Future()
    rt.call_soon(lambda: done.set_result(gc.get_threshold()[0]))
    return done.result(timeout=60)
