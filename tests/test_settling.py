"""`Settling`, the result slot behind every `LazyValue`, keeps the `concurrent.futures.Future`
contract Treadle relies on: each test runs against both, so a difference shows as a failure."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import threading
from typing import Any

import pytest

from treadle.runtime.settling import Settling

KINDS = [Settling, concurrent.futures.Future]


@pytest.mark.parametrize("kind", KINDS)
def test_a_value_reaches_every_blocked_reader_and_every_callback(kind: Any) -> None:
    slot, seen, got = kind(), [], []
    slot.add_done_callback(lambda s: seen.append(("early", s.result())))
    readers = [threading.Thread(target=lambda: got.append(slot.result(30))) for _ in range(4)]
    for reader in readers:
        reader.start()
    slot.set_result(7)
    for reader in readers:
        reader.join()
    slot.add_done_callback(lambda s: seen.append(("late", s.result())))  # runs at once
    assert got == [7, 7, 7, 7]
    assert seen == [("early", 7), ("late", 7)]
    assert slot.done() and not slot.cancelled() and slot.exception() is None


@pytest.mark.parametrize("kind", KINDS)
def test_a_read_that_times_out_raises_timeout_and_a_later_value_still_arrives(kind: Any) -> None:
    slot = kind()
    with pytest.raises(TimeoutError):
        slot.result(0.01)
    with pytest.raises(TimeoutError):
        slot.exception(0)
    slot.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        slot.result(0)
    assert isinstance(slot.exception(), ValueError)


@pytest.mark.parametrize("kind", KINDS)
def test_settling_twice_is_refused_and_cancel_only_takes_a_pending_slot(kind: Any) -> None:
    done = kind()
    done.set_result(1)
    with pytest.raises(concurrent.futures.InvalidStateError):
        done.set_result(2)
    with pytest.raises(concurrent.futures.InvalidStateError):
        done.set_exception(ValueError())
    assert done.cancel() is False and done.result() == 1
    cancelled = kind()
    assert cancelled.cancel() is True and cancelled.cancel() is True
    assert cancelled.cancelled() and cancelled.done()
    with pytest.raises(concurrent.futures.CancelledError):
        cancelled.result()
    with pytest.raises(concurrent.futures.CancelledError):
        cancelled.exception()
    with pytest.raises(concurrent.futures.InvalidStateError):
        cancelled.set_result(3)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failing_callback_is_logged_and_the_others_still_run(
    kind: Any, caplog: pytest.LogCaptureFixture
) -> None:
    slot, seen = kind(), []

    def bad(_s: Any) -> None:
        raise RuntimeError("callback bug")

    slot.add_done_callback(bad)
    slot.add_done_callback(lambda s: seen.append(s.result()))
    with caplog.at_level(logging.ERROR):
        slot.set_result("v")
    assert seen == ["v"]
    assert "callback bug" in caplog.text


def test_a_pending_slot_with_one_callback_is_one_tracked_object() -> None:
    # The point of it (docs/performance.md): a concurrent.futures.Future is 11; a single callback
    # (a lazy output's usage record) is kept without a list.
    gc.collect()
    before = len(gc.get_objects())
    slots: list[Settling[int]] = [Settling() for _ in range(1000)]
    for slot in slots:
        slot.add_done_callback(print)
    assert (len(gc.get_objects()) - before) / 1000 <= 1.01


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", [1, 2, 3])
def test_callbacks_run_once_each_in_the_order_added(kind: Any, count: int) -> None:
    slot = kind()
    seen: list[int] = []
    for i in range(count):
        slot.add_done_callback(lambda s, i=i: seen.append(i))
    slot.set_result(5)
    assert seen == list(range(count))
    slot.add_done_callback(lambda s: seen.append(99))  # late: at once
    assert seen == [*range(count), 99]


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_slot_read_by_a_reader_is_freed_without_the_collector(kind: Any) -> None:
    # The error's traceback holds the reading frames; were `self` left in them, the slot and its
    # error would stay alive in a cycle until the cyclic collector ran (Future breaks it too).
    import weakref

    gc.disable()
    try:
        slot = kind()
        slot.set_exception(ValueError("boom"))
        with pytest.raises(ValueError):
            slot.result()
        ref = weakref.ref(slot)
        del slot
        assert ref() is None
    finally:
        gc.enable()
