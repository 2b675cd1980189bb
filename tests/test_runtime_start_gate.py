"""The runtime's start gate: passes submitted from other threads beyond `max_started` wait,
unstarted, until one ends; none is lost, deadlocked, or left running after a cancel."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from treadle.runtime.background import Runtime
from treadle.runtime.start_gate import DEFAULT_MAX_STARTED, STALL_SECONDS
from treadle.session.session import new_session_id


class Counter:
    """How many coroutines run at once, and the most seen."""

    def __init__(self) -> None:
        self.now = self.most = 0

    async def hold(self, seconds: float, value: int) -> int:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.now -= 1
        return value


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    rt = Runtime(max_started=3)
    yield rt
    rt.shutdown(5)


def test_at_most_max_started_run_and_every_one_completes(runtime: Runtime) -> None:
    counter = Counter()
    lazies = [runtime.submit(counter.hold(0.01, i)) for i in range(40)]
    assert [lv.result(timeout=60) for lv in lazies] == list(range(40))
    assert counter.most <= 3
    assert runtime.pending == 0


def test_waiting_passes_count_as_pending(runtime: Runtime) -> None:
    release = threading.Event()

    async def blocked() -> None:
        while not release.is_set():
            await asyncio.sleep(0.01)

    lazies = [runtime.submit(blocked()) for _ in range(10)]
    assert runtime.pending == 10  # 3 running, 7 waiting to start: none is invisible
    release.set()
    for lv in lazies:
        lv.result(timeout=60)


def test_a_pass_waiting_on_a_later_pass_does_not_deadlock(runtime: Runtime) -> None:
    # Three passes fill the gate, each waiting for an event only a later pass sets: the stall
    # check lets the later one start.
    done = threading.Event()

    async def wait_for_later() -> str:
        while not done.is_set():
            await asyncio.sleep(0.01)
        return "waited"

    async def later() -> str:
        done.set()
        return "set"

    first = [runtime.submit(wait_for_later()) for _ in range(3)]
    last = runtime.submit(later())
    assert last.result(timeout=60) == "set"
    assert [lv.result(timeout=60) for lv in first] == ["waited"] * 3


def test_passes_whose_replies_keep_coming_hold_the_gate() -> None:
    # Issue 33: passes that each read many replies (real HTTP, the fake server) take longer than
    # STALL_SECONDS to end. Replies arriving are progress, not a stall: no extra pass starts
    # while they come (before, every 0.5 s without a pass ending let more start, and 10,000
    # submitted passes all ran at once).
    from treadle._http.pool import Pool
    from treadle._http.reply import Timeouts
    from treadle.testing import FakeOpenAIServer

    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    headers = {"content-type": "application/json", "authorization": "Bearer k"}
    requests_per_pass = int(2 * STALL_SECONDS / 0.02)  # a pass outlasts a stall check
    counter = Counter()
    rt = Runtime(max_started=2)
    try:
        with FakeOpenAIServer(script="echo", latency_ms=20) as server:
            url = f"{server.base_url}/chat/completions"
            pool = Pool()

            async def many_replies(i: int) -> int:
                counter.now += 1
                counter.most = max(counter.most, counter.now)
                try:
                    for _ in range(requests_per_pass):
                        reply = await pool.post(url, body, headers, Timeouts(10, 10, 10))
                        assert reply.status == 200
                finally:
                    counter.now -= 1
                return i

            lazies = [rt.submit(many_replies(i)) for i in range(3)]
            assert [lv.result(timeout=120) for lv in lazies] == [0, 1, 2]
            rt.run(pool.aclose())
    finally:
        rt.shutdown(5)
    assert counter.most == 2


def test_cancelling_a_waiting_pass_cancels_it_when_it_starts(runtime: Runtime) -> None:
    release = threading.Event()
    ran = []

    async def blocked() -> None:
        while not release.is_set():
            await asyncio.sleep(0.01)

    async def should_not_finish() -> None:
        ran.append("started")
        await asyncio.sleep(30)
        ran.append("finished")

    holders = [runtime.submit(blocked()) for _ in range(3)]
    waiting = runtime.submit(should_not_finish())
    waiting.cancel()
    release.set()
    for lv in holders:
        lv.result(timeout=60)
    with pytest.raises(BaseException) as info:
        waiting.result(timeout=60)
    assert "Cancelled" in type(info.value).__name__
    assert "finished" not in ran


def test_shutdown_runs_the_waiting_passes() -> None:
    rt = Runtime(max_started=1)
    counter = Counter()
    lazies = [rt.submit(counter.hold(0.01, i)) for i in range(10)]
    rt.shutdown(10)
    assert [lv.result(timeout=1) for lv in lazies] == list(range(10))


def test_the_default_cap_comes_from_the_environment() -> None:
    code = "from treadle.runtime.background import Runtime; r = Runtime(); print(r._max_started)"
    env = {**os.environ, "TREADLE_MAX_STARTED_PASSES": "7"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "7", out.stderr
    env["TREADLE_MAX_STARTED_PASSES"] = "many"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == str(DEFAULT_MAX_STARTED)
    assert "not an integer" in out.stderr


def test_session_ids_do_not_follow_the_global_random_seed() -> None:
    random.seed(0)
    first = new_session_id()
    random.seed(0)
    assert new_session_id() != first
    assert len(first) == 32 and int(first, 16) >= 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_draws_other_session_ids() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write, new_session_id().encode())
        os._exit(0)
    os.close(write)
    mine = new_session_id()
    theirs = os.read(read, 64).decode()
    os.waitpid(pid, 0)
    os.close(read)
    assert theirs and theirs != mine


def test_a_sub_pass_from_a_worker_thread_does_not_wait_behind_the_queue(runtime: Runtime) -> None:
    # The gate is full with passes whose sync tool (on a worker thread) runs and reads a
    # sub-pass; ordinary passes queued behind them block until released. The parents still
    # finish first: their sub-passes start at once instead of queueing behind the others.
    from treadle.runtime.threads import in_worker_thread, run_user_code

    release = threading.Event()
    flagged: list[bool] = []

    async def sub(i: int) -> int:
        return i

    def sync_tool(i: int) -> int:
        flagged.append(in_worker_thread())
        return runtime.submit(sub(i)).result(timeout=60)

    async def parent(i: int) -> int:
        return await run_user_code(sync_tool, i)

    async def blocked(i: int) -> int:
        while not release.is_set():
            await asyncio.sleep(0.01)
        return i

    parents = [runtime.submit(parent(i)) for i in range(3)]
    others = [runtime.submit(blocked(i)) for i in range(10)]
    assert [lv.result(timeout=60) for lv in parents] == [0, 1, 2]
    assert flagged == [True, True, True] and not in_worker_thread()
    release.set()
    assert [lv.result(timeout=60) for lv in others] == list(range(10))


def test_a_burst_starts_its_passes_at_the_look_that_finds_them() -> None:
    # No hold while a burst arrives (tried and dropped, docs/performance.md): a pass submitted
    # in a burst starts at the first look, so a caller on another thread never waits for the
    # burst to end.
    rt = Runtime()
    try:
        loop_free, seen = threading.Event(), []

        async def work(i: int) -> int:
            return i

        rt.loop.call_soon_threadsafe(loop_free.wait, 30)  # the loop takes the burst in one look
        lazies = [rt.submit(work(i)) for i in range(5)]
        rt.loop.call_soon_threadsafe(lambda: seen.append((len(rt._tasks), len(rt._waiting))))
        loop_free.set()
        assert [lv.result(timeout=60) for lv in lazies] == list(range(5))
        assert seen == [(5, 0)]
    finally:
        rt.shutdown(5)
