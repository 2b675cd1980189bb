"""An agent for tests/test_distributed_pipe.py at the top level of a module, as process workers
import it (the test points its provider at its fake server)."""

from __future__ import annotations

import threading
from typing import Any

from treadle.agents import Agent
from treadle.llm import Provider
from treadle.testing.sample_tools import shout as shout_upper
from treadle.tools import tool


def _shouter(name: str, shouting: Any = shout_upper, **settings: Any) -> Agent:
    """A shouting agent with a placeholder endpoint (each test points it at its fake server)."""
    provider = Provider(model="fake", base_url="http://127.0.0.1:1/v1", api_key="k")
    return Agent(name, "Shout.", tools=[shouting], provider=provider, **settings)


def lock_the_evil_one(output: Any) -> Any:
    """An output validator whose value for one input holds a lock (pickle refuses it)."""
    if "evil" in str(output).lower():
        return {"answer": str(output), "lock": threading.Lock()}
    return output


locker = _shouter("locker", output_validators=[lock_the_evil_one])


class BadRepr:
    """A dict key whose `repr` raises (what naming the value that cannot cross must survive)."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def lock_under_a_bad_key(output: Any) -> Any:
    """For `evil`: a lock (pickle refuses it) under a key whose `repr` raises; for `deep`: a
    list nested 3,000 deep around a lock (too deep to walk for its path)."""
    text = str(output).lower()
    if "evil" in text:
        return {"answer": str(output), "held": {BadRepr(): threading.Lock()}}
    if "deep" in text:
        nested: Any = [threading.Lock()]
        for _ in range(3000):
            nested = [nested]
        return {"answer": str(output), "deep": nested}
    return output


bad_key_locker = _shouter("bad-key-locker", output_validators=[lock_under_a_bad_key])


def _driver_link_transport() -> Any:
    """This worker's end of its socket (the worker process's `_DriverLink`)."""
    import gc

    for value in gc.get_objects():
        if type(value).__name__ == "_DriverLink":
            return value.transport
    raise RuntimeError("not in a process worker")


@tool
async def shout(text: str) -> str:
    """Return the text in upper case; for `garble`, first write a frame header of length -4 to
    the driver (what a worker's broken or hostile code could write on its socket).

    Args:
        text: What to shout.
    """
    if text == "garble":
        _driver_link_transport().write(b"\xff\xff\xff\xfc" + b"rest")
    return text.upper()


garbler = _shouter("garbler", shout)


stopper = _shouter("stopper", tool_use_behavior="stop_on_first_tool")
"""An agent whose first tool call's result is its output (a setting `AgentSpec`'s data does not
carry: it crosses by its import path)."""
