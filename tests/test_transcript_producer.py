"""Transcripts and eval logs say what produced them; a refused eval resume says what changed.

Real passes against the fake server write real files: the header's `producer` names the
model, the endpoint's origin (never a key, a path or user-info), Treadle's version and the
options that shape the output; `treadle show` and `treadle eval compare` print it; files written
before it existed still load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import treadle
from test_cli import _env
from treadle import Agent, Provider, Session, load_session, run_session_loop
from treadle.cli.app import main
from treadle.errors import EvalConfigMismatch
from treadle.evals import contains, exact, read_log, run_eval
from treadle.persist.producer import endpoint_origin, producer_record
from treadle.testing import FakeOpenAIServer

SECRET = "sk-never-on-disk-0123456789"
ITEMS = [{"id": "a", "input": "Paris", "expected": "Paris"}]


@pytest.fixture(scope="module")
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer("echo") as fake:
        yield fake


def _provider(server: FakeOpenAIServer) -> Provider:
    return Provider(
        model="fake-model",
        base_url=server.base_url,
        api_key=SECRET,
        temperature=0.3,
        seed=7,
        extra_body={"top_k": 20, "x_api_key": SECRET},
    )


def _persisted_pass(server: FakeOpenAIServer, path: Path) -> Session:
    """A pass of `_provider(server)` persisted to `path` (lazy: `run_session_loop`'s return)."""
    return run_session_loop(
        Session.from_user_message("hi"),
        Session.from_agent_prompt("Be brief."),
        agent_provider=_provider(server),
        persist_path=path,
    )


def _show(path: Path) -> subprocess.CompletedProcess[str]:
    """`treadle show path` in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "treadle.cli", "show", str(path)],
        capture_output=True, text=True, env=_env(), timeout=120,
    )  # fmt: skip


def test_a_persisted_transcript_records_what_produced_it(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    out = _persisted_pass(server, path)
    assert out.stop_reason == "final_answer"
    header = json.loads(path.read_text().splitlines()[0])
    port = server.base_url.split(":")[2].split("/")[0]
    expected = {
        "treadle": treadle.__version__,
        "model": "fake-model",
        "endpoint": f"http://127.0.0.1:{port}",
        "options": {"temperature": 0.3, "seed": 7, "extra_body": {"top_k": 20, "x_api_key": "***"}},
    }
    assert header["producer"] == expected
    assert SECRET not in path.read_text()
    assert load_session(path).producer == expected


def test_a_file_written_before_producers_still_loads_and_shows(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    path = tmp_path / "old.jsonl"
    _persisted_pass(server, path).synchronize()
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    del header["producer"]
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    loaded = load_session(path)
    assert loaded.producer == {} and loaded.closed
    proc = _show(path)
    assert proc.returncode == 0, proc.stderr
    assert "closed cleanly" in proc.stdout and "model " not in proc.stdout


def test_show_prints_the_producer_in_its_header(server: FakeOpenAIServer, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _persisted_pass(server, path).synchronize()
    proc = _show(path)
    assert proc.returncode == 0, proc.stderr
    head = proc.stdout.splitlines()[:2]
    port = server.base_url.split(":")[2].split("/")[0]
    assert head[1].startswith(f"model fake-model at http://127.0.0.1:{port} | treadle "), head
    assert "temperature=0.3" in head[1] and "seed=7" in head[1]
    assert SECRET not in proc.stdout


@pytest.mark.parametrize(
    ("url", "origin"),
    [
        ("https://api.openai.com/v1", "https://api.openai.com"),
        ("https://user:pw@gw.example:8443/acct/SECRET/v1?key=SECRET", "https://gw.example:8443"),
        ("http://[::1]:8080/v1", "http://[::1]:8080"),
        (None, None),
    ],
)
def test_the_endpoint_is_recorded_as_its_origin_only(url: str | None, origin: str | None) -> None:
    assert endpoint_origin(url) == origin


def test_a_provider_that_cannot_resolve_is_recorded_as_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "TREADLE_MODEL"):
        monkeypatch.delenv(name, raising=False)
    record = producer_record(Provider(model="m"), version="9.9")  # no key for api.openai.com
    assert record == {"treadle": "9.9", "model": "m", "endpoint": None, "options": {}}
    assert producer_record(None, version="9.9") == {"treadle": "9.9"}


def _agent(server: FakeOpenAIServer) -> Agent:
    return Agent("echo", instructions="Answer.", provider=_provider(server))


def test_an_eval_log_and_its_transcripts_record_the_producer(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    log = tmp_path / "log.jsonl"
    run_eval(_agent(server), ITEMS, exact(), log=log)
    producer = read_log(log).header.producer
    assert producer["model"] == "fake-model" and producer["treadle"] == treadle.__version__
    assert producer["endpoint"].startswith("http://127.0.0.1:")
    (transcript,) = (tmp_path / "log.jsonl.transcripts").rglob("*.jsonl")
    assert json.loads(transcript.read_text().splitlines()[0])["producer"] == producer
    # (the log's `config` fingerprint keeps extra_body whole: reported, not this file's field)
    assert SECRET not in json.dumps(producer) + transcript.read_text()
    # a log written before producers were recorded still reads
    lines = log.read_text().splitlines()
    header = json.loads(lines[0])
    del header["producer"]
    old = tmp_path / "old.jsonl"
    old.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    assert dict(read_log(old).header.producer) == {}


def test_a_refused_resume_says_what_changed(server: FakeOpenAIServer, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    run_eval(_agent(server), ITEMS, exact(), log=log)
    with pytest.raises(EvalConfigMismatch) as info:
        run_eval(_agent(server), ITEMS, contains(), log=log)
    assert info.value.changes == [("scorer", "exact", "contains")]
    assert "different configuration (scorer: 'exact' -> 'contains')" in str(info.value)
    other = Agent("echo", instructions="Other.", provider=_provider(server))
    with pytest.raises(EvalConfigMismatch) as info:
        run_eval(other, ITEMS, exact(), log=log)
    assert "agent.instructions: 'Answer.' -> 'Other.'" in str(info.value)


AGENT_MODULE = """
from treadle import Agent, Provider
agent = Agent("echo", instructions="Answer.", provider=Provider(model="m", base_url="{url}"))
"""


def test_the_cli_fix_names_the_eval_command_lines(
    server: FakeOpenAIServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "producer_agent.py").write_text(AGENT_MODULE.format(url=server.base_url))
    (tmp_path / "qa.jsonl").write_text(json.dumps(ITEMS[0]) + "\n")
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "qa.jsonl", "--agent", "producer_agent:agent"]) == 0
    out = capsys.readouterr()
    args = ["eval", "qa.jsonl", "--agent", "producer_agent:agent", "--scorer", "contains"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "scorer: 'exact' -> 'contains'" in err
    assert "--help" not in err
    log = Path(".treadle") / "evals" / "qa.jsonl"
    assert (
        "treadle: fix: write a new log: treadle eval qa.jsonl --agent producer_agent:agent "
        f"--scorer contains --log {log.with_name('qa-2.jsonl')}; or resume {log} with the "
        "scorer it was written with: --scorer exact." in err
    ), err
    other = tmp_path / "other.jsonl"
    assert main([*args, "--log", str(other)]) == 0
    capsys.readouterr()
    assert main(["eval", "compare", str(log), str(other)]) == 0
    out = capsys.readouterr()
    assert "before: model m at http://127.0.0.1:" in out.out
    assert "after: model m at http://127.0.0.1:" in out.out


def test_the_producer_line_shows_no_terminal_escapes_from_a_file() -> None:
    from treadle.cli.describe import producer_line

    line = producer_line(
        {"model": "m\x1b[2J", "endpoint": "http://h", "options": {"stop": "\x1b]0;x\x07"}}
    )
    assert line is not None and "\x1b" not in line and "\x07" not in line
    assert line.startswith("model m?[2J at http://h")
    assert producer_line(None) is None and producer_line({}) is None


def test_nested_credentials_in_extra_body_are_masked() -> None:
    from treadle.llm import Provider
    from treadle.persist.producer import producer_record

    provider = Provider(
        model="m",
        base_url="http://127.0.0.1:1/v1",
        api_key="k",
        extra_body={
            "headers": {"Authorization": "Bearer SEKRET2"},
            "extra_headers": [{"X-Api-Key": "S7"}],
            "top_k": 20,
        },
    )
    text = str(producer_record(provider))
    assert "SEKRET2" not in text and "S7" not in text and "20" in text
