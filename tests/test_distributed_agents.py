"""Agents with code parts on the process backend: structured output, a validator that sends the
model back, an input guardrail, hooks and a handoff all run in the workers, because the agent
crosses by its import path; what cannot cross is refused at the call, named. And `workers=N` on
`backend="local"`."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from treadle import ConfigurationError, Session
from treadle.agents import Agent, handoff
from treadle.distributed import (
    AgentSpec,
    PassFailed,
    PassLost,
    amap,
    map,
    map_outcomes,
    read_results,
)
from treadle.distributed.backends import local_concurrency
from treadle.distributed.mapping import _result
from treadle.distributed.outcome import PassItem, PassOutcome
from treadle.distributed.process import ProcessPool
from treadle.errors import WorkerLost
from treadle.llm import Provider
from treadle.loop import Guardrail, GuardrailResult, Hooks, RequestUsage, Tripwire
from treadle.testing import FakeOpenAIServer
from treadle.testing.sample_agents import Capital, geographer, geographer_script, librarian
from treadle.tools import tool

PATH = "treadle.testing.sample_agents:geographer"

typed = Agent[None, Capital]("typed", provider=Provider(model="fake"), output_type=Capital)
"""Built through the generic alias: its import path is still found (this module, `typed`)."""


def test_an_agent_with_code_parts_crosses_by_its_import_path() -> None:
    spec = AgentSpec.from_agent(geographer)
    assert spec.agent_path == PATH
    assert spec.tools == ()  # the worker gets them with the agent
    data = json.loads(json.dumps(spec.to_json()))
    assert AgentSpec.from_json(data) == spec
    assert AgentSpec.from_agent(PATH) == spec  # the same, named by its path
    rebuilt = spec.build_agent(share=0.5)
    assert rebuilt is not geographer
    assert rebuilt.output_type is Capital
    # the handoff target, defined on the same provider, moves to the worker's one with it
    [moved] = rebuilt.handoffs
    assert moved.tool_name == geographer.handoffs[0].tool_name
    assert moved.agent is not librarian and moved.agent.provider is rebuilt.provider
    assert moved.agent.output_type is Capital
    assert rebuilt.validators == geographer.validators
    assert rebuilt.provider.model == "fake"


def test_a_typed_agent_is_found_through_the_generic_alias() -> None:
    spec = AgentSpec.from_agent(typed)
    assert spec.agent_path is not None and spec.agent_path.endswith(":typed")
    assert spec.agent_path.split(":")[0] == __name__


def test_what_cannot_cross_is_refused_by_name() -> None:
    provider = Provider(model="fake", base_url="http://127.0.0.1:1/v1")
    local = Agent("local", provider=provider, guardrails=[Guardrail(lambda data: None)])
    with pytest.raises(
        ConfigurationError, match=r"'local' cannot cross.*agent.guardrails\[0\].check is a lambda"
    ):
        AgentSpec.from_agent(local)
    with pytest.raises(ConfigurationError, match="cannot cross"):
        map(local, ["x"], backend="process")
    with pytest.raises(ConfigurationError, match=r"not an Agent|needs an Agent"):
        AgentSpec.from_agent("treadle.testing.sample_agents:Capital")


async def test_structured_output_validator_guardrail_hooks_and_handoff_in_process_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    log = tmp_path / "hooks.log"
    monkeypatch.setenv("TREADLE_SAMPLE_HOOK_LOG", str(log))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    with FakeOpenAIServer(script=geographer_script) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        inputs = ["capital of France", "forbidden capital of Spain", "books about Italy"]
        outs = await amap(geographer, inputs, backend="process", workers=1)
    capital, blocked, handed = outs
    # structured output crossed back as the caller's type, after the validator's retry
    assert capital.output == Capital(country="France", city="Paris")
    assert capital.metadata["agent"] == "geographer"
    assert capital.usage.requests == 2
    # the input guardrail ran in the worker and tripped
    assert blocked.stop_reason == "blocked"
    assert blocked.tripwire == Tripwire("forbidden topic", "no_forbidden", "input")
    [result] = blocked.metadata["guardrail_results"]
    assert isinstance(result, GuardrailResult) and result.tripped
    # the handoff happened in the worker, on the same transcript
    assert handed.metadata["agent"] == librarian.name
    assert [h["to"] for h in handed.metadata["handoffs"]] == ["librarian"]
    assert handed.output == Capital(country="Italy", city="Paris")
    entries = handed.metadata["request_usage"]
    assert [type(e) for e in entries] == [RequestUsage, RequestUsage]
    assert [e.agent for e in entries] == ["geographer", "librarian"]
    assert all(e.input_tokens > 0 for e in entries)
    # the hooks ran in the worker process, not here
    lines = log.read_text().splitlines()
    assert {line.split()[0] for line in lines} != {str(os.getpid())}
    assert sum(1 for line in lines if line.endswith("start geographer")) == 3


def test_a_handoff_targets_output_comes_back_as_its_own_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import typed_handoff_agents as agents

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    with FakeOpenAIServer(script=agents.script) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        local = agents.routed("judge this")
        local.synchronize()
        judged, kept = map(agents.routed, ["judge this", "plain"], backend="process", workers=1)
        [untyped] = map(agents.untyped, ["judge this"], backend="process", workers=1)
    assert local.output == agents.Verdict(who="B", score=0.5)
    # as locally: the judge answered, so its type, not the router's
    assert judged.metadata["agent"] == "judge" and judged.output == local.output
    assert kept.metadata["agent"] == "routed" and kept.output == agents.Label(label="kept")
    assert untyped.output == local.output


def test_an_output_that_cannot_be_rebuilt_fails_only_its_item() -> None:
    # What a worker sends when its type differs from the caller's (another version of it).
    outcome = PassOutcome(
        0,
        "s0",
        "ok",
        1,
        "host:1",
        messages=[{"role": "user", "content": "x"}],
        metadata={"agent": "typed", "output": {"town": "Paris"}},
    )
    failed = _result(outcome, typed)
    assert isinstance(failed, PassFailed)
    assert failed.outcome.status == "error" and failed.outcome.metadata == outcome.metadata
    assert "could not be rebuilt here as Capital" in str(failed)
    assert "country" in str(failed)
    fits = dataclasses.replace(outcome, metadata={"output": {"country": "F", "city": "P"}})
    rebuilt = _result(fits, typed)
    assert isinstance(rebuilt, Session) and rebuilt.output == Capital(country="F", city="P")


def _refusal(agent: Agent) -> str:
    with pytest.raises(ConfigurationError) as caught:
        AgentSpec.from_agent(agent)
    message = str(caught.value)
    assert "cannot cross to a worker" in message
    assert "Fix: define the agent and those parts at the top level of an importable" in message
    return message


def test_the_refusal_names_each_part_that_cannot_be_imported_by_attribute_path() -> None:
    provider = Provider(model="fake", base_url="http://127.0.0.1:1/v1")

    def make_check() -> Any:
        def check(data: Any) -> None:
            return None

        return check

    class LocalHooks(Hooks):
        pass

    gated = Agent("gated", provider=provider, handoffs=[handoff(librarian, is_enabled=lambda s: 1)])
    assert "agent.handoffs[0].is_enabled is a lambda" in _refusal(gated)
    assert "not a top-level name of an importable module" in _refusal(gated)
    guarded = Agent("guarded", provider=provider, guardrails=[Guardrail(make_check(), "input")])
    assert "agent.guardrails[0].check is a function 'check' defined inside make_check()" in (
        _refusal(guarded)
    )
    hooked = Agent("hooked", provider=provider, hooks=LocalHooks())
    assert "agent.hooks is an instance of class 'LocalHooks' defined inside" in _refusal(hooked)
    # a part of a handoff target is named through the target
    inner = Agent("inner", provider=provider, handoffs=[handoff(librarian, on_handoff=print)])
    outer = Agent(
        "outer",
        provider=provider,
        handoffs=[handoff(inner, input_filter=lambda s: s)],
        output_validators=[lambda v: v],
    )
    message = _refusal(outer)
    assert "agent.handoffs[0].input_filter is a lambda" in message
    assert "agent.handoffs[0].agent is Agent 'inner', built inside a function" in message
    assert "agent.validators[0] is a lambda" in message
    assert "librarian" not in message  # importable parts are not blamed
    assert "print" not in message
    # tools of handoff targets, a partial, and an agent tool's own parts (not library code)
    local_tool = tool(make_check())
    target = Agent("target", provider=provider, tools=[local_tool])
    asker = Agent("asker", provider=provider)
    wide = Agent(
        "wide",
        provider=provider,
        guardrails=[Guardrail(functools.partial(print, "x"))],
        tools=[asker.as_tool(output_extractor=lambda s: s.final_text)],
        handoffs=[target],
    )
    message = _refusal(wide)
    assert "agent.handoffs[0].agent.tools[0] is a function 'check' defined inside" in message
    assert "agent.guardrails[0].check is a functools.partial of 'print'" in message
    assert "agent.tools[0].output_extractor is a lambda" in message
    assert "agent.tools[0].agent is Agent 'asker', built inside a function" in message
    assert "delegate" not in message and "agent_tool" not in message


def test_an_agent_and_hooks_defined_in_main_are_refused_by_name(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        "from treadle.agents import Agent\n"
        "from treadle.distributed import AgentSpec\n"
        "from treadle.llm import Provider\n"
        "from treadle.loop import Hooks\n"
        "class Audit(Hooks):\n"
        "    pass\n"
        "agent = Agent('scripted', provider=Provider(model='m'), hooks=Audit())\n"
        "try:\n"
        "    AgentSpec.from_agent(agent)\n"
        "except Exception as err:\n"
        "    print(type(err).__name__, err)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ConfigurationError Agent 'scripted' cannot cross")
    assert "it is defined in __main__ (your script), which workers never run" in done.stdout
    assert (
        "agent.hooks is an instance of class 'Audit' defined in __main__, which workers never run"
        in done.stdout
    )


def test_local_backend_takes_workers() -> None:
    assert local_concurrency(3, None) == 3
    assert local_concurrency(3, 2) == 6
    with pytest.raises(ConfigurationError, match="workers must be"):
        local_concurrency(3, 0)
    with FakeOpenAIServer(script="echo", latency_ms=20) as server:
        agent = Agent("echo", "Echo.", provider=Provider(model="m", base_url=server.base_url))
        outs = map(agent, [f"m{i}" for i in range(6)], concurrency=1, workers=2)
        assert [o.final_text for o in outs] == [f"m{i}" for i in range(6)]
        assert server.max_in_flight <= 2
    with pytest.raises(ConfigurationError, match="workers must be"):
        map(agent, ["x"], workers=0)


async def test_an_output_the_results_file_cannot_hold_fails_only_its_item(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The worker's output is bytes / a lone surrogate: the results file cannot encode it as
    # JSON. That item's outcome is an error naming the value (also in the file); the others
    # are written (the whole map failed with PydanticSerializationError).
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    inputs = ["a", "bytes", "surrogate", "d"]
    results = tmp_path / "r.jsonl"
    with FakeOpenAIServer(script="echo") as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        streamed = {
            o.index: o
            async for o in map_outcomes(
                "exiting_agents:unwritable",
                inputs,
                backend="process",
                workers=1,
                sandbox_base=str(tmp_path),
                results_path=str(results),
            )
        }
        outs = await amap(
            "exiting_agents:unwritable",
            inputs,
            backend="process",
            workers=1,
            sandbox_base=str(tmp_path),
            results_path=str(tmp_path / "r2.jsonl"),
            return_exceptions=True,
        )
    written = {o.index: o for o in read_results(results)}
    assert sorted(written) == [0, 1, 2, 3]
    for outcomes in (streamed, written):
        assert [outcomes[i].status for i in range(4)] == ["ok", "error", "error", "ok"]
        assert [outcomes[i].messages[-1]["content"] for i in (0, 3)] == ["a", "d"]
        for i, kind in ((1, "bytes"), (2, "str")):
            error = outcomes[i].error
            assert error is not None and error.startswith("ResultsFileError: "), error
            assert f"['metadata']['output'] ({kind})" in error, error
            assert outcomes[i].messages is None and outcomes[i].metadata == {}
    assert [type(o) for o in outs] == [Session, PassFailed, PassFailed, Session]
    assert "ResultsFileError" in str(outs[1])


@pytest.mark.slow  # five worker processes start (two, then one per loss): several seconds
def test_a_hook_exiting_its_worker_fails_only_its_own_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    inputs = [f"item {i}" for i in range(8)]
    inputs[2] = "poison"
    # Replies take a while, so the poisoned pass's worker has other passes in flight when it
    # dies; they are retried (alone) and finish.
    with FakeOpenAIServer(script="echo", latency_ms=300) as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        outs = map(
            "exiting_agents:poisoned",
            inputs,
            backend="process",
            workers=2,
            max_attempts=2,
            return_exceptions=True,
        )
    lost = outs[2]
    assert isinstance(lost, PassLost) and isinstance(lost, WorkerLost)
    assert lost.outcome.status == "lost" and lost.outcome.attempts == 2
    assert [h["status"] for h in lost.outcome.history] == ["lost", "lost"]
    assert "WorkerLost" in str(lost)
    others = [o for i, o in enumerate(outs) if i != 2]
    assert all(isinstance(o, Session) for o in others), others
    assert [o.final_text for o in others] == [t for t in inputs if t != "poison"]
    # some bystanders were on the worker when it died: lost once, then finished elsewhere
    retried = [o for o in others if o.metadata["treadle.distributed"]["attempts"] == 2]
    assert retried
    with pytest.raises(PassLost, match="status 'lost'"):
        map("exiting_agents:poisoned", ["poison"], backend="process", workers=1, max_attempts=1)


@pytest.mark.slow  # a worker process starts: about 3 s on this machine
async def test_a_worker_exits_at_once_past_a_hook_still_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import exiting_agents

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    with FakeOpenAIServer(script="echo") as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        pool = ProcessPool(AgentSpec.from_agent(exiting_agents.hanging).to_json(), size=1)
        await pool.start()
        [worker] = pool._workers
        assert worker is not None
        try:
            outcome = await pool.run(0, PassItem.from_input(0, "hang"))
        finally:
            await pool.close()
    assert outcome.status == "ok" and outcome.stop_reason == "deadline"
    # It left by itself once asked to stop (exit code 0), without joining the hook's thread
    # (asleep for HANG_SECONDS) until the driver's stop grace ran out and it was killed (-9).
    assert worker.process.returncode == 0
