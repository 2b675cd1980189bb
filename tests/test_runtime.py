"""The background runtime and lazy values: overlap, waiting, errors, timeouts, fork safety."""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
import threading
import time
from typing import Any

import pytest

from treadle import RuntimeLoopError, Session, run_session_loop
from treadle.runtime import get_runtime, run_lazy, submit
from treadle.runtime.background import Runtime


async def _value(x: int, delay: float = 0.0) -> int:
    await asyncio.sleep(delay)
    return x


def test_thousand_lazy_values_all_complete() -> None:
    lazies = [submit(_value(i, 0.01)) for i in range(1000)]
    assert [lv.result(timeout=60) for lv in lazies] == list(range(1000))


def test_runtime_runs_on_a_daemon_thread() -> None:
    rt = get_runtime()
    assert rt._thread.daemon
    assert not rt.in_loop_thread()
    assert rt.run(_value(7)) == 7


def test_timeout_raises_timeout_error() -> None:
    gate = threading.Event()

    async def blocked() -> int:
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return 1

    lazy = submit(blocked())
    with pytest.raises(TimeoutError):
        lazy.result(timeout=0.05)
    gate.set()
    assert lazy.result(timeout=30) == 1


def test_failure_reraises_same_error_on_every_read() -> None:
    async def fail() -> Session:
        raise KeyError("boom")

    out = run_lazy(fail())
    errors = []
    for _ in range(3):
        with pytest.raises(KeyError, match="boom") as info:
            _ = out.chunk_table
        errors.append(info.value)
    assert errors[0] is errors[1] is errors[2]
    with pytest.raises(KeyError):
        _ = out.usage


def test_sync_read_on_runtime_thread_raises_instead_of_deadlocking() -> None:
    gate = threading.Event()

    async def slow() -> Session:
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return Session.from_user_message("late")

    pending = run_lazy(slow())

    async def reads_synchronously() -> str:
        try:
            _ = pending.chunk_table
        except RuntimeLoopError as err:
            return str(err)
        return "no error"

    message = submit(reads_synchronously()).result(timeout=30)
    gate.set()
    assert "use `await`" in message
    assert pending.synchronize(timeout=30).rows[0].content == "late"


def test_lazy_session_facade_knows_id_and_lineage_at_once() -> None:
    gate = threading.Event()
    parent = Session.from_user_message("p")

    async def make() -> Session:
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return parent.add_user_message("child")

    out = run_lazy(make(), parents=[parent], operator="test")
    assert not out.done()
    assert out.lineage.parent_ids == (parent.id,)
    assert "pending" in repr(out)
    gate.set()
    assert [r.content for r in out.synchronize(timeout=30).rows] == ["p", "child"]


async def test_await_from_another_loop_does_not_block_it() -> None:
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.005)

    async def slow() -> Session:
        await asyncio.sleep(0.3)
        return Session.from_user_message("done")

    beat = asyncio.create_task(heartbeat())
    try:
        out = await run_lazy(slow())
    finally:
        beat.cancel()
    assert out.rows[0].content == "done"
    assert ticks >= 5  # the caller's loop kept running while it awaited


async def test_cancelling_the_awaiter_cancels_the_work() -> None:
    started = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def forever() -> int:
        loop.call_soon_threadsafe(started.set)
        await asyncio.sleep(3600)
        return 0

    lazy = submit(forever())
    waiter = asyncio.ensure_future(lazy.wait())
    await started.wait()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.to_thread(_wait_done, lazy)
    assert lazy.done()


def _wait_done(lazy: object) -> None:
    import concurrent.futures
    import contextlib

    with contextlib.suppress(concurrent.futures.CancelledError):
        lazy.result(timeout=30)  # type: ignore[attr-defined]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_child_gets_a_fresh_runtime() -> None:
    parent_rt = get_runtime()
    assert parent_rt.run(_value(1)) == 1
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not touch the parent's (dead) loop thread
        code = 1
        try:
            child_rt = get_runtime()
            ok = child_rt is not parent_rt and child_rt.run(_value(41, 0.01), timeout=10) == 41
            os.write(write_end, b"ok" if ok else b"bad")
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    assert os.read(read_end, 10) == b"ok"
    assert os.WEXITSTATUS(status) == 0
    assert get_runtime() is parent_rt


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_is_refused_by_its_parents_runtime() -> None:
    # The child must be told the parent's runtime is not its own, and the coroutine closed.
    parent_rt = get_runtime()
    assert parent_rt.run(_value(1)) == 1
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            coro = _value(2)
            try:
                parent_rt.submit(coro)
                os.write(write_end, b"accepted")
            except RuntimeError:
                closed = inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
                os.write(write_end, b"refused" if closed else b"open")
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    assert os.read(read_end, 20) == b"refused"  # and the coroutine was closed
    assert os.WEXITSTATUS(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def _asleep_in_epoll(rt: Runtime) -> None:
    """Return once the runtime's loop thread sleeps in `epoll_wait` (up to 10 s; where there is
    no /proc, after a pause).

    A fork outside Python's at-fork hooks copies into the child whatever the other threads held
    at that moment, and the child has no such threads to let go of it: the loop thread, still
    finishing the step that woke this one, may hold a lock or, around a call that releases it,
    the GIL. A C extension forking a threaded program runs that risk; this test forks when the
    loop thread holds nothing, to test what it is about (the child's process id check)."""
    tid = rt._thread.native_id
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/self/task/{tid}/wchan") as f:
                wchan = f.read()
        except (OSError, IndexError):
            time.sleep(0.2)
            return
        if state == "S" and "epoll" in wchan:
            return
        time.sleep(0.001)


def test_a_child_forked_by_libc_gets_a_fresh_runtime() -> None:
    # A C extension's fork() runs none of Python's at-fork hooks: only the process id tells
    # the child that the runtime it inherited has no thread here.
    import ctypes

    parent_rt = get_runtime()
    assert parent_rt.run(_value(1)) == 1
    read_end, write_end = os.pipe()
    _asleep_in_epoll(parent_rt)
    # `PyDLL`: the call keeps the GIL, as a C extension's code does (`CDLL` lets go of it).
    pid = ctypes.PyDLL(None).fork()
    if pid == 0:
        code = 1
        try:
            coro = _value(2)
            try:
                parent_rt.submit(coro)
                refused = b"accepted"
            except RuntimeError:
                refused = b"refused"
            try:
                got = str(submit(_value(41, 0.01)).result(timeout=10))
            except Exception as e:  # the parent's runtime: RuntimeLoopError
                got = type(e).__name__
            os.write(write_end, refused + b" " + got.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    assert os.read(read_end, 100) == b"refused 41"
    assert os.WEXITSTATUS(status) == 0
    assert get_runtime() is parent_rt


def test_shutdown_drains_then_a_new_runtime_starts(tmp_path: object) -> None:
    import subprocess

    script = (
        "import asyncio, treadle.runtime as r\n"
        "async def work():\n"
        "    await asyncio.sleep(0.2)\n"
        "    print('finished', flush=True)\n"
        "r.submit(work())\n"
        "print('exiting', flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["exiting", "finished"]  # drained at exit, not dropped


def test_a_value_settles_inside_its_task_and_the_runtime_counts_it_ended() -> None:
    """A value a thread is blocked on is handed over in its task's last step, not one loop
    iteration later by a done callback (the blocked reader waited for that iteration); the
    runtime has counted the work as ended by then, and what waited for its place can start."""
    rt = Runtime(max_started=1)
    try:
        mine: list[Any] = []

        async def held() -> int:
            while not (mine and mine[0]._future._waiters):
                await asyncio.sleep(0)  # until the test's thread blocks reading this value
            return 5

        first = rt.submit(held())
        seen: list[tuple[object, int]] = []
        first.add_done_callback(lambda _: seen.append((asyncio.current_task(), rt.pending)))
        second = rt.submit(_value(6))
        mine.append(first)
        assert first.result(timeout=60) == 5
        assert seen == [(first._task, 1)]  # in the task; the second one started, not ended
        assert second.result(timeout=60) == 6
        assert rt.pending == 0
    finally:
        rt.shutdown(5)


def test_cancel_asked_before_the_first_step_stops_a_pass_whose_input_ends_meanwhile() -> None:
    """The runtime's loop is held while a pass and its pending input are submitted, the pass is
    cancelled and the input is let through: once the loop runs, both start in one iteration and
    the input ends in its first step. The pass must still stop cleanly before any request (its
    cancel is delivered once its body started), not run to its answer."""
    from treadle.testing.scripted import ScriptedExecutor

    held, holding, gate = threading.Event(), threading.Event(), threading.Event()

    async def hold_the_loop() -> None:
        holding.set()
        held.wait(60)  # on purpose: nothing runs on the loop until the test has done its part

    async def later() -> Session:
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return Session.from_user_message("late")

    blocker = submit(hold_the_loop())
    try:
        assert holding.wait(60)
        pending_input = run_lazy(later())
        executor = ScriptedExecutor(["x"])
        out = run_session_loop(pending_input, Session.from_agent_prompt("sys"), executor=executor)
        out.cancel()
        gate.set()
    finally:
        held.set()  # whatever failed above, the loop is not left held for other tests
    blocker.result(timeout=60)
    done = out.synchronize(timeout=60)
    assert done.stop_reason == "cancelled"
    assert [r.payload["content"] for r in done.rows] == ["late"]
    assert executor.requests == []


def test_a_submission_accepted_as_shutdown_begins_runs_or_fails_never_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A thread's submission passed the closed check just before `shutdown` closed the runtime,
    # and reaches the inbox only while the drain waits for an earlier pass: the drain must wait
    # for it too (it was accepted), not stop the loop with it running and its reader waiting
    # forever.
    from treadle.runtime import background

    runtime = Runtime()
    between, release = threading.Event(), threading.Event()
    real = background.in_worker_thread

    def held() -> bool:  # called in `_submit` after the check, before the inbox
        if threading.current_thread().name == "late-submitter":
            between.set()
            release.wait(10)
        return real()

    monkeypatch.setattr(background, "in_worker_thread", held)

    async def value(seconds: float, result: int) -> int:
        await asyncio.sleep(seconds)
        return result

    early = runtime.submit(value(0.3, 1))
    accepted: list[Any] = []
    late = threading.Thread(
        target=lambda: accepted.append(runtime.submit(value(0.6, 2))), name="late-submitter"
    )
    late.start()
    assert between.wait(10)
    closing = threading.Thread(target=runtime.shutdown, kwargs={"drain_seconds": 5})
    closing.start()
    for _ in range(1000):  # until the runtime is closed and its drain waits for `early`
        if runtime.closed:
            break
        time.sleep(0.001)
    time.sleep(0.1)
    release.set()
    late.join(10)
    closing.join(30)
    assert early.result(timeout=5) == 1
    [lazy] = accepted
    try:
        assert lazy.result(timeout=5) == 2
    except TimeoutError:
        pytest.fail("a submission accepted before the close was never run nor failed")
