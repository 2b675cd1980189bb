"""The user's own code and paths on the command line, found by the new-user re-check.

An exception inside the `--agent` module (on import or in its factory) is an error in the user's
file: reported with their file and line and their part of the traceback, exit 2, never as "a bug
in Treadle". A `--sandbox` path whose parent is missing is refused with the command that creates
it (it used to be created, parents and all). A flag `treadle eval` does not take says where that
setting lives, and no fix line suggests `--help` as the flag meant. Real subprocesses.
"""

from __future__ import annotations

from pathlib import Path

from test_cli import treadle
from treadle.testing import FakeOpenAIServer


def _dataset(cwd: Path) -> None:
    (cwd / "data.jsonl").write_text('{"id": "1", "input": "hi", "expected": "hi"}\n')


def test_an_exception_on_importing_the_agent_module_is_the_users_error(tmp_path: Path) -> None:
    _dataset(tmp_path)
    (tmp_path / "myagent.py").write_text(
        "def helper():\n    return {}['missing']\n\n\nagent = helper()\n"
    )
    proc = treadle("eval", "data.jsonl", "--agent", "myagent:agent", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "bug in Treadle" not in proc.stderr
    assert (
        f"agent module 'myagent' raised KeyError at {tmp_path / 'myagent.py'}:2: 'missing'"
        in proc.stderr
    )
    assert "fix: this is an error in your code, not in Treadle" in proc.stderr
    # their traceback, from their module on: no frames of importlib or of Treadle
    assert 'myagent.py", line 5, in <module>' in proc.stderr
    assert 'myagent.py", line 2, in helper' in proc.stderr
    assert "importlib" not in proc.stderr and "treadle/cli" not in proc.stderr


def test_an_exception_in_the_agent_factory_is_the_users_error(tmp_path: Path) -> None:
    _dataset(tmp_path)
    (tmp_path / "factory.py").write_text("def make():\n    raise RuntimeError('no config')\n")
    proc = treadle("eval", "data.jsonl", "--agent", "factory:make", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "bug in Treadle" not in proc.stderr
    assert (
        f"agent factory 'factory:make' raised RuntimeError at {tmp_path / 'factory.py'}:2: "
        "no config" in proc.stderr
    )


def test_a_syntax_error_and_a_missing_import_in_the_agent_module(tmp_path: Path) -> None:
    _dataset(tmp_path)
    (tmp_path / "broken.py").write_text("agent = (\n")
    proc = treadle("eval", "data.jsonl", "--agent", "broken:agent", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert f"raised SyntaxError at {tmp_path / 'broken.py'}:1" in proc.stderr
    # a package the user's module imports is missing: their error, not "no module myagent"
    (tmp_path / "needs.py").write_text("import not_installed_anywhere\n")
    proc = treadle("eval", "data.jsonl", "--agent", "needs:agent", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert f"raised ModuleNotFoundError at {tmp_path / 'needs.py'}:1" in proc.stderr
    # the module itself is missing: where to run from
    proc = treadle("eval", "data.jsonl", "--agent", "absent:agent", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert f"no module named 'absent' under {tmp_path}" in proc.stderr
    assert "fix: run treadle from the directory that holds absent(.py)" in proc.stderr
    (tmp_path / "empty.py").write_text("x = 1\n")
    proc = treadle("eval", "data.jsonl", "--agent", "empty:agent", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "empty has no attribute 'agent'" in proc.stderr


def test_a_sandbox_path_under_a_missing_parent_is_refused(tmp_path: Path) -> None:
    with FakeOpenAIServer(script="echo") as srv:
        proc = treadle(
            "run", "hi", "--model", "m", "--base-url", srv.base_url,
            "--sandbox", "missing/parent/box", cwd=tmp_path,
        )  # fmt: skip
        assert srv.request_count == 0
    assert proc.returncode == 2, proc.stderr
    assert f"its parent directory {tmp_path / 'missing' / 'parent'} does not exist" in (proc.stderr)
    assert "fix: check the path, or create it first: mkdir -p missing/parent/box" in proc.stderr
    assert not (tmp_path / "missing").exists()


def test_eval_names_where_run_only_flags_go_and_help_is_never_the_guess(tmp_path: Path) -> None:
    _dataset(tmp_path)
    proc = treadle("eval", "data.jsonl", "--agent", "a:b", "--model", "m", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "fix: treadle eval takes no --model: the agent named by --agent sets it" in (proc.stderr)
    proc = treadle("run", "hi", "--hepl", cwd=tmp_path)
    assert proc.returncode == 2
    assert "did you mean --help" not in proc.stderr
    assert "`treadle run --help` lists every flag." in proc.stderr


def test_an_agent_or_scorer_named_as_a_file_path_gets_the_module_name(tmp_path: Path) -> None:
    _dataset(tmp_path)
    (tmp_path / "myagent.py").write_text("agent = None\n")
    for spec in ("./myagent.py:agent", "myagent.py:agent"):
        proc = treadle("eval", "data.jsonl", "--agent", spec, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert f"--agent {spec!r} is a file path" in proc.stderr
        assert "fix: pass --agent myagent:agent (no ./ and no .py" in proc.stderr
    proc = treadle("eval", "data.jsonl", "--agent", "pkg/sub/mod.py:make", cwd=tmp_path)
    assert "fix: pass --agent pkg.sub.mod:make" in proc.stderr
    proc = treadle(
        "eval", "data.jsonl", "--agent", "myagent:agent", "--scorer", "myscorer.py:bad",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "fix: pass --scorer myscorer:bad" in proc.stderr


def test_a_misspelt_scorer_name_gets_did_you_mean(tmp_path: Path) -> None:
    _dataset(tmp_path)
    (tmp_path / "myagent.py").write_text("agent = None\n")
    proc = treadle(
        "eval", "data.jsonl", "--agent", "myagent:agent", "--scorer", "containz", cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    assert "--scorer 'containz' is neither a built-in scorer (exact, contains)" in proc.stderr
    assert "fix: did you mean --scorer contains? pass --scorer exact" in proc.stderr


def test_a_sandbox_that_is_a_file_or_empty_is_refused_with_what_to_type(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("a file\n")
    for value, cause in (
        ("notes.txt", "--sandbox 'notes.txt' is a file, not a directory."),
        ("", "--sandbox was given an empty value."),
    ):
        proc = treadle(
            "run", "hi", "--model", "m", "--base-url", "http://127.0.0.1:1/v1",
            "--sandbox", value, cwd=tmp_path,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert cause in proc.stderr
        assert "bug in Treadle" not in proc.stderr and "--sandbox ./ " not in proc.stderr
        assert "fix: pass " in proc.stderr and "--sandbox local" in proc.stderr
    assert (tmp_path / "notes.txt").read_text() == "a file\n"
