"""`treadle eval`, `eval report` and `eval compare`, in process, on the fake server."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from treadle.cli import main
from treadle.testing import FakeOpenAIServer

_names = itertools.count()

AGENT = """
from treadle import Agent, Provider
agent = Agent("echo", "Repeat.", provider=Provider(model="fake-model", base_url={url!r},
              api_key="k", max_retries=0))

def make_agent():
    return agent

def first_word(sample):
    return (sample.answer or "").split()[0] == sample.item.expected
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, str]]:
    with FakeOpenAIServer("echo") as server:
        module = f"evalcli_agent_{next(_names)}"
        (tmp_path / f"{module}.py").write_text(AGENT.format(url=server.base_url))
        with (tmp_path / "qa.jsonl").open("w") as file:
            for i in range(20):
                item = {"id": f"q{i}", "input": f"w{i % 3} tail", "expected": f"w{i % 2} tail"}
                file.write(json.dumps(item) + "\n")
        monkeypatch.chdir(tmp_path)
        yield tmp_path, module


def test_eval_run_resume_report_compare(
    project: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    root, module = project
    assert main(["eval", "qa.jsonl", "--agent", f"{module}:agent", "--samples", "2"]) == 0
    out = capsys.readouterr().out
    assert "pass@2" in out and "Wilson over items" in out and "samples    40 (20 items)" in out
    # the failing samples, with what was expected
    assert "failed samples (10 of 24):" in out
    assert "q10#0   w1 tail  w0 tail   answer differs from expected" in out
    log = root / ".treadle" / "evals" / "qa.jsonl"
    assert len(log.read_text().splitlines()) == 41
    # same configuration (a factory this time): resumes with nothing to do
    assert main(["eval", "qa.jsonl", "--agent", f"{module}:make_agent", "--samples", "2"]) == 0
    assert "resuming" in capsys.readouterr().out
    # another scorer against the same log is refused
    args = ["eval", "qa.jsonl", "--agent", f"{module}:agent", "--scorer", "contains"]
    assert main([*args, "--samples", "2"]) == 2
    assert "different configuration" in capsys.readouterr().err
    other = root / "other.jsonl"
    custom = [*args[:-1], f"{module}:first_word", "--log", str(other)]
    assert main(custom) == 0
    assert main(["--color", "never", "eval", "report", str(log)]) == 0
    assert (root / ".treadle" / "evals" / "qa.html").read_text().startswith("<!DOCTYPE html>")
    assert main(["eval", "report", str(other), "--out", "r.html"]) == 0
    assert (root / "r.html").is_file()
    assert main(["eval", "compare", str(log), str(other)]) == 0
    out = capsys.readouterr().out
    assert "improved" in out and "regressed" in out


def test_eval_usage_errors(project: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    _, module = project
    assert main(["eval", "missing.jsonl", "--agent", f"{module}:agent"]) == 2
    assert "no dataset file" in capsys.readouterr().err
    assert main(["eval", "qa.jsonl", "--agent", "no_colon"]) == 2
    assert "module:attribute" in capsys.readouterr().err
    assert main(["eval", "qa.jsonl", "--agent", f"{module}:nothing"]) == 2
    assert "cannot load agent" in capsys.readouterr().err
    assert main(["eval", "report", "nope.jsonl"]) == 2
    assert "no evaluation log" in capsys.readouterr().err


def test_failure_rows_are_terminal_safe() -> None:
    from treadle.cli.eval import failure_rows
    from treadle.evals import SampleRecord

    hostile = "\x1b[2J\x1b]0;pwned\x07[bold red]boom[/] \u202egnp.exe"
    record = SampleRecord("q\x1b[31m1", 0, 0.0, False, answer=hostile, expected=["a\nb"])
    (plain,) = failure_rows([record])
    assert all("\x1b" not in cell and "\x07" not in cell and "\u202e" not in cell for cell in plain)
    # shown as `show` shows them (issue 29 round 2: dropping them hid what the model sent)
    assert plain[1].startswith("^[[2J^[]0;pwned^G[bold red]boom[/] <U+202E>gnp.exe")
    assert plain[2] == '["a\\nb"]'
    (styled,) = failure_rows([record], styled=True)
    assert "\\[bold red]" in styled[1]  # rich markup escaped, shown as text
