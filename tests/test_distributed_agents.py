"""Agents with code parts on the process backend: structured output, a validator that sends the
model back, an input guardrail, hooks and a handoff all run in the workers, because the agent
crosses by its import path; what cannot cross is refused at the call, named. And `workers=N` on
`backend="local"`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from treadle import ConfigurationError
from treadle.agents import Agent
from treadle.distributed import AgentSpec, amap, map
from treadle.distributed.backends import local_concurrency
from treadle.llm import Provider
from treadle.loop import Guardrail
from treadle.testing import FakeOpenAIServer
from treadle.testing.sample_agents import Capital, geographer, geographer_script, librarian

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
    assert rebuilt.handoffs == geographer.handoffs
    assert rebuilt.validators == geographer.validators
    assert rebuilt.provider.model == "fake"


def test_a_typed_agent_is_found_through_the_generic_alias() -> None:
    spec = AgentSpec.from_agent(typed)
    assert spec.agent_path is not None and spec.agent_path.endswith(":typed")
    assert spec.agent_path.split(":")[0] == __name__


def test_what_cannot_cross_is_refused_by_name() -> None:
    provider = Provider(model="fake", base_url="http://127.0.0.1:1/v1")
    local = Agent("local", provider=provider, guardrails=[Guardrail(lambda data: None)])
    with pytest.raises(ConfigurationError, match=r"'local' cannot cross.*<lambda>"):
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
    assert blocked.metadata["tripwire"]["reason"] == "forbidden topic"
    assert blocked.metadata["guardrail_results"][0]["tripped"] is True
    # the handoff happened in the worker, on the same transcript
    assert handed.metadata["agent"] == librarian.name
    assert [h["to"] for h in handed.metadata["handoffs"]] == ["librarian"]
    assert handed.output == Capital(country="Italy", city="Paris")
    assert len(handed.metadata["request_usage"]) == 2
    # the hooks ran in the worker process, not here
    lines = log.read_text().splitlines()
    assert {line.split()[0] for line in lines} != {str(os.getpid())}
    assert sum(1 for line in lines if line.endswith("start geographer")) == 3


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
