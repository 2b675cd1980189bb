"""What `treadle eval` says when the score cannot tell the story, found by the new-user re-check.

A scorer that raises is the scorer's error (`scorer_error`, with its file:line), never the
agent's; a run in which no sample was scored (nothing reached the endpoint, the scorer raised
every time) exits with `treadle run`'s code for that error and a fix line naming the rerun.
Real subprocesses against the fake server (and a closed port for the unreachable endpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

from test_cli import treadle
from treadle.testing import FakeOpenAIServer


def _project(cwd: Path, base_url: str) -> None:
    (cwd / "ds.jsonl").write_text(
        '{"id": "a", "input": "hello", "expected": "hello"}\n'
        '{"id": "b", "input": "bye", "expected": "hello"}\n'
    )
    (cwd / "myagent.py").write_text(
        "from treadle import Agent, Provider\n"
        f"agent = Agent('parrot', 'Repeat.', provider=Provider(model='fake', base_url={base_url!r},"
        " max_retries=0))\n"
    )
    (cwd / "myscorer.py").write_text(
        "def bad(sample):\n    raise ValueError('scorer bug')\n\n\n"
        "def sometimes(sample):\n"
        "    if sample.item.id == 'b':\n        raise KeyError('b')\n"
        "    return True\n"
    )


def _records(log: Path) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in rows if r["type"] == "sample"]


def test_a_scorer_that_raises_is_a_scorer_error_with_its_file_and_line(tmp_path: Path) -> None:
    with FakeOpenAIServer(script="echo") as srv:
        _project(tmp_path, srv.base_url)
        proc = treadle(
            "eval", "ds.jsonl", "--agent", "myagent:agent", "--scorer", "myscorer:bad",
            "--log", "e3.jsonl", cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        where = f"ValueError at {tmp_path / 'myscorer.py'}:2: scorer bug"
        for record in _records(tmp_path / "e3.jsonl"):
            assert record["error_kind"] == "scorer_error"
            assert record["error"] == where
            assert record["stop_reason"] == "final_answer"  # the agent's pass itself was fine
        assert "scorer_error 2" in proc.stdout and "agent_error" not in proc.stdout
        assert f"all 2 samples failed, none was scored (scorer_error 2): {where}" in proc.stderr
        assert "fix: this is an error in your scorer myscorer:bad" in proc.stderr
        assert "--log e3-2.jsonl" in proc.stderr  # the samples in e3.jsonl are done
        # one sample's scorer raises, the other's passes: a warning, exit 0
        proc = treadle(
            "eval", "ds.jsonl", "--agent", "myagent:agent", "--scorer", "myscorer:sometimes",
            "--log", "e4.jsonl", cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert (
            "scorer myscorer:sometimes raised in 1 of 2 samples (scored 0): KeyError at "
            f"{tmp_path / 'myscorer.py'}:7: 'b'" in " ".join(proc.stdout.split())
        )


def test_an_eval_that_reaches_no_endpoint_exits_4_with_a_fix(tmp_path: Path) -> None:
    _project(tmp_path, "http://127.0.0.1:1/v1")
    proc = treadle(
        "eval", "ds.jsonl", "--agent", "myagent:agent", "--retries", "0", "--log", "dead.jsonl",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 4, proc.stderr
    assert "connection 2" in proc.stdout
    assert "all 2 samples failed, none was scored (connection 2)" in proc.stderr
    assert "fix: check base_url in the Provider(...) of --agent myagent:agent" in proc.stderr
    assert "--log dead-2.jsonl" in proc.stderr
