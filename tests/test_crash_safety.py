"""Crash safety: a persisted pass killed with SIGKILL at random points always resumes.

Each trial starts a pass in a subprocess (two tools per round, one idempotent, both sleeping a
little so kills land before, during and after tool runs), waits until the file has its header,
sleeps a seeded random time and SIGKILLs it. The file must load with `closed=False`, end on a
complete line, and resuming it must finish with a valid transcript: every tool call answered once,
a call cut off mid-run reported as `unknown_outcome` unless its tool is idempotent (then re-run).
`make test` runs a few trials; `make soak` runs `CRASH_TRIALS` (50) of them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from treadle import run_session_loop, tool
from treadle.persist import load_session
from treadle.testing import ScriptedExecutor

QUICK_TRIALS = 6
"""Trials in `make test`."""
CRASH_TRIALS = 50
"""Trials in `make soak`."""
SEED = 20240610

CHILD = """
import sys, time
from treadle import Session, run_session_loop, tool
from treadle.testing import ScriptedExecutor
from treadle.testing.scripted import tool_calls

@tool
def slow(i: int) -> int:
    '''Not idempotent: a crash mid-run leaves its outcome unknown.'''
    time.sleep(0.03)
    return i

@tool(idempotent=True)
def again(i: int) -> int:
    '''Idempotent: safe to run again after a crash.'''
    time.sleep(0.02)
    return i

# A callable step: fresh call ids every round, as a real model gives.
ex = ScriptedExecutor(default=lambda request: tool_calls([("slow", {"i": 1}), ("again", {"i": 2})]))
out = run_session_loop(Session.from_user_message("go"), Session.from_agent_prompt("s"),
                       executor=ex, tools=[slow, again], persist_path=sys.argv[1],
                       max_tool_rounds=100_000)
out.synchronize()
"""


@tool
def slow(i: int) -> int:
    """Not idempotent."""
    return i


@tool(idempotent=True)
def again(i: int) -> int:
    """Idempotent."""
    return i


@dataclass
class Trial:
    """What one kill left behind and how the resume went."""

    delay: float
    rows: int
    pending: int
    outcomes: Counter[str]


def _kill_at(file: Path, delay: float) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen([sys.executable, "-c", CHILD, str(file)], env=env) as proc:
        try:
            deadline = time.monotonic() + 60  # a bound on waiting for the header, not a timing test
            while time.monotonic() < deadline:
                if file.exists() and file.read_bytes().count(b"\n") >= 2:
                    break  # header and the user row are on disk: the pass is running
                time.sleep(0.005)
            time.sleep(delay)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def check_resume(file: Path) -> Trial:
    """Load a killed pass's file, resume it and check the transcript; returns the figures."""
    raw = file.read_bytes()
    assert raw.endswith(b"\n"), "the file ends with a torn line"
    for line in raw.splitlines():
        json.loads(line)
    loaded = load_session(file)
    assert not loaded.closed and loaded.stop_reason is None
    pending = set(loaded.pending_intents)
    resumed = run_session_loop(
        loaded.session, loaded.agent, executor=ScriptedExecutor(["finished"]), tools=[slow, again]
    )
    assert resumed.stop_reason == "final_answer" and resumed.final_text == "finished"
    rows = resumed.rows
    outcomes: Counter[str] = Counter()
    answered: list[str] = []
    for i, row in enumerate(rows):
        if row.kind == "tool_result":
            answered.append(row.payload["tool_call_id"])
        if row.kind != "assistant" or not row.tool_calls:
            continue
        ids = [c["id"] for c in row.tool_calls]
        results = rows[i + 1 : i + 1 + len(ids)]
        assert [r.payload.get("tool_call_id") for r in results] == ids
        for call, result in zip(row.tool_calls, results, strict=True):
            body = json.loads(result.payload["content"])
            if call["id"] in pending and call["function"]["name"] == "slow":
                assert body["error_kind"] == "unknown_outcome"
                outcomes["unknown_outcome"] += 1
            elif call["id"] in pending:
                assert body == {"ok": True, "result": 2}
                outcomes["idempotent_rerun"] += 1
            else:
                assert body["ok"] is True
    assert len(answered) == len(set(answered))
    return Trial(0.0, len(loaded.session.rows), len(pending), outcomes)


def run_trials(directory: Path, trials: int, seed: int = SEED) -> list[Trial]:
    """Kill `trials` passes at seeded random points and check each resume."""
    rng = random.Random(seed)
    delays = [rng.uniform(0.0, 0.6) for _ in range(trials)]
    files = [directory / f"trial-{n}.jsonl" for n in range(trials)]
    # A few children at a time: interpreter start-up dominates, and overlap keeps it short.
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(_kill_at, files, delays))
    out = []
    for file, delay in zip(files, delays, strict=True):
        trial = check_resume(file)
        trial.delay = delay
        out.append(trial)
    return out


def summary(trials: list[Trial]) -> str:
    """One line of figures for docs/reliability.md."""
    total: Counter[str] = Counter()
    for t in trials:
        total.update(t.outcomes)
    mid_tool = sum(1 for t in trials if t.pending)
    rows = sorted(t.rows for t in trials)
    return (
        f"{len(trials)} kills: all loaded unclosed and resumed to final_answer; "
        f"{mid_tool} landed mid-tool ({total['unknown_outcome']} unknown_outcome, "
        f"{total['idempotent_rerun']} idempotent re-runs); rows on disk {rows[0]}..{rows[-1]}"
    )


@pytest.mark.slow  # a soak in miniature: `make test-slow`
def test_random_sigkills_leave_resumable_files(tmp_path: Path) -> None:
    trials = run_trials(tmp_path, QUICK_TRIALS)
    print(summary(trials))
    assert len(trials) == QUICK_TRIALS


def test_a_resumed_file_is_itself_crash_safe(tmp_path: Path) -> None:
    # Resume with persistence too, then load the new file: it is closed and complete.
    file = tmp_path / "first.jsonl"
    _kill_at(file, 0.2)
    loaded = load_session(file)
    second = tmp_path / "second.jsonl"
    out = run_session_loop(
        loaded.session,
        loaded.agent,
        executor=ScriptedExecutor(["finished"]),
        tools=[slow, again],
        persist_path=second,
    )
    assert out.stop_reason == "final_answer"
    again_loaded = load_session(second)
    assert again_loaded.closed and again_loaded.stop_reason == "final_answer"
    assert again_loaded.pending_intents == ()
    assert again_loaded.session.chunk_table.kinds() == out.chunk_table.kinds()
