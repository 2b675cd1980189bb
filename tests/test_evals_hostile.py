"""Eval runs that must not freeze the shared loop or corrupt a log, each beside 100 bystanders.

Two runs on one log (one refuses, naming the holder; the other's log and summary are exact), a
damaged or unknown-field log line on resume (refused with file:line before any request), a
scorer that never returns (bounded by `score_timeout`), a 2 s sync scorer (on a worker thread:
the loop keeps running), and items whose files cannot be laid out (refused before any request).
The stall of the runtime loop is measured as tests/loop_watch.py does.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loop_watch import STALL_LIMIT, beside_bystanders, quiet_transcripts
from treadle import Agent, ConfigurationError, Provider
from treadle.errors import EvalLogBusyError, EvalLogDamagedError
from treadle.evals import Item, Score, ScoreInput, function, read_log, run_eval
from treadle.evals.log import lock_path
from treadle.runtime import get_runtime
from treadle.testing import FakeOpenAIServer, Reply

ITEMS = [{"id": f"q{i}", "input": f"echo {i}", "expected": f"echo {i}"} for i in range(8)]
GUARD = 120.0


@pytest.fixture(scope="module")
def quiet() -> list[list[dict[str, Any]]]:
    return quiet_transcripts()


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(lambda request: Reply.text(request["messages"][-1]["content"])) as fake:
        yield fake


def _agent(server: FakeOpenAIServer) -> Agent:
    provider = Provider(model="fake-model", base_url=server.base_url, api_key="k", max_retries=0)
    return Agent("echo", "Repeat.", provider=provider)


# -- one writer per log ---------------------------------------------------------------------------
_RUN = """
import sys
from treadle import Agent, Provider
from treadle.evals import run_eval
from treadle.errors import EvalLogBusyError
provider = Provider(model="fake-model", base_url={url!r}, api_key="k", max_retries=0)
items = [{{"id": f"q{{i}}", "input": f"echo {{i}}", "expected": f"echo {{i}}"}} for i in range(300)]
print("started", flush=True)
sys.stdin.readline()  # both processes are up: go together
try:
    result = run_eval(Agent("echo", "Repeat.", provider=provider), items, log={log!r},
                      concurrency=4)
except EvalLogBusyError as error:
    print("refused:", error, flush=True)
    sys.exit(3)
print("samples", result.summary.samples, "passed", result.summary.pass_rate, flush=True)
"""


def test_two_processes_on_one_log_one_refuses_the_other_is_exact(tmp_path: Path) -> None:
    log = tmp_path / "shared.jsonl"

    def script(request: dict[str, Any]) -> Reply:
        # 300 items, 4 at once, 20 ms each: the runs overlap for seconds
        return Reply.text(request["messages"][-1]["content"]).with_latency(20)

    with FakeOpenAIServer(script) as fake:
        code = textwrap.dedent(_RUN).format(url=fake.base_url, log=str(log))
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        try:
            for proc in procs:
                assert proc.stdout is not None and proc.stdout.readline() == "started\n"
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
            outputs = [proc.communicate(timeout=GUARD) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    codes = sorted(proc.returncode for proc in procs)
    assert codes == [0, 3], outputs
    winner = next(
        out for proc, (out, _) in zip(procs, outputs, strict=True) if proc.returncode == 0
    )
    loser = next(out for proc, (out, _) in zip(procs, outputs, strict=True) if proc.returncode == 3)
    winner_pid = next(p.pid for p in procs if p.returncode == 0)
    assert f"is being written by another run (pid {winner_pid} on {socket.gethostname()}" in loser
    assert "samples 300 passed 1.0" in winner
    lines = log.read_text().splitlines()
    assert len(lines) == 301  # the header and each sample once
    read = read_log(log)
    assert sorted(r.item_id for r in read.records) == sorted(f"q{i}" for i in range(300))
    assert lock_path(log).exists()


def test_a_second_run_in_this_process_is_refused_while_the_first_writes(
    tmp_path: Path, quiet: list[list[dict[str, Any]]]
) -> None:
    log = tmp_path / "held.jsonl"
    gate = threading.Event()
    entered = threading.Event()

    def held(sample: ScoreInput) -> bool:
        entered.set()
        gate.wait(GUARD)
        return True

    async def echo(session: Any) -> Any:
        from treadle import Session

        text = session.to_messages()[-1]["content"]
        return Session.from_messages(
            [*session.to_messages(), {"role": "assistant", "content": text}]
        )

    def first_then_second() -> str:
        holder = threading.Thread(
            target=run_eval, args=(echo, ITEMS[:1], function(held)), kwargs={"log": log}
        )
        holder.start()
        try:
            assert entered.wait(GUARD)
            with pytest.raises(EvalLogBusyError) as info:
                run_eval(echo, ITEMS[:1], function(held), log=log)
            return str(info.value)
        finally:
            gate.set()
            holder.join(GUARD)

    message, stall = beside_bystanders(first_then_second, quiet)
    assert f"(pid {os.getpid()} on {socket.gethostname()}, started " in message
    assert stall.cpu < STALL_LIMIT, stall
    assert [r.item_id for r in read_log(log).records] == ["q0"]


# -- resume checks every line before spending anything --------------------------------------------
def _damage(log: Path, line: int, text: str) -> None:
    lines = log.read_text().splitlines()
    lines[line - 1] = text
    log.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("{not json", "not JSON"),
        (
            '{"type": "sample", "item_id": "q1", "sample": "zero", "score": 1, "passed": true}',
            "field 'sample' has a bad value",
        ),
        (
            '{"type": "sample", "item_id": "q1", "sample": 0, "score": 1, "passed": true, '
            '"mood": "happy"}',
            "unknown fields ['mood']",
        ),
        (
            '{"type": "sample", "item_id": "q0", "sample": 0, "score": 1, "passed": true}',
            "already on line 2 (two runs wrote this log at once)",
        ),
        ('["a list"]', "not a sample line"),
    ],
)
def test_resume_refuses_a_damaged_line_before_any_request(
    server: FakeOpenAIServer,
    tmp_path: Path,
    damage: str,
    message: str,
    quiet: list[list[dict[str, Any]]],
) -> None:
    log = tmp_path / "r.jsonl"
    run_eval(_agent(server), ITEMS[:4], log=log)
    requests = server.request_count
    _damage(log, 3, damage)  # a middle line: the header is line 1

    def resume() -> EvalLogDamagedError:
        with pytest.raises(EvalLogDamagedError) as info:
            run_eval(_agent(server), ITEMS, log=log)
        return info.value

    error, stall = beside_bystanders(resume, quiet)
    assert str(error).startswith(f"{log}:3: ") and message in str(error)
    assert error.line == 3 and error.path == str(log)
    assert stall.cpu < STALL_LIMIT, stall
    assert server.request_count == requests  # nothing was spent
    with pytest.raises(EvalLogDamagedError, match=f"{log.name}:3: "):
        read_log(log)


# -- scoring is bounded and off the loop -----------------------------------------------------------
def test_a_scorer_that_never_returns_is_bounded(
    server: FakeOpenAIServer, tmp_path: Path, quiet: list[list[dict[str, Any]]]
) -> None:
    async def forever(sample: ScoreInput) -> Score:
        await asyncio.sleep(3600)
        return Score(1.0, True)

    result, stall = beside_bystanders(
        lambda: run_eval(
            _agent(server),
            ITEMS[:2],
            function(forever),
            log=tmp_path / "f.jsonl",
            score_timeout=0.5,
        ),
        quiet,
    )
    assert [r.error_kind for r in result.records] == ["scorer_error", "scorer_error"]
    assert "did not finish within 0.5 s (score_timeout)" in (result.records[0].error or "")
    assert result.summary.retries == 0
    assert stall.cpu < STALL_LIMIT, stall


def test_the_sample_timeout_bounds_scoring_without_a_score_timeout(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    async def forever(sample: ScoreInput) -> bool:
        await asyncio.sleep(3600)
        return True

    result = run_eval(
        _agent(server), ITEMS[:1], function(forever), log=tmp_path / "s.jsonl", sample_timeout=0.5
    )
    assert result.records[0].error_kind == "scorer_error"


def test_slow_sync_scorers_run_on_threads(
    server: FakeOpenAIServer, tmp_path: Path, quiet: list[list[dict[str, Any]]]
) -> None:
    on_loop: list[bool] = []

    def slow(sample: ScoreInput) -> bool:
        # Loop-thread CPU (what the stall check bounds) cannot see a blocking sleep: say where
        # it ran instead.
        on_loop.append(get_runtime().in_loop_thread())
        time.sleep(2)  # a sync scorer doing blocking work
        return sample.answer == sample.item.expected

    started = time.perf_counter()
    result, stall = beside_bystanders(
        lambda: run_eval(
            _agent(server), ITEMS, function(slow), log=tmp_path / "slow.jsonl", concurrency=8
        ),
        quiet,
    )
    print(
        f"8 samples with a 2 s sync scorer at concurrency 8: {time.perf_counter() - started:.1f} s"
    )
    assert result.summary.pass_rate == 1.0 and result.summary.samples == 8
    assert on_loop == [False] * 8
    assert stall.cpu < STALL_LIMIT, stall


# -- every item checked before the first request ---------------------------------------------------
@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"a": "x", "a/b": "y"}, "needs 'a' to be a directory"),
        ({".": "x"}, "names the workspace itself"),
        ({"a\0b": "x"}, "NUL byte"),
        ({"a": "x", "./a": "y"}, "names the same file as 'a'"),
        ({"n" * 300: "x"}, "longer than 255 bytes"),
        ({"é" * 128: "x"}, "longer than 255 bytes"),  # 256 bytes in UTF-8
        ({"/".join(["d" * 200] * 25): "x"}, "longer than 3,584"),  # past PATH_MAX
        ({"a\udc80": "x"}, "the path holds a lone surrogate"),
        ({"a": "text \ud800"}, "its text holds a lone surrogate"),
    ],
)
def test_files_that_cannot_be_laid_out_fail_before_any_request(
    server: FakeOpenAIServer,
    tmp_path: Path,
    files: dict[str, str],
    message: str,
    quiet: list[list[dict[str, Any]]],
) -> None:
    items: list[Any] = [*ITEMS[:3], {"id": "bad", "input": "x", "files": files}]

    def run() -> None:
        with pytest.raises(ConfigurationError, match=message):
            run_eval(_agent(server), items, log=tmp_path / "i.jsonl", sandbox=True)

    _, stall = beside_bystanders(run, quiet)
    assert stall.cpu < STALL_LIMIT, stall
    with pytest.raises(ConfigurationError, match=message):
        Item("bad", "x", files=files)
    assert server.request_count == 0
    assert not (tmp_path / "i.jsonl").exists()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"id": "s\udc80", "input": "x"}, "its id holds a lone surrogate"),
        ({"id": "s", "input": "x \ud800"}, "its input holds a lone surrogate"),
        ({"id": "s", "input": "x", "expected": "\udfff"}, "its expected cannot be logged"),
    ],
)
def test_items_that_cannot_be_sent_or_logged_fail_before_any_request(
    server: FakeOpenAIServer, tmp_path: Path, bad: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        run_eval(_agent(server), [*ITEMS[:3], bad], log=tmp_path / "s.jsonl")
    assert server.request_count == 0
    assert not (tmp_path / "s.jsonl").exists()


def test_the_log_records_what_was_expected(server: FakeOpenAIServer, tmp_path: Path) -> None:
    items = [{"id": "x", "input": "Lyon", "expected": {"city": "Paris"}}]
    result = run_eval(
        _agent(server),
        items,
        function(lambda s: Score(0.0, False, "wrong city")),
        log=tmp_path / "e.jsonl",
    )
    (line,) = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()[1:]]
    assert line["expected"] == {"city": "Paris"} and line["explanation"] == "wrong city"
    assert result.records[0].expected == {"city": "Paris"}


@pytest.mark.parametrize("alias", ["symlink", "hardlink"])
def test_a_second_writer_through_another_path_to_the_log_is_refused(
    tmp_path: Path, alias: str
) -> None:
    from treadle.evals.log import LogHeader, LogWriter

    log = tmp_path / "run.jsonl"
    log.touch()
    other = tmp_path / "alias.jsonl"
    if alias == "symlink":
        other.symlink_to(log)
    else:
        os.link(log, other)
    header = LogHeader("h", {}, "ds", 1, 1)
    first = LogWriter(log, header)
    try:
        with pytest.raises(EvalLogBusyError, match="is being written by another run") as refused:
            LogWriter(other, header)
    finally:
        first.close()
    # The holder is named whichever path reached the file (its note sits beside the other one).
    assert f"pid {os.getpid()} on " in str(refused.value), refused.value
    assert "has not written its name" not in str(refused.value)
    # once the first is done, the alias may write (it resumes the same log)
    LogWriter(other, header).close()
    assert len(log.read_text().splitlines()) == 1


def test_a_symlink_planted_at_the_holder_note_is_never_written_through(tmp_path: Path) -> None:
    from treadle.errors import PersistenceError
    from treadle.evals.log import LogHeader, LogWriter

    victim = tmp_path / "precious.txt"
    victim.write_text("important data\n")
    log = tmp_path / "run.jsonl"
    lock_path(log).symlink_to(victim)
    with pytest.raises(PersistenceError, match="a symlink is never followed"):
        LogWriter(log, LogHeader("h", {}, "ds", 1, 1))
    assert victim.read_text() == "important data\n"


@pytest.mark.parametrize(
    ("made", "said"),
    [
        (lambda: Score(0.5, "no"), "passed must be True or False"),  # type: ignore[arg-type]
        (lambda: Score(True, True), "must be a finite number"),
        (lambda: Score(1.0, True, explanation=123), "explanation must be"),  # type: ignore[arg-type]
    ],
)
def test_a_score_of_the_wrong_types_is_a_scorer_error_and_the_log_stays_readable(
    server: FakeOpenAIServer, tmp_path: Path, made: Any, said: str
) -> None:
    def scorer(sample: ScoreInput) -> Score:
        return made()  # type: ignore[no-any-return]

    log = tmp_path / "odd.jsonl"
    result = run_eval(_agent(server), ITEMS[:2], function(scorer), log=log)
    assert [r.error_kind for r in result.records] == ["scorer_error", "scorer_error"]
    assert said in (result.records[0].error or "")
    assert len(read_log(log).records) == 2


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"item_id": "ghost"}, "item 'ghost' is not in the dataset"),
        ({"sample": 7}, "sample 7 of item 'q0' is past samples=1"),
    ],
)
def test_a_resumed_line_outside_the_dataset_is_refused_before_any_request(
    tmp_path: Path, change: dict[str, Any], said: str
) -> None:
    requests: list[int] = []

    def script(request: dict[str, Any]) -> Reply:
        requests.append(1)
        return Reply.text(request["messages"][-1]["content"])

    with FakeOpenAIServer(script) as fake:
        log = tmp_path / "crafted.jsonl"
        run_eval(_agent(fake), ITEMS[:3], log=log)
        lines = log.read_text().splitlines()
        stranger = dict(json.loads(lines[1]), transcript=None, **change)
        log.write_text("\n".join([lines[0], lines[1], lines[2], json.dumps(stranger)]) + "\n")
        spent = len(requests)
        with pytest.raises(EvalLogDamagedError, match=f"crafted.jsonl:4: {said}"):
            run_eval(_agent(fake), ITEMS[:3], log=log)
        assert len(requests) == spent


class _ScorerQuit(BaseException):
    """A BaseException a hostile scorer raises."""


def test_a_scorer_raising_a_base_exception_re_raises_it_not_a_group(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    def scorer(sample: ScoreInput) -> bool:
        raise _ScorerQuit("scorer quits")

    with pytest.raises(_ScorerQuit, match="scorer quits"):
        run_eval(_agent(server), ITEMS[:2], function(scorer), log=tmp_path / "q.jsonl")
    assert read_log(tmp_path / "q.jsonl").records == []


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"created_at": "yesterday"}, "'created_at' is not a time"),
        ({"created_at": 1e300}, "'created_at' is not a time"),
        ({"config": {"agent": "echo"}}, "'config.agent' is not an object"),
        ({"config": {"agent": {"provider": "x"}}}, "'config.agent.provider' is not an object"),
        ({"items": -5}, "'items' and 'samples' must be counts"),
    ],
)
def test_a_header_field_of_the_wrong_type_is_a_damaged_line(
    tmp_path: Path, change: dict[str, Any], said: str
) -> None:
    header = {"type": "header", "schema": 2, "config_hash": "abc", "config": {}, "dataset": "d"}
    header |= {"items": 1, "samples": 1, "created_at": 1.0, "treadle": "0", "producer": {}}
    log = tmp_path / "bad.jsonl"
    log.write_text(json.dumps(header | change) + "\n")
    with pytest.raises(EvalLogDamagedError, match=f"bad.jsonl:1: .*{said}"):
        read_log(log)


def test_the_summary_is_computed_off_the_runtime_loop(
    server: FakeOpenAIServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import treadle.evals.run as run_module

    threads: list[bool] = []
    real = run_module.summarize

    def watched(log: Any) -> Any:
        try:
            asyncio.get_running_loop()
            threads.append(False)  # called on an event loop: a big log would stall it
        except RuntimeError:
            threads.append(True)
        return real(log)

    monkeypatch.setattr(run_module, "summarize", watched)
    result = run_eval(_agent(server), ITEMS[:2], log=tmp_path / "s.jsonl")
    assert result.summary.samples == 2
    assert threads == [True]
