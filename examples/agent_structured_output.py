"""An agent with a structured output type, against the fake OpenAI server (tool mode).

The fake model first answers with a field missing; the validation error goes back to it and it
fixes its answer. `out.output` holds the validated pydantic object.
"""

from typing import Any

from pydantic import BaseModel

from treadle.agents import Agent
from treadle.llm import Provider
from treadle.testing import FakeOpenAIServer, Reply


class City(BaseModel):
    name: str
    population: int


def fake_model(request: dict[str, Any]) -> Reply:
    # The fake model: first try without population; after the error, a complete answer.
    last = request["messages"][-1]
    if last["role"] == "tool" and '"ok":false' in last["content"]:
        return Reply.tool_call("final_result", {"name": "Paris", "population": 2_102_650})
    return Reply.tool_call("final_result", {"name": "Paris"})


with FakeOpenAIServer(script=fake_model) as server:
    provider = Provider(model="fake", base_url=server.base_url, api_key="sk-test")
    agent = Agent("geo", "Answer with data.", provider=provider, output_type=City)
    out = agent("What is the biggest city in France?")
    print(out.output)
    print(out.chunk_table.kinds(), out.stop_reason)
    assert out.output == City(name="Paris", population=2_102_650)
