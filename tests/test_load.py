"""Load: thousands of concurrent passes with tool rounds against a 50 ms fake server.

The server runs in its own process (`python -m treadle.testing.fake_server`), so the file
descriptors and memory measured here are the client's alone. Bounds are generous resource
ceilings, not timings. `make test` runs 2,000 passes; `tests/soak/` runs 10,000 and the long
fan-out soak with the same helpers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from treadle import Provider, Session, run_session_loop, tool
from treadle.llm.client import close_all_clients_for_loop
from treadle.runtime import get_runtime

AGENT = Session.from_agent_prompt("Call noop, then answer.")
LATENCY_MS = 50
ROUNDS = 2


@tool
def noop(round: int) -> int:
    """Do nothing and say which round it was."""
    return round


def fd_count() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    """Resident memory of this process, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@contextmanager
def fake_server_process(latency_ms: float = LATENCY_MS, rounds: int = ROUNDS) -> Iterator[str]:
    """A fake server in a subprocess running `tool_loop`; yields its base URL."""
    cmd = [
        sys.executable,
        "-m",
        "treadle.testing.fake_server",
        "--latency-ms",
        str(latency_ms),
        "--script",
        "tool_loop",
        "--rounds",
        str(rounds),
    ]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            yield proc.stdout.readline().strip()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            proc.stdout.close() if proc.stdout else None


@dataclass
class LoadFigures:
    """What one fan-out measured."""

    passes: int
    seconds: float
    fds_before: int
    fds_peak: int
    fds_after: int
    rss_before_mb: float
    rss_peak_mb: float
    errors: int

    def line(self) -> str:
        """One line for docs/reliability.md."""
        return (
            f"{self.passes} passes x {ROUNDS} tool rounds at {LATENCY_MS} ms: "
            f"{self.seconds:.1f} s, {self.errors} errors, fds {self.fds_before} -> peak "
            f"{self.fds_peak} -> {self.fds_after}, RSS {self.rss_before_mb:.0f} -> peak "
            f"{self.rss_peak_mb:.0f} MiB"
        )


class _Sampler(threading.Thread):
    """Samples fds and RSS every few milliseconds while a fan-out runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.fds = 0
        self.rss = 0.0

    def run(self) -> None:
        while not self.stop.is_set():
            self.fds = max(self.fds, fd_count())
            self.rss = max(self.rss, rss_mb())
            self.stop.wait(0.02)


def fan_out(base_url: str, passes: int, *, prefix: str = "task", close: bool = True) -> LoadFigures:
    """Run `passes` concurrent passes; every one must end with a final answer.

    With `close`, the pooled connections are closed afterwards (to measure what is left).
    """
    provider = Provider(model="fake", base_url=base_url, api_key="sk-load")
    fds_before, rss_before = fd_count(), rss_mb()
    sampler = _Sampler()
    sampler.start()
    started = time.monotonic()
    outs = [
        run_session_loop(
            Session.from_user_message(f"{prefix} {i}"), AGENT, agent_provider=provider, tools=[noop]
        )
        for i in range(passes)
    ]
    errors = 0
    for out in outs:
        try:
            ok = out.stop_reason == "final_answer" and len(out.rows) == 2 + 2 * ROUNDS
        except Exception:
            ok = False
        errors += not ok
    seconds = time.monotonic() - started
    sampler.stop.set()
    sampler.join()
    del outs
    if close:
        close_all_clients_for_loop(get_runtime().loop)
    return LoadFigures(
        passes, seconds, fds_before, sampler.fds, fd_count(), rss_before, sampler.rss, errors
    )


@pytest.mark.slow  # a load test, 2,000 passes: `make test-slow`
def test_two_thousand_concurrent_passes_with_tool_rounds() -> None:
    with fake_server_process() as url:
        fan_out(url, 50, prefix="warm")  # runtime, pools and threads exist before measuring
        figures = fan_out(url, 2_000)
    print(figures.line())
    assert figures.errors == 0
    assert get_runtime().pending == 0
    # One pooled connection per in-flight request at most, plus a little slack.
    assert figures.fds_peak - figures.fds_before <= 2_000 + 50
    assert figures.fds_after <= figures.fds_before + 5
    assert figures.rss_peak_mb - figures.rss_before_mb < 500
