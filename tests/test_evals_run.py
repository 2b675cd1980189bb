"""Evaluation runs over the fake server: scorers, retries, resume, sandboxes, backends, datasets."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pytest
from pydantic_core import from_json

from treadle import Agent, ConfigurationError, Provider
from treadle.evals import (
    Dataset,
    Item,
    Score,
    ScoreInput,
    arun_eval,
    contains,
    exact,
    function,
    judge,
    read_log,
    run_eval,
    structured,
)
from treadle.testing import FakeOpenAIServer, Reply

ITEMS = [
    {"id": "a", "input": "Paris", "expected": "Paris", "metadata": {"tags": ["geo"]}},
    {"id": "b", "input": "the answer is 42", "expected": "42", "metadata": {"tags": ["math"]}},
    {"id": "c", "input": "LONDON", "expected": ["london", "London"]},
]


def _script(request: dict[str, Any]) -> Reply:
    messages = request["messages"]
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    last = messages[-1]
    if system.startswith("Judge"):
        text = last["content"]
        if "silent" in system:
            return Reply.text("I cannot decide.")
        answer = text.split("[Answer to grade]\n", 1)[1].split("\n", 1)[0]
        return Reply.text(f"Reasoning...\nGRADE: {'C' if '42' in answer else 'I'}")
    if last["role"] == "tool":  # sandbox test: answer with what the tool read
        return Reply.text(json.loads(last["content"])["data"].strip())
    if last["content"].startswith("read "):
        return Reply.tool_call("read_workspace_file", {"path": last["content"][5:]})
    return Reply.text(last["content"])


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(_script) as fake:
        yield fake


def _agent(server: FakeOpenAIServer, name: str = "solver", instructions: str = "Solve.") -> Agent:
    provider = Provider(model="fake-model", base_url=server.base_url, api_key="k", max_retries=0)
    return Agent(name, instructions, provider=provider)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_exact_and_contains_scorers(server: FakeOpenAIServer, tmp_path: Path) -> None:
    agent = _agent(server)
    by_exact = run_eval(agent, ITEMS, exact(), log=tmp_path / "exact.jsonl")
    scores = {r.item_id: r.passed for r in by_exact.records}
    assert scores == {"a": True, "b": False, "c": False}
    folded = run_eval(agent, ITEMS, exact(ignore_case=True), log=tmp_path / "fold.jsonl")
    assert {r.item_id: r.passed for r in folded.records} == {"a": True, "b": False, "c": True}
    found = run_eval(agent, ITEMS, contains(), log=tmp_path / "contains.jsonl")
    assert {r.item_id: r.passed for r in found.records} == {"a": True, "b": True, "c": False}
    assert found.summary.pass_rate == pytest.approx(2 / 3)
    assert found.summary.by_tag["math"].pass_rate == 1.0


def test_function_scorer_forms(server: FakeOpenAIServer, tmp_path: Path) -> None:
    agent = _agent(server)

    def length(sample: ScoreInput) -> float:
        return min(len(sample.answer or "") / 10, 1.0)

    result = run_eval(agent, ITEMS, function(length, pass_threshold=0.5), log=tmp_path / "f.jsonl")
    values = {r.item_id: (r.score, r.passed) for r in result.records}
    assert values == {"a": (0.5, True), "b": (1.0, True), "c": (0.6, True)}
    assert result.summary.score.method == "t"

    async def async_bool(sample: ScoreInput) -> bool:
        return sample.item.id == "a"

    result = run_eval(agent, ITEMS, async_bool, log=tmp_path / "g.jsonl")
    assert sum(r.passed for r in result.records) == 1

    def broken(sample: ScoreInput) -> Any:
        return "yes"  # neither a Score, a bool nor a number

    result = run_eval(agent, ITEMS, broken, log=tmp_path / "h.jsonl")
    assert {r.error_kind for r in result.records} == {"scorer_error"}
    assert server.request_count == 9  # a scorer's failure is not retried


class Answer(pydantic.BaseModel):
    city: str
    population_millions: float


def test_structured_scorer() -> None:
    scorer = structured(Answer)
    item = Item("x", "q", expected={"city": "Paris", "population_millions": 2.1})

    async def score(answer: str | None, output: Any = None) -> Score:
        return await scorer.score(ScoreInput(item, answer, output, None, None))

    import asyncio

    ok = asyncio.run(score('{"city": "Paris", "population_millions": 2.1}'))
    assert ok.passed and ok.value == 1.0
    wrong = asyncio.run(score('{"city": "Lyon", "population_millions": 0.5}'))
    assert not wrong.passed and "not the expected" in (wrong.explanation or "")
    invalid = asyncio.run(score('{"city": "Paris"}'))
    assert not invalid.passed and "population_millions" in (invalid.explanation or "")
    not_json = asyncio.run(score("Paris, 2.1 million"))
    assert not not_json.passed
    typed = asyncio.run(score(None, Answer(city="Paris", population_millions=2.1)))
    assert typed.passed


def test_structured_scorer_on_an_agent_output_type(tmp_path: Path) -> None:
    def script(request: dict[str, Any]) -> Reply:
        return Reply.tool_call("final_result", {"city": "Paris", "population_millions": 2.1})

    with FakeOpenAIServer(script) as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        agent = Agent("typed", "Answer.", provider=provider, output_type=Answer)
        items = [
            Item("p", "Paris?", expected={"city": "Paris", "population_millions": 2.1}),
            Item("l", "Lyon?", expected={"city": "Lyon", "population_millions": 0.5}),
        ]
        result = run_eval(agent, items, structured(Answer), log=tmp_path / "s.jsonl")
    assert {r.item_id: r.passed for r in result.records} == {"p": True, "l": False}


def test_llm_judge_is_an_agent(server: FakeOpenAIServer, tmp_path: Path) -> None:
    grader = judge(_agent(server, "judge", "Judge the answer."), rubric="42 is right.")
    result = run_eval(_agent(server), ITEMS, grader, log=tmp_path / "j.jsonl")
    assert {r.item_id: r.passed for r in result.records} == {"a": False, "b": True, "c": False}
    assert "GRADE: C" in (next(r for r in result.records if r.item_id == "b").explanation or "")
    silent = judge(_agent(server, "judge", "Judge, silent."))
    result = run_eval(_agent(server), ITEMS, silent, log=tmp_path / "k.jsonl")
    assert {r.error_kind for r in result.records} == {"scorer_error"}


def test_infrastructure_failures_are_retried(server: FakeOpenAIServer, tmp_path: Path) -> None:
    server.add_fault(Reply.server_error(500), times=3)
    result = run_eval(_agent(server), ITEMS, exact(), log=tmp_path / "r.jsonl", concurrency=1)
    assert result.summary.retries == 3 and result.summary.errors == {}
    assert [r.item_id for r in result.records if r.passed] == ["a"]

    server.add_fault(Reply.server_error(503), times=3)
    result = run_eval(
        _agent(server), ITEMS, exact(), log=tmp_path / "s.jsonl", max_retries=0, concurrency=1
    )
    assert result.summary.errors == {"server_error": 3}
    assert all(r.score == 0.0 and not r.passed for r in result.records)


def test_non_retryable_failures_are_logged_once(tmp_path: Path) -> None:
    with FakeOpenAIServer(lambda request: Reply.bad_request("no")) as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        result = run_eval(Agent("s", provider=provider), ITEMS, exact(), log=tmp_path / "b.jsonl")
        assert fake.request_count == 3
    assert result.summary.errors == {"bad_request": 3} and result.summary.retries == 0


def test_sample_timeout_is_an_infrastructure_failure(tmp_path: Path) -> None:
    def slow(request: dict[str, Any]) -> Reply:
        return Reply.text("late").with_latency(5000)

    with FakeOpenAIServer(slow) as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        result = run_eval(
            Agent("slow", provider=provider),
            ITEMS[:1],
            exact(),
            log=tmp_path / "t.jsonl",
            sample_timeout=0.2,
            max_retries=1,
        )
    (record,) = result.records
    assert record.error_kind == "timeout" and record.retries == 1


def test_samples_per_item_and_pass_at_k(server: FakeOpenAIServer, tmp_path: Path) -> None:
    result = run_eval(_agent(server), ITEMS, contains(), log=tmp_path / "k.jsonl", samples=4)
    assert len(result.records) == 12
    assert sorted({(r.item_id, r.sample) for r in result.records}) == [
        (i, j) for i in "abc" for j in range(4)
    ]
    assert result.summary.pass_at_k == pytest.approx({1: 2 / 3, 2: 2 / 3, 4: 2 / 3})


def test_resume_refuses_another_configuration(server: FakeOpenAIServer, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    run_eval(_agent(server), ITEMS, exact(), log=log)
    for agent, items, scorer in (
        (_agent(server), ITEMS, contains()),
        (_agent(server, instructions="Other."), ITEMS, exact()),
        (_agent(server), ITEMS[:2], exact()),
    ):
        with pytest.raises(ConfigurationError, match="different configuration"):
            run_eval(agent, items, scorer, log=log)
    assert len(_lines(log)) == 4  # untouched
    again = run_eval(_agent(server), ITEMS, exact(), log=log)  # same config: nothing to do
    assert len(again.records) == 3 and server.request_count == 3


def test_resume_cuts_a_torn_line_and_runs_what_is_missing(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    log = tmp_path / "log.jsonl"
    run_eval(_agent(server), ITEMS, exact(), log=log, samples=2)
    lines = log.read_bytes().splitlines(keepends=True)
    torn = lines[-1][: len(lines[-1]) // 2]
    log.write_bytes(b"".join(lines[:-2]) + torn)  # two samples lost, the second one torn
    assert len(read_log(log).records) == 4
    result = run_eval(_agent(server), ITEMS, exact(), log=log, samples=2)
    keys = [(r["item_id"], r["sample"]) for r in _lines(log)[1:]]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 6
    assert server.request_count == 8 and len(result.records) == 6
    assert all(from_json(line) for line in log.read_bytes().splitlines())


def test_sandbox_gives_each_sample_its_files(server: FakeOpenAIServer, tmp_path: Path) -> None:
    items = [
        Item(
            f"f{i}",
            "read notes/in.txt",
            files={"notes/in.txt": f"content {i}\n"},
            expected=f"content {i}",
        )
        for i in range(4)
    ]
    seen: list[Path] = []

    def check(sample: ScoreInput) -> bool:
        assert sample.workspace is not None
        seen.append(sample.workspace)
        return (sample.workspace / "notes" / "in.txt").read_text().strip() == sample.answer

    with pytest.raises(ConfigurationError, match="sandbox=True"):
        run_eval(_agent(server), items, check, log=tmp_path / "no.jsonl")
    result = run_eval(_agent(server), items, check, log=tmp_path / "w.jsonl", sandbox=True)
    assert all(r.passed for r in result.records), [r.error for r in result.records]
    assert len(set(seen)) == 4 and not any(p.exists() for p in seen)
    exact_result = run_eval(
        _agent(server), items, exact(), log=tmp_path / "e.jsonl", sandbox=True, samples=2
    )
    assert exact_result.summary.pass_rate == 1.0


def test_process_backend(server: FakeOpenAIServer, tmp_path: Path) -> None:
    server.add_fault(Reply.server_error(500), times=2)
    result = run_eval(
        _agent(server), ITEMS, contains(), log=tmp_path / "p.jsonl", backend="process", workers=1
    )
    assert {r.item_id: r.passed for r in result.records} == {"a": True, "b": True, "c": False}
    assert all(r.usage["requests"] == 1 for r in result.records)
    assert result.summary.retries == 2 and result.summary.errors == {}
    files = [
        Item(f"f{i}", "read in.txt", files={"in.txt": f"c{i}"}, expected=f"c{i}") for i in range(4)
    ]
    result = run_eval(
        _agent(server),
        files,
        exact(),
        log=tmp_path / "w.jsonl",
        backend="process",
        workers=2,
        sandbox=True,
    )
    assert result.summary.pass_rate == 1.0, [r.error for r in result.records]


def test_callable_agent_on_the_local_backend(tmp_path: Path) -> None:
    from treadle import Session

    async def shout(session: Session) -> Session:
        text = session.to_messages()[-1]["content"]
        return Session.from_messages(
            [*session.to_messages(), {"role": "assistant", "content": text.title()}]
        )

    result = run_eval(shout, ITEMS, exact(), log=tmp_path / "c.jsonl")
    assert {r.item_id: r.passed for r in result.records} == {"a": True, "b": False, "c": True}
    assert result.records[0].transcript is not None


async def test_async_entry_point_and_progress(server: FakeOpenAIServer, tmp_path: Path) -> None:
    seen: list[int] = []
    result = await arun_eval(
        _agent(server),
        ITEMS,
        exact(),
        log=tmp_path / "a.jsonl",
        progress=lambda p: seen.append(p.done),
    )
    assert seen == [0, 1, 2, 3] and result.summary.samples == 3
    with pytest.raises(ConfigurationError, match="arun_eval"):
        run_eval(_agent(server), ITEMS, log=tmp_path / "b.jsonl")


def test_dataset_validation(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="twice"):
        Dataset([{"id": "a", "input": "x"}, {"id": "a", "input": "y"}])
    with pytest.raises(ConfigurationError, match="unknown item keys"):
        Dataset([{"id": "a", "input": "x", "answer": "y"}])
    with pytest.raises(ConfigurationError, match="leaves the workspace"):
        Item("a", "x", files={"../escape": "no"})
    with pytest.raises(ConfigurationError, match="no items"):
        Dataset([])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "input": "x"}\n\n{not json}\n')
    with pytest.raises(ConfigurationError, match=r"bad.jsonl:3"):
        Dataset.from_jsonl(bad)
    good = tmp_path / "good.jsonl"
    good.write_text('{"id": 1, "input": "x", "expected": "y"}\n')
    data = Dataset.from_jsonl(good)
    assert data[0].id == "1" and data.name == "good" and len(data.hash) == 64
    with pytest.raises(ConfigurationError, match="samples"):
        run_eval(lambda s: s, data, log=tmp_path / "x.jsonl", samples=0)


async def test_cancelled_run_closes_its_log_and_removes_workspaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    items = [Item(f"i{i}", f"x{i}", files={"f.txt": "x"}, expected=f"x{i}") for i in range(40)]

    def script(request: dict[str, Any]) -> Reply:
        text = request["messages"][-1]["content"]
        return Reply.text(text).with_latency(5 if text in ("x0", "x1") else 5000)

    with FakeOpenAIServer(script) as fake:
        provider = Provider(model="fake-model", base_url=fake.base_url, api_key="k")
        agent = Agent("slow", provider=provider)
        log = tmp_path / "log.jsonl"
        done = asyncio.Event()

        def progress(state: Any) -> None:
            if state.done == 2:
                done.set()

        task = asyncio.ensure_future(
            arun_eval(agent, items, exact(), log=log, sandbox=True, progress=progress)
        )
        await asyncio.wait_for(done.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert list((tmp_path / "tmp").iterdir()) == []  # every workspace removed
        assert {r.item_id for r in read_log(log).records} == {"i0", "i1"}
        assert log.read_bytes().endswith(b"\n")


def test_a_failing_progress_callback_does_not_stop_the_run(
    server: FakeOpenAIServer, tmp_path: Path
) -> None:
    def progress(state: Any) -> None:
        if state.done == 1:
            raise BrokenPipeError("stdout went away")

    log = tmp_path / "p.jsonl"
    with pytest.raises(BrokenPipeError) as caught:
        run_eval(_agent(server), ITEMS, exact(), log=log, progress=progress, concurrency=1)
    assert "went on to the end" in str(caught.value.__notes__)
    assert len(read_log(log).records) == 3
