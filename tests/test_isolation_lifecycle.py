"""Separate fates, part two: a dying runtime, reads inside event loops, lazy derivation, calls
that raise, interpreter exit and fork (real interpreters), each tried with a hostile case.

Timeouts here are generous hang guards, never performance assertions.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from test_isolation import AGENT, HANG_GUARD
from treadle import RuntimeLoopError, SandboxError, Session, load_session
from treadle.errors import SessionFailedError
from treadle.loop import run_session_loop
from treadle.runtime import get_runtime
from treadle.testing.scripted import ScriptedExecutor


# -- a runtime that dies anyway ------------------------------------------------------------------
def _gated_reply(gate: threading.Event, reply: str) -> Callable[[Any], Any]:
    async def gated(_request: Any) -> str:
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return reply

    return gated


def test_a_dead_runtime_fails_what_was_pending_and_is_replaced() -> None:
    runtime = get_runtime()
    gate = threading.Event()
    pending = run_session_loop(
        Session.from_user_message("p"), AGENT, executor=ScriptedExecutor([_gated_reply(gate, "x")])
    )

    def die() -> None:
        raise SystemExit("killed outside any pass")

    runtime.loop.call_soon_threadsafe(die)  # nothing of Treadle's wraps a bare loop callback
    with pytest.raises(SessionFailedError, match="runtime thread died"):
        pending.synchronize(HANG_GUARD)
    fresh = get_runtime()
    assert fresh is not runtime and fresh.alive
    out = run_session_loop(Session.from_user_message("q"), AGENT, executor=ScriptedExecutor(["ok"]))
    assert out.synchronize(HANG_GUARD).final_text == "ok"
    gate.set()


# -- sync reads inside an event loop; lazy derivation ------------------------------------------
def test_a_sync_read_inside_a_running_event_loop_says_to_await() -> None:
    gate = threading.Event()

    async def main() -> str | None:
        out = run_session_loop(
            Session.from_user_message("p"),
            AGENT,
            executor=ScriptedExecutor([_gated_reply(gate, "x")]),
        )
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        beat = asyncio.create_task(heartbeat())
        for read in (lambda: out.final_text, lambda: out.rows, lambda: out.chunk_table):
            with pytest.raises(RuntimeLoopError, match="await"):
                read()
        await asyncio.sleep(0.05)
        gate.set()
        done = await out
        beat.cancel()
        assert ticks > 1  # the loop was never blocked
        return done.final_text  # a finished session reads without awaiting

    assert asyncio.run(main()) == "x"


def test_deriving_from_a_pending_session_returns_at_once() -> None:
    gate = threading.Event()
    first = run_session_loop(
        Session.from_user_message("start"),
        AGENT,
        executor=ScriptedExecutor([_gated_reply(gate, "one")]),
    )
    follow_up = first.add_user_message("and then?")
    appended = first.append(follow_up_row := Session.from_user_message("extra").rows[0])
    forked = first.fork()
    moved = first.to("local")
    second = run_session_loop(follow_up, AGENT, executor=ScriptedExecutor(["two"]))
    for lazy in (follow_up, appended, forked, moved, second):
        assert not lazy.done()
    assert follow_up.lineage.parent_ids == (first.id,)
    gate.set()
    contents = [m["content"] for m in second.synchronize(HANG_GUARD).to_messages()]
    assert contents == ["start", "one", "and then?", "two"]
    assert appended.rows[-1] == follow_up_row
    assert forked.rows == first.rows
    assert moved.placement == "local" and moved.rows == first.rows
    moved.close_sandbox()


def test_deriving_from_a_failing_pass_fails_on_every_read() -> None:
    gate = threading.Event()
    failing = _gated_reply(gate, "unused")

    async def fail_later(request: Any) -> BaseException:
        await failing(request)
        return RuntimeError("down")

    first = run_session_loop(
        Session.from_user_message("p"), AGENT, executor=ScriptedExecutor([fail_later])
    )
    derived = first.add_user_message("more")  # pending: derived lazily, fails with the pass
    assert not derived.done()
    gate.set()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="down"):
            derived.synchronize(HANG_GUARD)


# -- a call that raises leaves nothing behind ---------------------------------------------------
def test_a_pass_on_a_closed_sandbox_raises_at_the_call(tmp_path: Path) -> None:
    box = Session.from_user_message("x").to("local")
    sibling = box.fork()
    box.close_sandbox()
    sibling.close_sandbox()  # the last share: the sandbox is closed now
    ex = ScriptedExecutor(["never"])
    for user in (box, sibling):
        with pytest.raises(SandboxError, match="Nothing was started"):
            run_session_loop(user, AGENT, executor=ex, persist_path=tmp_path)
    time.sleep(0.05)  # anything submitted would have run by now
    assert ex.requests == []
    assert list(tmp_path.iterdir()) == []


# -- exit and fork: real interpreters ------------------------------------------------------------
def _python(script: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=cwd,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        check=False,
    )


EXIT_SCRIPT = """
    import time
    from treadle import Session
    from treadle.loop import run_session_loop
    from treadle.testing.scripted import ScriptedExecutor, tool_call

    user = Session.from_user_message("go").to("local")
    cmd = "touch running; sleep {seconds}; echo finished"
    shell = tool_call("run_shell_command", {{"cmd": cmd}}, id="c1")
    ex = ScriptedExecutor([shell, "done"])
    agent = Session.from_agent_prompt("a")
    out = run_session_loop(user, agent, executor=ex, persist_path="s.jsonl")
    workspace = user.require_sandbox().workspace
    print(workspace, flush=True)
    # The exit must come while the command runs: on a loaded machine the pass can take longer
    # than the drain time just to reach it (then nothing was recorded, nothing to cancel).
    started = time.monotonic()
    while not (workspace / "running").exists() and time.monotonic() - started < 60:
        time.sleep(0.01)
    # the interpreter exits here without reading `out`
"""


def _processes_running(marker: str) -> list[int]:

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_exit_drains_passes_before_sandboxes_close(tmp_path: Path) -> None:
    done = _python(EXIT_SCRIPT.format(seconds="0.7"), tmp_path, TREADLE_DRAIN_SECONDS="30")
    assert done.returncode == 0, done.stderr
    workspace = Path(done.stdout.strip())
    loaded = load_session(tmp_path / "s.jsonl", sandbox=False)
    assert loaded.closed and loaded.stop_reason == "final_answer"
    result = json.loads(loaded.session.rows[-2].payload["content"])
    assert result["exit_code"] == 0, result  # not -9: the command ran to its end
    assert result["stdout"].strip() == "finished"
    assert not workspace.exists()  # and then the sandbox was released


def test_exit_past_the_drain_time_cancels_cleanly(tmp_path: Path) -> None:
    # A duration of this run's own: the check below scans every process of the machine, where
    # other runs of this suite (xdist workers, other checkouts, CI jobs) may be in this test too.
    seconds = f"31.{secrets.randbelow(10**6):06d}"
    done = _python(EXIT_SCRIPT.format(seconds=seconds), tmp_path, TREADLE_DRAIN_SECONDS="0.5")
    assert done.returncode == 0, done.stderr
    loaded = load_session(tmp_path / "s.jsonl", sandbox=False)
    assert not loaded.closed  # no trailer: the pass did not end gracefully
    assert loaded.pending_intents == ("c1",)  # the intent was recorded before the tool ran
    assert _processes_running(f"sleep {seconds}") == []  # the cancelled command did not outlive it
    assert not Path(done.stdout.strip()).exists()


FORK_SCRIPT = """
    import asyncio, json, os, sys, time
    from treadle import RuntimeLoopError, SandboxError, Session, get_runtime
    from treadle.loop import run_session_loop
    from treadle.testing.scripted import ScriptedExecutor

    box = Session.from_user_message("x").to("local")
    sandbox = box.require_sandbox()
    command = get_runtime().submit(sandbox.run_command("sleep 0.8; echo survived > out.txt"))

    async def slow(_request):
        await asyncio.sleep(0.8)
        return "parent done"

    pending = run_session_loop(
        Session.from_user_message("p"), Session.from_agent_prompt("a"),
        executor=ScriptedExecutor([slow]),
    )
    time.sleep(0.2)
    pid = os.fork()
    if pid == 0:
        code = 0
        started = time.monotonic()
        try:
            pending.final_text
            code = 10
        except RuntimeLoopError as err:
            code = 0 if "fork" in str(err) and time.monotonic() - started < 5 else 11
        try:
            box.require_sandbox()
            code = 12
        except SandboxError:
            pass
        box.close_sandbox()  # the child's share: must not touch the parent's workspace
        sys.exit(code)  # a normal exit: exit hooks and finalizers run
    _, status = os.waitpid(pid, 0)
    result = command.result(30)
    print(json.dumps({
        "child": os.waitstatus_to_exitcode(status),
        "workspace": sandbox.workspace.exists(),
        "command": result.exit_code,
        "out": (sandbox.workspace / "out.txt").read_text().strip(),
        "pass": pending.final_text,
    }))
"""


def test_a_forked_child_never_touches_the_parents_sandbox_or_pending_passes(
    tmp_path: Path,
) -> None:
    done = _python(FORK_SCRIPT, tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "child": 0,
        "workspace": True,
        "command": 0,
        "out": "survived",
        "pass": "parent done",
    }
