"""The collector's first threshold is raised while thousands of passes are in flight and put back
after (issue 33: young collections promoted every pass's objects to full collections)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from treadle.runtime.background import Runtime
from treadle.runtime.busy_gc import (
    BUSY_FULL_THRESHOLD,
    BUSY_PASSES,
    BUSY_RUNNING,
    DEFAULT_BUSY_THRESHOLD,
    MEMORY_MARGIN,
    RUNNING_PASS,
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


def test_running_passes_raise_it_from_busy_running_on_any_thread() -> None:
    assert RUNNING_PASS.count == 0
    errors: list[BaseException] = []

    def hold(n: int) -> None:
        try:
            for _ in range(n):
                RUNNING_PASS.__enter__()
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=hold, args=(BUSY_RUNNING // 4,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and RUNNING_PASS.count == BUSY_RUNNING
    assert gc.get_threshold() == (DEFAULT_BUSY_THRESHOLD, 10, BUSY_FULL_THRESHOLD)
    for _ in range(BUSY_RUNNING - BUSY_RUNNING // 4 + 1):  # hysteresis: a quarter stays busy
        RUNNING_PASS.__exit__(None, None, None)
    assert gc.get_threshold() == (700, 10, 10)
    for _ in range(RUNNING_PASS.count):
        RUNNING_PASS.__exit__(None, None, None)
    assert RUNNING_PASS.count == 0


async def test_streams_on_the_callers_loop_raise_it_and_put_it_back() -> None:
    # Passes on the caller's loop never reach the runtime (scenario 12's concurrent streams).
    from treadle import Provider, Session, stream_session_loop
    from treadle.loop.events import TextDelta
    from treadle.testing import FakeOpenAIServer

    seen: list[int] = []
    with FakeOpenAIServer(script="echo", latency_ms=200) as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k", stream=True)
        agent = Session.from_agent_prompt("be brief")
        user = Session.from_user_message("hi")

        async def one() -> None:
            async for event in stream_session_loop(user, agent, agent_provider=provider):
                if isinstance(event, TextDelta) and not seen:
                    seen.append(gc.get_threshold()[0])  # all passes are waiting on the reply

        await asyncio.gather(*(one() for _ in range(BUSY_RUNNING)))
    assert seen == [DEFAULT_BUSY_THRESHOLD]
    assert RUNNING_PASS.count == 0 and gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("own", [(20_000, 100, 100), (20_000, 10, 10), (20_000, 5, 100)])
def test_thresholds_the_program_set_while_raised_are_kept(own: tuple[int, int, int]) -> None:
    # Restored only if the thresholds are exactly the ones Treadle set, all three values.
    collector = BusyCollector(threshold=DEFAULT_BUSY_THRESHOLD)
    collector.update(BUSY_PASSES)
    assert gc.get_threshold() == (DEFAULT_BUSY_THRESHOLD, 10, BUSY_FULL_THRESHOLD)
    gc.set_threshold(*own)
    collector.update(0)
    assert gc.get_threshold() == own
    for _ in range(BUSY_RUNNING):  # the same for running passes
        RUNNING_PASS.__enter__()
    gc.set_threshold(700, 10, 10)
    gc.set_threshold(*own)
    for _ in range(BUSY_RUNNING):
        RUNNING_PASS.__exit__(None, None, None)
    assert gc.get_threshold() == own


_GARBAGE_WORKLOAD = """
import asyncio, gc, resource
from treadle import Provider, Session, stream_session_loop
from treadle.testing import FakeOpenAIServer

async def main() -> None:
    with FakeOpenAIServer(script="echo", latency_ms=2500) as server:
        provider = Provider(model="m", base_url=server.base_url, api_key="k", stream=True)
        agent = Session.from_agent_prompt("be brief")
        user = Session.from_user_message("hi")
        async def one() -> None:
            async for _ in stream_session_loop(user, agent, agent_provider=provider):
                pass
        async def users_code() -> None:
            await asyncio.sleep(0.8)  # the streams are all waiting on their replies
            print("threshold", gc.get_threshold()[0], flush=True)
            for i in range(15000):  # cyclic garbage, 64 KiB each, freed only by the collector
                d = {"buf": bytearray(64 * 1024)}
                d["self"] = d
                if i % 500 == 0:
                    await asyncio.sleep(0)
        await asyncio.gather(users_code(), *(one() for _ in range(STREAMS)))
    print("peak", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)

asyncio.run(main())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc/self/statm")
def test_raised_thresholds_hold_at_most_the_margin_of_extra_garbage() -> None:
    # The program's own cyclic garbage while 100 streams wait (issue: 984 against 92 MiB).
    script = _GARBAGE_WORKLOAD.replace("STREAMS", str(BUSY_RUNNING))
    runs = {}
    for name, value in (("default", "0"), ("raised", "")):
        env = {**os.environ, "TREADLE_BUSY_GC_THRESHOLD": value}
        runs[name] = subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True
        )
    seen = {}
    for name, proc in runs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        seen[name] = dict(line.split() for line in out.splitlines())
    assert seen["default"]["threshold"] == "700"
    assert seen["raised"]["threshold"] == str(DEFAULT_BUSY_THRESHOLD)
    extra = int(seen["raised"]["peak"]) - int(seen["default"]["peak"])
    # The margin, plus what one watch interval can allocate on a loaded machine.
    assert extra < 3 * MEMORY_MARGIN, (extra, seen)


def test_the_memory_watch_runs_only_while_raised() -> None:
    def watching() -> bool:
        return any(t.name == "treadle-gc-watch" for t in threading.enumerate())

    collector = BusyCollector(threshold=DEFAULT_BUSY_THRESHOLD)
    collector.update(BUSY_PASSES)
    assert collector.raised is not None and watching()
    collector.update(0)
    for t in threading.enumerate():
        if t.name == "treadle-gc-watch":
            t.join(timeout=30)
    assert not watching()


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")  # 3.12+: fork with threads
def test_a_child_forked_while_raised_starts_from_the_programs_thresholds() -> None:
    collector = BusyCollector(threshold=DEFAULT_BUSY_THRESHOLD)
    collector.update(BUSY_PASSES)
    assert gc.get_threshold() == (DEFAULT_BUSY_THRESHOLD, 10, BUSY_FULL_THRESHOLD)
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: none of the parent's passes run here
            os.write(write, repr(gc.get_threshold()).encode())
            os._exit(0)
        os.close(write)
        seen = os.read(read, 100)
        os.close(read)
        os.waitpid(pid, 0)
        assert seen == b"(700, 10, 10)"
    finally:
        collector.update(0)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_programs_own_third_threshold_stays_while_busy() -> None:
    gc.set_threshold(700, 10, 2)  # frequent full collections, asked for by the program
    collector = BusyCollector(threshold=DEFAULT_BUSY_THRESHOLD)
    collector.update(BUSY_PASSES)
    assert gc.get_threshold() == (DEFAULT_BUSY_THRESHOLD, 10, 2)
    collector.update(0)
    assert gc.get_threshold() == (700, 10, 2)
    gc.set_threshold(700, 10, 10)
