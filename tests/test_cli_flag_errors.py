"""Flag mistakes from the new-user re-check, each answered with what to type: a flag before the
command is treadle's own (its usage, not `run`'s), abbreviations are not taken, a negative demo
latency is refused, and a base URL that ends in the request path names the base URL. Real
subprocesses; nothing reaches a server (each is refused before a request).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_cli import treadle


def test_an_unknown_flag_before_the_command_is_treadles_not_the_commands(tmp_path: Path) -> None:
    proc = treadle("--bogus", "run", "hi", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("usage: treadle [")
    assert "treadle: error: unrecognized arguments: --bogus" in proc.stderr
    assert "treadle run:" not in proc.stderr
    # after the command it is still the command's
    proc = treadle("run", "hi", "--bogus", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "treadle run: error: unrecognized arguments: --bogus" in proc.stderr


def test_an_abbreviated_flag_is_refused_with_the_full_one(tmp_path: Path) -> None:
    proc = treadle("run", "hi", "--model", "m", "--base-ur", "http://127.0.0.1:1/v1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "unrecognized arguments: --base-ur" in proc.stderr
    assert "fix: did you mean --base-url?" in proc.stderr


@pytest.mark.parametrize("value", ["-5", "nan", "fast"])
def test_a_bad_demo_latency_is_refused(tmp_path: Path, value: str) -> None:
    proc = treadle("demo", "--latency-ms", value, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "argument --latency-ms: expected" in proc.stderr


def test_a_base_url_ending_in_the_request_path_names_the_base_url(tmp_path: Path) -> None:
    proc = treadle(
        "run", "hi", "--model", "m", "--base-url", "http://127.0.0.1:1/v1/chat/completions",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "--base-url ends in /chat/completions, the request path" in proc.stderr
    assert "fix: pass --base-url http://127.0.0.1:1/v1; Treadle appends" in proc.stderr


def test_sessions_leaves_out_a_dataset_in_the_directory(tmp_path: Path) -> None:
    (tmp_path / "ds.jsonl").write_text('{"id": "a", "input": "hello", "expected": "hello"}\n')
    (tmp_path / "notes.jsonl").write_text('[1, 2]\n{"type": "header"}\n')  # JSON, no session
    proc = treadle("--color", "never", "sessions", ".", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "No sessions in ." in proc.stdout
    assert "ds.jsonl" not in proc.stdout and "notes.jsonl" not in proc.stdout


def test_the_default_system_prompt_names_workspace_tools_only_with_a_sandbox(
    tmp_path: Path,
) -> None:
    from treadle.testing import FakeOpenAIServer

    with FakeOpenAIServer(script="echo") as srv:
        for extra, prompt in (
            ((), "You are a helpful assistant."),
            (("--sandbox", "local"), "You are a helpful assistant. Use the workspace tools"),
        ):
            proc = treadle(
                "run", "hi", "--model", "m", "--base-url", srv.base_url, *extra, cwd=tmp_path
            )
            assert proc.returncode == 0, proc.stderr
            body = srv.requests[-1].body
            assert isinstance(body, dict)
            system = body["messages"][0]
            assert system["role"] == "system"
            assert system["content"].startswith(prompt)
            assert ("workspace" in system["content"]) == bool(extra)


EVAL_MISTAKES = {
    "report of a transcript": ["eval", "report", "t.jsonl"],
    "report of a dataset": ["eval", "report", "ds.jsonl"],
    "compare with a transcript": ["eval", "compare", "log.jsonl", "t.jsonl"],
    "an eval log as dataset": ["eval", "log.jsonl", "--agent", "a:b"],
    "a transcript as dataset": ["eval", "t.jsonl", "--agent", "a:b"],
    "a missing agent module": ["eval", "ds.jsonl", "--agent", "nosuch:agent"],
}


@pytest.mark.parametrize("words", EVAL_MISTAKES.values(), ids=list(EVAL_MISTAKES))
def test_eval_mistakes_are_reported_before_the_evals_load(tmp_path: Path, words: list[str]) -> None:
    import json
    import subprocess
    import sys

    from test_cli import _env

    (tmp_path / "ds.jsonl").write_text('{"id": "a", "input": "hello", "expected": "hello"}\n')
    (tmp_path / "t.jsonl").write_text('{"type": "header", "schema": 1, "session_id": "s1"}\n')
    (tmp_path / "log.jsonl").write_text('{"type": "header", "schema": 2, "config_hash": "x"}\n')
    heavy = ("asyncio", "httpx", "pydantic", "rich", "treadle.evals", "treadle.agents")
    code = (
        "import json, sys\n"
        "from treadle.cli.app import main\n"
        f"code = main(['--color', 'never', *{words!r}])\n"
        f"heavy = {heavy!r}\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(heavy))\n"
        "print(json.dumps([code, loaded]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    exit_code, loaded = json.loads(proc.stdout)
    assert exit_code == 2, proc.stderr
    assert "treadle: error: " in proc.stderr and "treadle: fix: " in proc.stderr
    assert loaded == [], f"{' '.join(words)} loads {loaded} before printing its error"
