"""Distributed fan-out on the process backend: spec, janitor, results file, retries, failures.

Real worker processes, the fake OpenAI server over loopback, real sandbox directories. The Ray
backend has its own module (tests/test_distributed_ray.py, `make test-ray`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from treadle import ConfigurationError, Session
from treadle.agents import Agent
from treadle.distributed import (
    OUTCOME_METADATA_KEY,
    AgentSpec,
    PassFailed,
    PassItem,
    PassOutcome,
    amap,
    clean_orphans,
    map,
    map_outcomes,
    read_results,
)
from treadle.distributed.janitor import ROOT_PREFIX, make_sandbox_root, owner_of
from treadle.distributed.worker import PassWorker
from treadle.llm import Provider
from treadle.loop import RequestUsage
from treadle.testing import FakeOpenAIServer, Reply
from treadle.testing.sample_tools import shout, shout_inputs, shout_script, shouter

_agent = shouter
_inputs = shout_inputs


def _left(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _view(session: Session) -> tuple[Any, ...]:
    return (session.to_messages(), session.stop_reason, session.usage)


def test_spec_carries_data_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_KEY", "sk-secret-value")
    provider = Provider(
        model="m",
        base_url="https://example.test/v1",
        api_key="sk-secret-value",
        temperature=0.2,
        requests_per_minute=600,
    )
    agent = Agent("a", "Be brief.", tools=[shout], provider=provider)
    spec = AgentSpec.from_agent(agent, api_key_env="MY_KEY")
    data = spec.to_json()
    assert "sk-secret-value" not in json.dumps(data)
    assert data["tools"] == ["treadle.testing.sample_tools:shout"]
    assert data["api_key_env"] == "MY_KEY"
    assert AgentSpec.from_json(json.loads(json.dumps(data))) == spec
    rebuilt = spec.build_agent(share=0.5)
    assert rebuilt.provider.api_key == "sk-secret-value"  # read from this process's environment
    assert rebuilt.provider.requests_per_minute == 300  # half of the endpoint's limit
    assert rebuilt.provider.temperature == 0.2


def test_spec_refuses_what_cannot_cross() -> None:
    def local_tool(x: int) -> int:
        return x

    provider = Provider(model="m", base_url="http://127.0.0.1:1/v1")
    with pytest.raises(ConfigurationError, match="cannot cross"):
        AgentSpec.from_agent(Agent("a", tools=[local_tool], provider=provider))
    with pytest.raises(ConfigurationError, match=r"package\.module:function"):
        AgentSpec(model="m", tools=("no_colon",))
    with pytest.raises(ConfigurationError, match="api_key"):
        AgentSpec(model="m", provider_options={"api_key": "sk-x"})


def test_janitor_removes_roots_of_dead_owners_only(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine = make_sandbox_root(tmp_path)
        host = owner_of(mine)
        assert host is not None and host[1] == os.getpid()
        orphan = tmp_path / f"{ROOT_PREFIX}{host[0]}-{dead.pid}-abcd1234"
        (orphan / "pass-1").mkdir(parents=True)
        alive = tmp_path / f"{ROOT_PREFIX}{host[0]}-{live.pid}-abcd1234"
        alive.mkdir()
        elsewhere = tmp_path / f"{ROOT_PREFIX}otherhost-{dead.pid}-abcd1234"
        elsewhere.mkdir()
        unrelated = tmp_path / "keep-me"
        unrelated.mkdir()
        assert clean_orphans(tmp_path) == [orphan]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            p.name for p in (mine, alive, elsewhere, unrelated)
        )
    finally:
        live.kill()
        live.wait()


async def test_process_backend_matches_local_and_writes_results(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    sandboxes = tmp_path / "sandboxes"
    with FakeOpenAIServer(script=shout_script) as server:
        agent = _agent(server.base_url)
        local = await amap(agent, _inputs(60), concurrency=32)
        remote = await amap(
            agent,
            _inputs(60),
            backend="process",
            workers=2,
            concurrency=16,
            results_path=str(results),
            sandbox_base=str(sandboxes),
        )
    assert [_view(s) for s in remote] == [_view(s) for s in local]
    info = remote[0].metadata[OUTCOME_METADATA_KEY]
    assert info["status"] == "ok" and info["attempts"] == 1
    outcomes = list(read_results(results))
    assert sorted(o.index for o in outcomes) == list(range(60))
    assert {o.status for o in outcomes} == {"ok"}
    assert len({o.worker for o in outcomes}) == 2  # both workers ran passes
    assert all(o.usage["requests"] == 2 and o.stop_reason == "final_answer" for o in outcomes)
    assert _left(sandboxes) == []  # every pass's and every worker's directory is gone


def _whole(session: Session) -> dict[str, Any]:
    """Everything of an output but what differs between two runs of the same pass (its ids,
    the request ids the server numbers and latencies), what says where it ran, and its lineage
    (a process backend's output is rebuilt: `from_messages`, not `run_session_loop`)."""
    metadata = {k: v for k, v in session.metadata.items() if k != OUTCOME_METADATA_KEY}
    entries = metadata.pop("request_usage")
    assert all(type(e) is RequestUsage for e in entries)
    metadata["request_usage"] = [
        dataclasses.replace(e, response_id="", request_id="", latency_seconds=0.0) for e in entries
    ]
    rows = [(type(r), r.kind, r.payload) for r in session.chunk_table]
    return {
        "rows": rows,
        "messages": session.to_messages(),
        "usage": (type(session.usage), session.usage),
        "stop_reason": session.stop_reason,
        "metadata": metadata,
    }


async def test_a_process_backends_outputs_are_the_local_backends() -> None:
    # Each output as the local backend makes it (rows, usage, stop reason, metadata and the
    # types of its frozen values), however the driver rebuilds it from what crossed.
    with FakeOpenAIServer(script=shout_script) as server:
        agent = _agent(server.base_url)
        inputs = [f"item {i}" for i in range(24)] + [Session.from_user_message("a session")]
        local = await amap(agent, inputs, concurrency=8)
        remote = await amap(agent, inputs, backend="process", workers=2, concurrency=4)
    assert [_whole(s) for s in remote] == [_whole(s) for s in local]
    assert remote[-1].metadata[OUTCOME_METADATA_KEY]["input_session_id"] == inputs[-1].id


def _faulty(request: dict[str, Any]) -> Reply:
    text = next(m["content"] for m in request["messages"] if m["role"] == "user")
    if text == "fail":
        return Reply.bad_request("this one is refused")
    if text == "slow":
        return Reply.text("late").with_latency(10_000)
    return shout_script(request)


async def test_a_failing_pass_never_stops_the_map(tmp_path: Path) -> None:
    inputs = ["a", "fail", "b", "slow", "c", 42]
    with FakeOpenAIServer(script=_faulty) as server:
        outs = await amap(
            _agent(server.base_url, max_retries=0),
            inputs,
            backend="process",
            workers=1,
            pass_timeout=1.5,  # generous: the other passes must finish under any load
            return_exceptions=True,
            sandbox_base=str(tmp_path),
        )
    assert [o.final_text for o in outs if isinstance(o, Session)] == [
        'shouted: {"ok":true,"result":"A"}',
        'shouted: {"ok":true,"result":"B"}',
        'shouted: {"ok":true,"result":"C"}',
    ]
    failed = {i: o.outcome for i, o in enumerate(outs) if isinstance(o, PassFailed)}
    assert {i: o.status for i, o in failed.items()} == {1: "error", 3: "timeout", 5: "error"}
    assert "this one is refused" in (failed[1].error or "")
    assert "Sessions or strs" in (failed[5].error or "")


async def test_a_killed_worker_has_its_passes_retried(tmp_path: Path) -> None:
    killed: list[str] = []
    outcomes: list[PassOutcome] = []
    with FakeOpenAIServer(script=shout_script, latency_ms=50) as server:
        async for outcome in map_outcomes(
            _agent(server.base_url),
            _inputs(40),
            backend="process",
            workers=2,
            concurrency=8,
            sandbox_base=str(tmp_path),
        ):
            outcomes.append(outcome)
            if not killed:  # kill the worker that just answered, while it has passes in flight
                killed.append(outcome.worker)
                os.kill(int(outcome.worker.rsplit(":", 1)[1]), signal.SIGKILL)
    assert sorted(o.index for o in outcomes) == list(range(40))
    assert {o.status for o in outcomes} == {"ok"}
    retried = [o for o in outcomes if o.attempts > 1]
    assert retried, "the killed worker had passes in flight"
    for outcome in retried:
        assert outcome.history[0]["status"] == "lost"
        assert outcome.history[0]["worker"] == killed[0]
        assert outcome.history[-1]["status"] == "ok"
        assert outcome.worker != killed[0]
    assert _left(tmp_path) == []  # the janitor removed the dead worker's sandboxes


def record_worker_init() -> None:
    """A `worker_init`: leaves a file named by this worker's pid in `TREADLE_TEST_INIT_DIR`."""
    Path(os.environ["TREADLE_TEST_INIT_DIR"], str(os.getpid())).write_text("init")


def failing_worker_init() -> None:
    """A `worker_init` that fails, as a misconfigured exporter would."""
    raise RuntimeError("no collector configured")


def test_worker_init_runs_once_in_each_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TREADLE_TEST_INIT_DIR", str(tmp_path))
    with FakeOpenAIServer(script=shout_script) as server:
        agent = _agent(server.base_url)
        outs = map(agent, _inputs(6), backend="process", workers=2, worker_init=record_worker_init)
        assert all(o.stop_reason == "final_answer" for o in outs)
        pids = sorted(int(p.name) for p in tmp_path.iterdir())
        assert len(pids) == 2 and os.getpid() not in pids
        with pytest.raises(ConfigurationError, match=r"could not start.*no collector configured"):
            map(agent, ["x"], backend="process", workers=1, worker_init=failing_worker_init)
        with pytest.raises(ConfigurationError, match=r"worker_init .* cannot cross"):
            map(agent, ["x"], backend="process", worker_init=lambda: None)
        with pytest.raises(ConfigurationError, match="worker_init path"):
            map(agent, ["x"], backend="process", worker_init="no_colon_here")


def test_items_carry_the_trace_context_as_data() -> None:
    carrier = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    item = PassItem.from_input(3, "hello", carrier)
    assert PassItem.from_json(json.loads(json.dumps(item.to_json()))) == item
    assert PassItem.from_input(3, "hello").trace_context is None  # tracing off: nothing sent


def test_a_string_input_crosses_as_the_session_from_user_message_would() -> None:
    for text in ("hello", "", "naïve ✓ text\nwith lines"):
        item = PassItem.from_input(0, text)
        assert item.messages == Session.from_user_message(text).to_messages()
        assert item.placement is None and item.placement_options is None
    ids = {PassItem.from_input(i, "same").session_id for i in range(50)}
    assert len(ids) == 50 and all(len(i) == 32 for i in ids)  # fresh ids, as a session's
    with pytest.raises(ConfigurationError):
        PassItem.from_input(0, 42)


def test_sync_map_and_argument_errors(tmp_path: Path) -> None:
    with FakeOpenAIServer(script=shout_script) as server:
        agent = _agent(server.base_url)
        outs = map(agent, ["x", "y"], backend="process", workers=1, sandbox_base=str(tmp_path))
        assert [o.final_text for o in outs] == [
            'shouted: {"ok":true,"result":"X"}',
            'shouted: {"ok":true,"result":"Y"}',
        ]
        with pytest.raises(ConfigurationError, match="shared"):
            map(agent, ["x"], backend="process", rate_limit="shared")
        with pytest.raises(ConfigurationError, match="apply to backend"):
            map(agent, ["x"], workers=2, ray_address="auto")
        with pytest.raises(ConfigurationError, match="not a backend"):
            map(agent, ["x"], backend="dask")


def _keyed_agent(base_url: str, key: str) -> Agent:
    return Agent(
        "keyed", "Answer.", provider=Provider(model="fake", base_url=base_url, api_key=key)
    )


async def test_an_explicit_key_reaches_process_workers_over_their_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An explicit Provider(api_key=...) used to be dropped silently on the process backend, so
    # every item failed with 401 against an endpoint that needs the key. It now travels to each
    # worker over its private socketpair (never argv, environment or the JSON spec).
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with FakeOpenAIServer(script="echo", api_key="sk-required-key") as server:
        agent = _keyed_agent(server.base_url, "sk-required-key")
        assert "sk-required-key" not in json.dumps(AgentSpec.from_agent(agent).to_json())
        outs = await amap(agent, ["a", "b"], backend="process", workers=1)
        assert [o.final_text for o in outs] == ["a", "b"]
        auth = {r.headers.get("authorization") for r in server.requests}
        assert auth == {"Bearer sk-required-key"}


def test_an_explicit_key_ray_workers_cannot_see_is_refused_at_the_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from treadle.distributed.spec import check_key_reaches_workers

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="OPENAI_API_KEY, which here is not set") as e:
        check_key_reaches_workers("keyed", "sk-required-key", "OPENAI_API_KEY")
    assert "sk-required-key" not in str(e.value)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-other-key")
    with pytest.raises(ConfigurationError, match="holds a different key"):
        check_key_reaches_workers("keyed", "sk-required-key", "OPENAI_API_KEY")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-required-key")
    check_key_reaches_workers("keyed", "sk-required-key", "OPENAI_API_KEY")  # same key: fine


async def test_the_key_in_the_environment_reaches_process_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MY_TREADLE_KEY", "sk-required-key")
    with FakeOpenAIServer(script="echo", api_key="sk-required-key") as server:
        agent = _keyed_agent(server.base_url, "sk-required-key")
        outs = await amap(
            agent, ["a", "b"], backend="process", workers=1, api_key_env="MY_TREADLE_KEY"
        )
        assert [o.final_text for o in outs] == ["a", "b"]
        auth = {r.headers.get("authorization") for r in server.requests}
        assert auth == {"Bearer sk-required-key"}


def _with_role(role: Any) -> Session:
    session = Session.from_user_message("x")
    session.rows[0].payload["role"] = role  # a row edited after it was validated
    return session


async def test_an_input_a_worker_cannot_rebuild_fails_alone_and_the_map_completes() -> None:
    # A row whose role no Treadle sends made the worker raise outside its pass's `try`: the
    # task died ("Task exception was never retrieved"), no outcome came, and the map hung.
    inputs = ["a", _with_role("narrator"), "b", _with_role(7), _with_role(None), "c"]
    with FakeOpenAIServer(script=shout_script) as server:
        outs = await asyncio.wait_for(  # a guard against a hang, not a timing assertion
            amap(
                _agent(server.base_url),
                inputs,
                backend="process",
                workers=1,
                return_exceptions=True,
            ),
            120,
        )
    assert [o.final_text for o in outs if isinstance(o, Session)] == [
        'shouted: {"ok":true,"result":"A"}',
        'shouted: {"ok":true,"result":"B"}',
        'shouted: {"ok":true,"result":"C"}',
    ]
    failed = {i: o.outcome for i, o in enumerate(outs) if isinstance(o, PassFailed)}
    assert {i: o.status for i, o in failed.items()} == {1: "error", 3: "error", 4: "error"}
    assert "ConfigurationError: message 0: field 'role': 'narrator'" in (failed[1].error or "")
    assert "message 0" in (failed[3].error or "") and "role" in (failed[3].error or "")
    assert "message 0" in (failed[4].error or "") and "role" in (failed[4].error or "")


async def test_every_per_item_failure_in_a_worker_is_that_items_outcome(tmp_path: Path) -> None:
    with FakeOpenAIServer(script=shout_script) as server:
        spec = AgentSpec.from_agent(_agent(server.base_url))
        worker = PassWorker(spec, sandbox_base=str(tmp_path))
        try:
            item = PassItem(3, "s-3", [{"role": "user", "content": "ok"}]).to_json()
            not_a_dict = {**item, "messages": [5]}
            not_a_list = {**item, "messages": None}
            outs = [await worker.run_json(i) for i in (item, not_a_dict, not_a_list)]
            broken = await worker.run_json({"index": 9, "bogus": True})  # no item at all
            nothing = await worker.run_json(None)
        finally:
            worker.close()
    assert [o["status"] for o in outs] == ["ok", "error", "error"]
    assert [o["index"] for o in outs] == [3, 3, 3]
    assert "ConfigurationError: message 0" in outs[1]["error"]
    assert outs[2]["error"].startswith("TypeError")
    # A pass that failed sends every key an outcome's `to_json` has, as one that finished does.
    shape = PassOutcome(3, "s-3", "error", 1, "w").to_json().keys()
    assert outs[1].keys() == outs[2].keys() == shape
    assert (broken["index"], broken["status"]) == (9, "error")
    assert "input 9 could not be run" in broken["error"]
    assert (nothing["index"], nothing["status"]) == (-1, "error")
