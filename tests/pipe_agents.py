"""An agent for tests/test_distributed_pipe.py at the top level of a module, as process workers
import it (the test points its provider at its fake server)."""

from __future__ import annotations

import threading
from typing import Any

from treadle.agents import Agent
from treadle.llm import Provider
from treadle.testing.sample_tools import shout


def lock_the_evil_one(output: Any) -> Any:
    """An output validator whose value for one input holds a lock (pickle refuses it)."""
    if "evil" in str(output).lower():
        return {"answer": str(output), "lock": threading.Lock()}
    return output


locker = Agent(
    "locker",
    "Shout.",
    tools=[shout],
    provider=Provider(model="fake", base_url="http://127.0.0.1:1/v1", api_key="k"),
    output_validators=[lock_the_evil_one],
)
