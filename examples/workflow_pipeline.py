"""A pipeline: a writer's output session feeds an editor; the call returns a lazy session."""

from typing import Any

from treadle.agents import Agent, pipeline
from treadle.llm import Provider
from treadle.testing import FakeOpenAIServer, Reply


def fake_model(request: dict[str, Any]) -> Reply:
    system = request["messages"][0]["content"]
    if system.startswith("Write"):
        return Reply.text("queues wait in line / packets hum")
    draft = request["messages"][-1]["content"]
    return Reply.text(draft.replace("hum", "hum softly at night"))


with FakeOpenAIServer(script=fake_model) as server:
    provider = Provider(model="fake", base_url=server.base_url, api_key="sk-test")
    writer = Agent("writer", "Write a short poem.", provider=provider)
    editor = Agent("editor", "Improve the last draft.", provider=provider)
    out = pipeline(writer, editor)("A poem about queues")  # returns at once
    print(out.done(), "(still running, probably)")
    print(out.final_text)
    print(out.chunk_table.kinds(), out.usage.requests, "requests")
    assert (out.final_text or "").endswith("at night")  # final_text is None without one
