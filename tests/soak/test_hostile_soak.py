"""The hostile soak (`make soak`): 5% hostile passes beside bystanders for `TREADLE_SOAK_SECONDS`.

Waves of 200 passes run on the one background runtime; 10 of each wave are hostile (a tool that
exits like argparse, an async tool calling `sys.exit`, `KeyboardInterrupt` from `on_message`,
`SystemExit` from a guardrail, a sync tool ignoring its timeout, 80 nested sync sub-agents that
each read their pass). Every bystander transcript must equal the one of a quiet run, and RSS,
threads and file descriptors must be flat between the first and the last window (a minute, or a
quarter of a shorter run). Prints the figures recorded in docs/reliability.md.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from test_isolation import (
    AGENT,
    HANG_GUARD,
    _bystander_script,
    _raise_exit,
    _raise_interrupt,
    add,
    async_exit,
    delegate,
    parse_cli,
)
from test_load import fd_count, rss_mb
from treadle import Session
from treadle.errors import SessionFailedError
from treadle.loop import Guardrail, Limits, run_session_loop
from treadle.runtime import get_runtime, stats
from treadle.testing.scripted import ScriptedExecutor, tool_call, tool_calls
from treadle.tools import tool

pytestmark = pytest.mark.soak

SOAK_SECONDS = float(os.environ.get("TREADLE_SOAK_SECONDS", "600"))
WAVE = 200
HOSTILE_PER_WAVE = WAVE // 20  # 5%


@tool
def sleepy() -> str:
    """Ignores its 0.1 s timeout: sleeps 1 s on its thread (abandoned, then returns)."""
    time.sleep(1)
    return "late"


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


class _Peaks(threading.Thread):
    """Samples RSS, threads and fds every 20 ms while a wave runs; keeps the peaks."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.done = threading.Event()
        self.rss, self.threads, self.fds = 0.0, 0, 0

    def run(self) -> None:
        while not self.done.is_set():
            self.rss = max(self.rss, rss_mb())
            self.threads = max(self.threads, _threads())
            self.fds = max(self.fds, fd_count())
            self.done.wait(0.02)


def _tool_pass(call: dict[str, Any], tools: list[Any], **options: Any) -> Session:
    return run_session_loop(
        Session.from_user_message("go"),
        AGENT,
        executor=ScriptedExecutor([call, "done"]),
        tools=tools,
        **options,
    )


def _expect_tool_error(kind: str) -> Callable[[Session], bool]:
    def check(out: Session) -> bool:
        return kind in str(out.synchronize(HANG_GUARD).rows[-2].content)

    return check


def _expect_failure(out: Session) -> bool:
    try:
        out.synchronize(HANG_GUARD)
    except SessionFailedError:
        return True
    return False


def _nested_fan() -> Session:
    calls = [("delegate", {"i": i}) for i in range(80)]
    return _tool_pass(tool_calls(calls), [delegate])


HOSTILE: list[tuple[Callable[[], Session], Callable[[Session], bool]]] = [
    (
        lambda: _tool_pass(tool_call("parse_cli", {"args": "--n x"}), [parse_cli]),
        _expect_tool_error("tool_execution_exception"),
    ),
    (
        lambda: _tool_pass(tool_call("async_exit", {}), [async_exit]),
        _expect_tool_error("tool_execution_exception"),
    ),
    (
        lambda: run_session_loop(
            Session.from_user_message("go"),
            AGENT,
            executor=ScriptedExecutor(["hi"]),
            on_message=_raise_interrupt,
        ),
        _expect_failure,
    ),
    (
        lambda: run_session_loop(
            Session.from_user_message("go"),
            AGENT,
            executor=ScriptedExecutor(["hi"]),
            guardrails=[Guardrail(_raise_exit)],
        ),
        _expect_failure,
    ),
    (
        lambda: _tool_pass(
            tool_call("sleepy", {}), [sleepy], limits=Limits(tool_timeout_seconds=0.1)
        ),
        _expect_tool_error("timeout"),
    ),
    (_nested_fan, lambda out: out.synchronize(HANG_GUARD).final_text == "done"),
]


def _bystander(i: int, directory: Path | None) -> Session:
    return run_session_loop(
        Session.from_user_message(f"add {i}"),
        AGENT,
        executor=_bystander_script(i),
        tools=[add],
        persist_path=directory,
    )


def _wave(number: int, directory: Path) -> tuple[list[Session], list[tuple[Session, Any]]]:
    bystanders: list[Session] = []
    hostile: list[tuple[Session, Any]] = []
    every = WAVE // HOSTILE_PER_WAVE
    for i in range(WAVE - HOSTILE_PER_WAVE):
        if i % (every - 1) == 0 and len(hostile) < HOSTILE_PER_WAVE:
            start, check = HOSTILE[(number * HOSTILE_PER_WAVE + len(hostile)) % len(HOSTILE)]
            hostile.append((start(), check))
        bystanders.append(_bystander(i, directory if i % 2 == 0 else None))
    return bystanders, hostile


# The suite-wide pytest-timeout (300 s) is for ordinary tests; the soak runs as long as it is told.
@pytest.mark.timeout(SOAK_SECONDS + 300)
def test_hostile_soak(tmp_path: Path) -> None:
    quiet = [
        _bystander(i, None).synchronize(HANG_GUARD).to_messages()
        for i in range(WAVE - HOSTILE_PER_WAVE)
    ]
    runtime = get_runtime()
    window = min(60.0, SOAK_SECONDS / 4)
    samples: list[tuple[float, float, int, int]] = []  # (elapsed, rss, threads, fds)
    errors = unexpected = waves = hostile_runs = 0
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < SOAK_SECONDS:
        directory = tmp_path / f"wave{waves}"
        peaks = _Peaks()
        peaks.start()
        bystanders, hostile = _wave(waves, directory)
        for out, expected in zip(bystanders, quiet, strict=True):
            try:
                if out.synchronize(HANG_GUARD).to_messages() != expected:
                    errors += 1
            except Exception:
                errors += 1
        for out, check in hostile:
            hostile_runs += 1
            if not check(out):
                unexpected += 1
        peaks.done.set()
        peaks.join()
        shutil.rmtree(directory, ignore_errors=True)
        waves += 1
        samples.append((elapsed, peaks.rss, peaks.threads, peaks.fds))
    first = [s for s in samples if s[0] <= window]
    last = [s for s in samples if s[0] >= SOAK_SECONDS - window]

    def peak(rows: list[tuple[float, float, int, int]], i: int) -> float:
        return max(r[i] for r in rows)

    counters = stats()
    print(
        f"\nhostile soak {SOAK_SECONDS:.0f} s, {waves} waves x {WAVE} passes "
        f"({hostile_runs} hostile, {waves * (WAVE - HOSTILE_PER_WAVE)} bystanders), "
        f"{errors} bystander errors, {unexpected} unexpected hostile outcomes; "
        f"first/last {window:.0f} s window peaks: RSS {peak(first, 1):.0f}/{peak(last, 1):.0f} "
        f"MiB, threads {peak(first, 2):.0f}/{peak(last, 2):.0f}, "
        f"fds {peak(first, 3):.0f}/{peak(last, 3):.0f}; abandoned sync calls "
        f"{counters['abandoned_total']} (still running {counters['abandoned_running']})"
    )
    assert errors == 0
    assert unexpected == 0
    assert get_runtime() is runtime and runtime.alive
    assert peak(last, 1) <= peak(first, 1) * 1.1 + 20  # MiB: allocator noise, no growth
    assert peak(last, 2) <= peak(first, 2) + 16  # anyio prunes idle workers lazily
    assert peak(last, 3) <= peak(first, 3) + 5
