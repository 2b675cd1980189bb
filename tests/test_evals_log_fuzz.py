"""Hostile eval log headers: every malformed `config` field is a typed error naming file and
line (or is shown as it is), never a crash of `eval compare`, `eval report` or the library calls
behind them; and a session transcript given to them is called a transcript, not a damaged log.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from treadle import Agent, Provider
from treadle.cli import main
from treadle.errors import EvalLogDamagedError, PersistenceError
from treadle.evals import compare, read_log, run_eval
from treadle.evals.report import render_report
from treadle.evals.summary import summarize
from treadle.testing import FakeOpenAIServer

ODD_VALUES: list[Any] = [None, True, 0, -1.5, "text", "", [], [1, {"a": 2}], {}, {"k": [None]}]


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("fuzz") / "base.jsonl"
    with FakeOpenAIServer("echo") as server:
        provider = Provider(model="fake-model", base_url=server.base_url, api_key="k")
        items = [{"id": f"q{i}", "input": f"w{i}", "expected": f"w{i}"} for i in range(3)]
        run_eval(Agent("echo", "Repeat.", provider=provider), items, log=path)
    yield path


def _mutations(config: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(dotted path, value) for every config field and odd value, two levels deep."""
    for key, value in config.items():
        for odd in ODD_VALUES:
            yield key, odd
        if isinstance(value, dict):
            for inner in value:
                for odd in ODD_VALUES:
                    yield f"{key}.{inner}", odd
    for odd in ODD_VALUES:  # and fields that were not there
        yield "dataset.hash", odd
        yield "agent.provider.model", odd


def _with(header: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    changed = json.loads(json.dumps(header))
    node = changed["config"]
    *parents, last = dotted.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value
    return changed


def test_every_odd_config_field_is_read_or_refused_with_file_and_line(
    log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = log.read_text().splitlines()
    header = json.loads(lines[0])
    base = read_log(log)
    refused = shown = 0
    counter = itertools.count()
    for dotted, value in _mutations(header["config"]):
        path = tmp_path / f"odd{next(counter)}.jsonl"
        path.write_text("\n".join([json.dumps(_with(header, dotted, value)), *lines[1:]]) + "\n")
        try:
            odd = read_log(path)
        except EvalLogDamagedError as error:
            assert f"{path}:1:" in str(error), (dotted, value, error)
            refused += 1
            code = main(["eval", "compare", str(log), str(path)])
            assert code != 0 and f"{path}:1:" in capsys.readouterr().err, (dotted, value)
            continue
        shown += 1
        compare(base, odd)
        compare(odd, base)
        summarize(odd)
        render_report(odd)
        assert main(["eval", "compare", str(log), str(path)]) == 0, (dotted, value)
        assert main(["eval", "report", str(path), "--out", str(tmp_path / "r.html")]) == 0
        capsys.readouterr()
    print(f"{refused} odd headers refused with file:line, {shown} read and shown")
    assert refused and shown


def test_a_non_object_dataset_field_is_named(log: Path, tmp_path: Path) -> None:
    lines = log.read_text().splitlines()
    header = json.loads(lines[0])
    header["config"]["dataset"] = ["not", "an", "object"]
    path = tmp_path / "odd.jsonl"
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    with pytest.raises(EvalLogDamagedError, match=r":1: .*'config\.dataset' is not an object"):
        read_log(path)


def test_a_session_transcript_is_not_called_a_damaged_log(
    log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with FakeOpenAIServer("echo") as server:
        args = ["run", "hello", "--model", "fake-model", "--base-url", server.base_url]
        code = main([*args, "--api-key", "k", "--persist"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    (transcript,) = (tmp_path / ".treadle" / "sessions").glob("*.jsonl")
    compared = ["eval", "compare", str(log), str(transcript)]
    for args in (["eval", "report", str(transcript)], compared):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "session transcript" in err and f"treadle show {transcript}" in err, err
        assert "damaged" not in err
    with pytest.raises(PersistenceError, match="session transcript"):
        read_log(transcript)
