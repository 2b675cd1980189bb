"""JSONL persistence: header/rows/trailer, file mode, torn lines, crashes, resume."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treadle import PersistenceError, Session
from treadle.loop import run_session_loop
from treadle.persist import load_session
from treadle.testing.scripted import ScriptedExecutor, text, tool_call
from treadle.tools import tool

AGENT = Session.from_agent_prompt("system prompt")


@tool(idempotent=True)
def twice(x: int) -> int:
    """Double x."""
    return 2 * x


@tool
def launch(x: int) -> str:
    """A side effect that must not repeat."""
    return f"launched {x}"


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_round_trip(tmp_path: Path) -> None:
    ex = ScriptedExecutor([tool_call("twice", {"x": 21}), text("42")])
    out = run_session_loop(
        Session.from_user_message("double 21"),
        AGENT,
        executor=ex,
        tools=[twice],
        persist_path=tmp_path,
    )
    path = tmp_path / f"{out.id}.jsonl"
    assert out.metadata["path"] == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    lines = _lines(path)
    assert lines[0]["type"] == "header" and lines[0]["schema"] == 1
    assert lines[0]["agent_rows"] == [{"role": "system", "content": "system prompt"}]
    assert [x["type"] for x in lines[1:]] == ["row", "row", "intent", "row", "row", "trailer"]
    assert lines[-1]["stop_reason"] == "final_answer" and lines[-1]["rows"] == 4
    loaded = load_session(path)
    assert loaded.closed and loaded.stop_reason == "final_answer"
    assert loaded.session.chunk_table == out.chunk_table
    assert loaded.session.usage == out.usage
    assert loaded.agent.chunk_table == AGENT.chunk_table
    assert loaded.session.id == out.id  # the id the pass gave its output survives the reload
    assert Session.load(path).chunk_table == out.chunk_table
    assert Session.load(path).metadata["closed"] is True
    # the loaded session continues the conversation
    nxt = run_session_loop(
        loaded.session.add_user_message("again"), loaded.agent, executor=ScriptedExecutor(["84"])
    )
    assert nxt.final_text == "84"


def test_default_location_is_under_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = run_session_loop(
        Session.from_user_message("x"), AGENT, executor=ScriptedExecutor(["y"]), persist=True
    )
    assert out.stop_reason == "final_answer"
    assert (tmp_path / ".treadle" / "sessions" / f"{out.id}.jsonl").exists()


def test_a_failed_pass_leaves_no_trailer(tmp_path: Path) -> None:
    file = tmp_path / "s.jsonl"
    ex = ScriptedExecutor([tool_call("twice", {"x": 1}), RuntimeError("provider died")])
    out = run_session_loop(
        Session.from_user_message("x"), AGENT, executor=ex, tools=[twice], persist_path=file
    )
    with pytest.raises(RuntimeError):
        out.synchronize()
    loaded = load_session(file)
    assert not loaded.closed
    assert loaded.session.chunk_table.kinds() == ["user", "assistant", "tool_result"]
    resumed = run_session_loop(loaded.session, loaded.agent, executor=ScriptedExecutor(["2"]))
    assert resumed.final_text == "2"


def test_torn_last_line_is_ignored(tmp_path: Path) -> None:
    file = tmp_path / "s.jsonl"
    run_session_loop(
        Session.from_user_message("x"), AGENT, executor=ScriptedExecutor(["y"]), persist_path=file
    ).synchronize()
    data = file.read_bytes().splitlines(keepends=True)
    file.write_bytes(b"".join(data[:-1]) + data[-1][: len(data[-1]) // 2])
    loaded = load_session(file)
    assert not loaded.closed
    assert loaded.session.chunk_table.kinds() == ["user", "assistant"]


def test_bad_files_raise_persistence_errors(tmp_path: Path) -> None:
    with pytest.raises(PersistenceError, match="cannot read"):
        load_session(tmp_path / "missing.jsonl")
    (tmp_path / "junk.jsonl").write_text('{"type": "row"}\n')
    with pytest.raises(PersistenceError, match="no header"):
        load_session(tmp_path / "junk.jsonl")


def test_crash_mid_tool_then_resume_respects_idempotency(tmp_path: Path) -> None:
    # A file as a crash leaves it: intents recorded, no results, no trailer.
    file = tmp_path / "crashed.jsonl"
    ex = ScriptedExecutor([tool_call("twice", {"x": 1}, id="a"), RuntimeError("stop")])
    failed = run_session_loop(
        Session.from_user_message("x"), AGENT, executor=ex, tools=[twice], persist_path=file
    )
    with pytest.raises(RuntimeError):
        failed.synchronize()
    header, user_row, assistant = file.read_text().splitlines()[:3]
    calls = [
        {"id": "i1", "type": "function", "function": {"name": "twice", "arguments": '{"x": 4}'}},
        {"id": "n1", "type": "function", "function": {"name": "launch", "arguments": '{"x": 4}'}},
    ]
    crash = [
        header,
        user_row,
        json.dumps(
            {"type": "row", "kind": "assistant", "payload": {"content": None, "tool_calls": calls}}
        ),
        json.dumps({"type": "intent", "tool_call_id": "i1", "name": "twice"}),
        json.dumps({"type": "intent", "tool_call_id": "n1", "name": "launch"}),
    ]
    file.write_text("\n".join(crash) + "\n")
    del assistant
    loaded = load_session(file)
    assert loaded.pending_intents == ("i1", "n1")
    out = run_session_loop(
        loaded.session, loaded.agent, executor=ScriptedExecutor(["done"]), tools=[twice, launch]
    )
    results = [json.loads(r.payload["content"]) for r in out.rows if r.kind == "tool_result"]
    assert results[0] == {"ok": True, "result": 8}  # idempotent: run again
    assert results[1]["error_kind"] == "unknown_outcome"  # not silently re-run
    assert out.final_text == "done"


CRASH_SCRIPT = """
import sys, time
from treadle import Session
from treadle.loop import run_session_loop
from treadle.testing.scripted import ScriptedExecutor, tool_call
from treadle.tools import tool

@tool
def slow(i: int) -> int:
    '''Sleep a little.'''
    time.sleep(0.05)
    return i

ex = ScriptedExecutor(default=tool_call("slow", {"i": 1}))
out = run_session_loop(Session.from_user_message("go"), Session.from_agent_prompt("s"),
                       executor=ex, tools=[slow], persist_path=sys.argv[1], max_tool_rounds=10_000)
print("started", flush=True)
out.synchronize()
"""


def test_sigkill_mid_pass_leaves_a_loadable_unclosed_file(tmp_path: Path) -> None:
    file = tmp_path / "killed.jsonl"
    with subprocess.Popen(
        [sys.executable, "-c", CRASH_SCRIPT, str(file)], stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
            deadline = time.monotonic() + 60  # a bound on waiting, not a timing assertion
            while time.monotonic() < deadline:
                if file.exists() and file.read_text().count('"tool_result"') >= 3:
                    break
                time.sleep(0.05)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    loaded = load_session(file)
    assert not loaded.closed
    kinds = loaded.session.chunk_table.kinds()
    assert kinds[0] == "user" and kinds.count("tool_result") >= 3
    resumed = run_session_loop(
        loaded.session,
        loaded.agent,
        executor=ScriptedExecutor(["finished"]),
        tools=[twice, launch],
    )
    assert resumed.stop_reason == "final_answer"
    assert resumed.chunk_table.kinds()[-1] == "assistant"
