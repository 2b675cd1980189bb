"""Fan-out: one agent over 500 sessions, 50 in flight, results in input order, one failure kept."""

from typing import Any

import treadle
from treadle import ProviderError, Session
from treadle.agents import Agent
from treadle.llm import Provider
from treadle.testing import FakeOpenAIServer, Reply


def fake_model(request: dict[str, Any]) -> Reply:
    question = request["messages"][-1]["content"]
    if question == "q13":
        return Reply.bad_request("this one is refused")
    return Reply.text(f"answer to {question}")


with FakeOpenAIServer(script=fake_model, latency_ms=5) as server:
    provider = Provider(model="fake", base_url=server.base_url, api_key="sk-test", max_retries=0)
    agent = Agent("answerer", "Answer briefly.", provider=provider)
    inputs = (Session.from_user_message(f"q{i}") for i in range(500))  # pulled lazily
    outs = treadle.map(agent, inputs, concurrency=50, return_exceptions=True, progress=True)
    failed = [i for i, o in enumerate(outs) if isinstance(o, ProviderError)]
    print(len(outs), "results;", "failed:", failed, "; peak in flight:", server.max_in_flight)
    assert failed == [13]
    first, last = outs[0], outs[499]
    assert isinstance(first, Session) and isinstance(last, Session)
    assert first.final_text == "answer to q0" and last.final_text == "answer to q499"
