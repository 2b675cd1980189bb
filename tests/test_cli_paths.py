"""Paths and arguments of `show`, `sessions` and `eval` checked before the heavy imports; eval
logs told apart from session transcripts; `eval compare` naming configuration changes; the
misplaced `--color`, the empty prompt and the eval log's busy/damaged fix lines. Every command
runs as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import _env, treadle
from test_cli_startup import HEAVY
from treadle.evals.log import LogHeader, SampleRecord

HEAVY_WITH_EVALS = (*HEAVY, "treadle.evals", "treadle.agents", "treadle.persist")

MISSING_PATHS = {
    "show": ["show", "nonexist.jsonl"],
    "sessions": ["sessions", "/nonexist"],
    "eval report": ["eval", "report", "nonexist.jsonl"],
    "eval compare": ["eval", "compare", "a.jsonl", "b.jsonl"],
    "eval": ["eval", "nonexist.jsonl", "--agent", "x:y"],
    "empty prompt": ["run", ""],
}


@pytest.mark.parametrize("words", MISSING_PATHS.values(), ids=list(MISSING_PATHS))
def test_missing_paths_print_before_the_heavy_imports(words: list[str], tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "from treadle.cli.app import main\n"
        f"code = main(['--color', 'always', *{words!r}])\n"
        f"heavy = {HEAVY_WITH_EVALS!r}\n"
        "loaded = sorted(m for m in sys.modules if m in heavy or m.split('.')[0] in heavy\n"
        "                or any(m.startswith(h + '.') for h in heavy))\n"
        "print(json.dumps([code, loaded]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    exit_code, loaded = json.loads(proc.stdout)
    assert exit_code == 2, proc.stderr
    assert "treadle: error:" in proc.stderr and "treadle: fix:" in proc.stderr
    assert loaded == [], f"{' '.join(words)} loads {loaded} before printing its error"


def test_missing_eval_log_fix_points_at_the_eval_logs_not_sessions(tmp_path: Path) -> None:
    proc = treadle("eval", "report", "nonexist.jsonl", cwd=tmp_path)
    assert proc.returncode == 2
    assert "no evaluation log at nonexist.jsonl." in proc.stderr
    assert "treadle sessions" not in proc.stderr
    assert ".treadle/evals" in proc.stderr


def _eval_log(path: Path, *, scorer: str, score: float) -> Path:
    config = {"agent": {"name": "echo"}, "dataset": {"hash": "d1"}, "scorer": {"scorer": scorer}}
    header = LogHeader(config_hash=f"h-{scorer}", config=config, dataset="qa", items=1, samples=1)
    record = SampleRecord(item_id="q0", sample=0, score=score, passed=score == 1.0)
    path.write_text(json.dumps(header.to_json()) + "\n" + json.dumps(record.to_json()) + "\n")
    return path


def test_show_refuses_an_eval_log_and_names_eval_report(tmp_path: Path) -> None:
    log = _eval_log(tmp_path / "run.jsonl", scorer="exact", score=1.0)
    proc = treadle("show", str(log), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "session None" not in proc.stdout
    assert "is an eval log" in proc.stderr
    assert f"treadle eval report {log}" in proc.stderr


def test_sessions_leaves_eval_logs_out(tmp_path: Path) -> None:
    _eval_log(tmp_path / "run.jsonl", scorer="exact", score=1.0)
    proc = treadle("sessions", str(tmp_path), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_compare_prints_the_configuration_changes(tmp_path: Path) -> None:
    before = _eval_log(tmp_path / "a.jsonl", scorer="exact", score=0.0)
    after = _eval_log(tmp_path / "b.jsonl", scorer="contains", score=1.0)
    proc = treadle("--color", "never", "eval", "compare", str(before), str(after), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "configuration changed: scorer: exact -> contains" in proc.stdout
    same = treadle("--color", "never", "eval", "compare", str(before), str(before), cwd=tmp_path)
    assert same.returncode == 0, same.stderr
    assert "configuration changed" not in same.stdout


@pytest.mark.parametrize("flag", [["--color", "never"], ["--raw"], ["--color=never"]])
def test_global_flags_after_the_command_say_where_they_go(flag: list[str], tmp_path: Path) -> None:
    proc = treadle("run", "hi", *flag, cwd=tmp_path)
    assert proc.returncode == 2
    name = flag[0].split("=")[0]
    assert f"treadle: error: {name} is an option of treadle itself, not of run." in proc.stderr
    assert f"treadle: fix: put it before the command: treadle {name}" in proc.stderr


def test_empty_prompt_is_refused(tmp_path: Path) -> None:
    proc = treadle("run", "  ", "--model", "m", cwd=tmp_path)
    assert proc.returncode == 2
    assert "The prompt is empty." in proc.stderr and 'treadle run "Say hello"' in proc.stderr


_BUSY_AND_DAMAGED = """
import sys
from treadle.cli.failures import explain
from treadle.errors import EvalLogBusyError, EvalLogDamagedError
busy = explain(EvalLogBusyError("x.jsonl is being written by another run (pid 4242 on h)."))
damaged = explain(EvalLogDamagedError("x.jsonl:3: bad", path="x.jsonl", line=3))
print(busy.fix)
print(damaged.fix)
"""


def test_busy_and_damaged_eval_logs_get_their_own_fix_lines() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _BUSY_AND_DAMAGED],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    busy, damaged = proc.stdout.splitlines()
    assert "pid 4242" in busy and "kill 4242" in busy and "treadle sessions" not in busy
    assert "line 3 of x.jsonl" in damaged and "treadle sessions" not in damaged


_AGENT = """
from treadle import Agent, Provider
agent = Agent("echo", "Repeat.", provider=Provider(model="m", base_url="http://127.0.0.1:9/v1",
              api_key="k", max_retries=0))
"""


def test_a_real_busy_log_names_the_holders_pid(tmp_path: Path) -> None:
    from treadle.evals.loglock import lock_log, unlock_log

    (tmp_path / "busy_agent.py").write_text(_AGENT)
    (tmp_path / "qa.jsonl").write_text('{"id": "q0", "input": "hi", "expected": "hi"}\n')
    log = tmp_path / "run.jsonl"
    fd = lock_log(log)  # this test process is the other run holding the log
    try:
        proc = treadle("eval", "qa.jsonl", "--agent", "busy_agent:agent", "--log", str(log),
                       cwd=tmp_path)  # fmt: skip
    finally:
        unlock_log(fd)
    assert proc.returncode == 2, proc.stderr
    assert f"kill {os.getpid()}" in proc.stderr and "treadle sessions" not in proc.stderr


def test_a_real_damaged_log_names_the_line_to_repair(tmp_path: Path) -> None:
    log = _eval_log(tmp_path / "run.jsonl", scorer="exact", score=1.0)
    lines = log.read_text().splitlines()
    log.write_text("\n".join([lines[0], "{not json", lines[1]]) + "\n")
    proc = treadle("eval", "report", str(log), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert f"repair or move line 2 of {log}" in proc.stderr
    assert "treadle sessions" not in proc.stderr


def test_a_reader_that_goes_away_is_not_a_bug(tmp_path: Path) -> None:
    # `treadle sessions DIR | head -1`: the pipe closes before treadle has written everything.
    sessions = tmp_path / "s"
    sessions.mkdir()
    for i in range(400):
        header = {"type": "header", "schema": 1, "session_id": f"id{i}", "created_at": 1.0}
        (sessions / f"id{i}.jsonl").write_text(json.dumps(header) + "\n")
    code = (
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-m', 'treadle.cli', 'sessions', sys.argv[1]],\n"
        "    stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
        "p.stdout.readline(); p.stdout.close()\n"
        "err = p.stderr.read().decode(); p.wait()\n"
        "print(p.returncode); print(err)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(sessions)], capture_output=True, text=True, timeout=120,
        env=_env(),
    )  # fmt: skip
    assert "bug in Treadle" not in proc.stdout and "BrokenPipeError" not in proc.stdout
