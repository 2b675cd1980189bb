"""Long reliability runs (`make soak`): 10,000 concurrent passes, a continuous fan-out soak and
50 random SIGKILLs. The soak's length is `TREADLE_SOAK_SECONDS` (default 600); each prints the
figures recorded in docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from test_crash_safety import CRASH_TRIALS, run_trials, summary
from test_load import fake_server_process, fan_out, rss_mb
from treadle.runtime import get_runtime

pytestmark = pytest.mark.soak

SOAK_SECONDS = float(os.environ.get("TREADLE_SOAK_SECONDS", "600"))
"""How long the continuous fan-out runs."""
BATCH = int(os.environ.get("TREADLE_SOAK_BATCH", "500"))
"""Concurrent passes per wave of the soak."""


def _runtime_tasks() -> int:
    async def count() -> int:
        return len(asyncio.all_tasks()) - 1

    return asyncio.run_coroutine_threadsafe(count(), get_runtime().loop).result(30)


def test_ten_thousand_concurrent_passes() -> None:
    with fake_server_process() as url:
        fan_out(url, 100, prefix="warm")
        figures = fan_out(url, 10_000)
    print("\n" + figures.line())
    assert figures.errors == 0
    assert get_runtime().pending == 0
    assert figures.fds_after <= figures.fds_before + 5


# The suite-wide pytest-timeout (300 s) is for ordinary tests; the soak runs as long as it is told.
@pytest.mark.timeout(SOAK_SECONDS + 300)
def test_continuous_fan_out_does_not_grow() -> None:
    # Compare the first and last window (a minute, or a quarter of a shorter run) of waves.
    window = min(60.0, SOAK_SECONDS / 4)
    samples: list[tuple[float, float, int, int]] = []  # (elapsed, rss, tasks, fds)
    errors = waves = 0
    with fake_server_process() as url:
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < SOAK_SECONDS:
            figures = fan_out(url, BATCH, prefix=f"wave {waves}", close=False)  # pool stays open
            errors += figures.errors
            waves += 1
            samples.append((elapsed, rss_mb(), _runtime_tasks(), figures.fds_peak))
    first = [s for s in samples if s[0] <= window]
    last = [s for s in samples if s[0] >= SOAK_SECONDS - window]

    def peak(rows: list[tuple[float, float, int, int]], i: int) -> float:
        return max(r[i] for r in rows)

    print(
        f"\nsoak {SOAK_SECONDS:.0f} s, {waves} waves x {BATCH} passes, {errors} errors; "
        f"first/last {window:.0f} s window peaks: "
        f"RSS {peak(first, 1):.0f}/{peak(last, 1):.0f} MiB, "
        f"runtime tasks {peak(first, 2):.0f}/{peak(last, 2):.0f}, "
        f"fds {peak(first, 3):.0f}/{peak(last, 3):.0f}"
    )
    assert errors == 0
    assert peak(last, 1) <= peak(first, 1) * 1.1 + 20  # MiB: allocator noise, no growth
    assert peak(last, 2) <= peak(first, 2)
    assert peak(last, 3) <= peak(first, 3) + 5


def test_fifty_random_sigkills(tmp_path: Path) -> None:
    trials = run_trials(tmp_path, CRASH_TRIALS)
    print("\n" + summary(trials))
    assert len(trials) == CRASH_TRIALS
