"""Manager/worker: the manager's tools are worker agents; calls in one reply run concurrently."""

from typing import Any

from treadle.agents import Agent
from treadle.llm import Provider
from treadle.testing import FakeOpenAIServer, Reply


def fake_model(request: dict[str, Any]) -> Reply:
    messages = request["messages"]
    system = messages[0]["content"]
    if system.startswith("Research"):  # a worker: answer its task
        # 300 ms: longer than a cold first use (imports on the loop) can delay one sibling call,
        # so the three calls always overlap on a loaded machine.
        return Reply.text(f"notes on {messages[-1]['content']}", latency_ms=300)
    if messages[-1]["role"] == "user":  # the manager: fan the work out in one reply
        return Reply.tool_calls_of(
            [("researcher", {"task": topic}) for topic in ("queues", "retries", "backoff")]
        )
    return Reply.text("Report: " + "; ".join(m["content"] for m in messages if m["role"] == "tool"))


with FakeOpenAIServer(script=fake_model) as server:
    provider = Provider(model="fake", base_url=server.base_url, api_key="sk-test")
    researcher = Agent(
        "researcher", "Research the task.", provider=provider, description="Researches a topic."
    )
    manager = Agent(
        "manager", "Split the work across researchers.", provider=provider,
        tools=[researcher.as_tool()],
    )  # fmt: skip
    out = manager("Write a report on resilient HTTP clients.")
    print(out.final_text)
    print("peak requests in flight:", server.max_in_flight)
    assert (out.final_text or "").count("notes on") == 3  # final_text is None without one
    assert server.max_in_flight == 3  # the three workers ran at the same time
