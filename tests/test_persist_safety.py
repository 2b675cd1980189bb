"""What a pass produced survives: one writer per file, results written as they finish, in-memory
cancel recorded like a crash, approvals across a reload, torn versus damaged lines, fsync points.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from treadle import PersistenceError, Session
from treadle.loop import run_session_loop
from treadle.persist import load_session
from treadle.testing.scripted import ScriptedExecutor, tool_call, tool_calls
from treadle.tools import tool

AGENT = Session.from_agent_prompt("Do as asked.")
HANG_GUARD = 30.0


class Gate:
    """A tool that signals it started and then waits (on the event loop) until released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.runs = 0

    async def wait(self) -> None:
        self.runs += 1
        self.started.set()
        while not self.release.is_set():
            await asyncio.sleep(0.005)


def _lines(file: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in file.read_bytes().splitlines()]


def test_second_writer_fails_at_once_and_the_first_file_stays_intact(tmp_path: Path) -> None:
    file = tmp_path / "one.jsonl"
    gate = Gate()

    @tool
    async def slow() -> str:
        """Waits for the test."""
        await gate.wait()
        return "slow done"

    first = run_session_loop(
        Session.from_user_message("first"),
        AGENT,
        executor=ScriptedExecutor([tool_call("slow", {}, id="s1"), "first done"]),
        tools=[slow],
        persist_path=file,
    )
    assert gate.started.wait(HANG_GUARD)
    second = run_session_loop(
        Session.from_user_message("second"),
        AGENT,
        executor=ScriptedExecutor(["second done"]),
        persist_path=file,
    )
    with pytest.raises(PersistenceError, match="another pass"):
        second.synchronize(timeout=HANG_GUARD)
    gate.release.set()
    assert first.synchronize(timeout=HANG_GUARD).stop_reason == "final_answer"
    loaded = load_session(file)
    assert loaded.closed and loaded.stop_reason == "final_answer"
    assert loaded.session.to_messages() == first.to_messages()


def test_each_tool_result_is_written_as_it_finishes(tmp_path: Path) -> None:
    file = tmp_path / "r.jsonl"
    gate = Gate()

    @tool
    async def slow() -> str:
        """Waits for the test."""
        await gate.wait()
        return "late"

    @tool
    def quick() -> str:
        """Returns at once."""
        return "early"

    out = run_session_loop(
        Session.from_user_message("go"),
        AGENT,
        executor=ScriptedExecutor(
            [tool_calls([("slow", {}), ("quick", {})], ids=["a", "b"]), "ok"]
        ),
        tools=[slow, quick],
        persist_path=file,
    )
    assert gate.started.wait(HANG_GUARD)
    # The quick result is on disk while the slow call of the same round still runs.
    for _ in range(int(HANG_GUARD / 0.01)):
        results = [o for o in _lines(file) if o.get("kind") == "tool_result"]
        if results:
            break
        threading.Event().wait(0.01)
    assert [r["payload"]["tool_call_id"] for r in results] == ["b"]
    gate.release.set()
    done = out.synchronize(timeout=HANG_GUARD)
    # the file lists results as they finished; the transcript (and a reload) in call order
    ids = [o["payload"]["tool_call_id"] for o in _lines(file) if o.get("kind") == "tool_result"]
    assert ids == ["b", "a"]
    assert [r.payload.get("tool_call_id") for r in done.rows[2:4]] == ["a", "b"]
    assert load_session(file).session.to_messages() == done.to_messages()


def test_in_memory_cancel_records_interrupted_calls_as_unknown_outcome() -> None:
    gate = Gate()
    charges: list[int] = []
    noted: list[str] = []

    @tool
    async def charge_card(cents: int) -> str:
        """Charges a card: not idempotent."""
        charges.append(cents)
        while not noted:  # the other call of the round has finished before the test cancels
            await asyncio.sleep(0.005)
        await asyncio.sleep(0)
        await gate.wait()
        return "charged"

    @tool
    async def note(text: str) -> str:
        """Writes a note."""
        noted.append(text)
        return text

    calls = tool_calls([("charge_card", {"cents": 500}), ("note", {"text": "hi"})], ids=["c", "n"])
    out = run_session_loop(
        Session.from_user_message("pay"),
        AGENT,
        executor=ScriptedExecutor([calls]),
        tools=[charge_card, note],
    )
    assert gate.started.wait(HANG_GUARD)
    out.cancel()
    cancelled = out.synchronize(timeout=HANG_GUARD)
    assert cancelled.stop_reason == "cancelled"
    assert cancelled.metadata["unknown_outcome_tool_calls"] == ["c"]
    # the finished result is kept; the interrupted one is not pretended
    assert [r.payload.get("tool_call_id") for r in cancelled.rows if r.kind == "tool_result"] == [
        "n"
    ]
    resumed = run_session_loop(
        cancelled, AGENT, executor=ScriptedExecutor(["done"]), tools=[charge_card, note]
    ).synchronize(timeout=HANG_GUARD)
    assert charges == [500]  # the card was not charged twice
    results = {r.payload["tool_call_id"]: r for r in resumed.rows if r.kind == "tool_result"}
    assert json.loads(results["c"].payload["content"])["error_kind"] == "unknown_outcome"
    assert [r.payload.get("tool_call_id") for r in resumed.rows[2:4]] == ["c", "n"]
    assert resumed.stop_reason == "final_answer"


def test_pending_approvals_survive_a_reload(tmp_path: Path) -> None:
    file = tmp_path / "a.jsonl"

    @tool(needs_approval=True)
    def deploy(target: str) -> str:
        """Deploys."""
        return f"deployed {target}"

    out = run_session_loop(
        Session.from_user_message("ship it"),
        AGENT,
        executor=ScriptedExecutor([tool_call("deploy", {"target": "prod"}, id="d1")]),
        tools=[deploy],
        persist_path=file,
    ).synchronize(timeout=HANG_GUARD)
    assert out.stop_reason == "interrupted"
    loaded = load_session(file)
    assert loaded.session.pending_approvals == out.pending_approvals
    assert loaded.session.pending_approvals[0]["id"] == "d1"
    assert loaded.session.interrupt_reason == out.interrupt_reason
    resumed = run_session_loop(
        loaded.session,
        loaded.agent,
        executor=ScriptedExecutor(["shipped"]),
        tools=[deploy],
        approvals={"d1": True},
    ).synchronize(timeout=HANG_GUARD)
    assert resumed.final_text == "shipped"
    assert "deployed prod" in resumed.rows[-2].payload["content"]


def _finished_file(tmp_path: Path) -> Path:
    file = tmp_path / "t.jsonl"
    run_session_loop(
        Session.from_user_message("x"), AGENT, executor=ScriptedExecutor(["y"]), persist_path=file
    ).synchronize(timeout=HANG_GUARD)
    return file


def test_only_a_final_segment_without_newline_is_torn(tmp_path: Path) -> None:
    file = _finished_file(tmp_path)
    file.write_bytes(file.read_bytes() + b'{"type": "row", "ki')
    loaded = load_session(file)
    assert loaded.closed and loaded.stop_reason == "final_answer"


def test_a_complete_invalid_last_line_is_damage_not_a_crash(tmp_path: Path) -> None:
    file = _finished_file(tmp_path)
    lines = file.read_bytes().splitlines(keepends=True)
    file.write_bytes(b"".join(lines[:-1]) + b'{"type": "trailer", "rows": 2, "usa\n')
    with pytest.raises(PersistenceError, match=r"line 4 is not valid JSON; the file is damaged"):
        load_session(file)


def test_fsync_at_every_turn_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "f.jsonl"
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        real_fsync(fd)  # the real call on the real descriptor; we only note what it covered
        if os.path.realpath(f"/proc/self/fd/{fd}") == str(file.resolve()):
            last = json.loads(file.read_bytes().splitlines()[-1])
            synced.append(last["type"] + (f":{last['kind']}" if "kind" in last else ""))

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc to name a descriptor's file")
    monkeypatch.setattr(os, "fsync", counting_fsync)

    @tool
    def note(text: str) -> str:
        """Writes a note."""
        return text

    run_session_loop(
        Session.from_user_message("go"),
        AGENT,
        executor=ScriptedExecutor([tool_call("note", {"text": "a"}), "done"]),
        tools=[note],
        persist_path=file,
    ).synchronize(timeout=HANG_GUARD)
    # input rows, the intent before the tool runs, its result, the final answer, the trailer
    assert synced == ["row:user", "intent", "row:tool_result", "row:assistant", "trailer"]
    assert [o["type"] for o in _lines(file)][-1] == "trailer"
