"""Importable agents whose hooks misbehave in a worker process: one ends the process
(`os._exit`) on a poisoned input, one hangs past its pass's deadline. For the process backend's
tests: workers import them by path (`exiting_agents:poisoned`), as the driver's `sys.path` (with
tests/) crosses to them. The driver imports them too, only to read the agents' definitions: the
passes, and so the hooks, run in a worker."""

from __future__ import annotations

import os
import time
from typing import Any

from treadle.agents import Agent
from treadle.llm import Provider
from treadle.loop import HookContext, Hooks, Limits

#: Seconds the hanging hook sleeps: far past its pass's deadline and the driver's stop grace.
HANG_SECONDS = 600.0


class ExitOnPoison(Hooks):
    """Ends the whole worker process, as a crashing C extension or a stray `os._exit` would,
    before the model call of a pass whose user message says `poison`."""

    def on_model_start(self, ctx: HookContext, messages: Any) -> None:
        if any(m.get("role") == "user" and "poison" in str(m.get("content")) for m in messages):
            os._exit(3)


poisoned = Agent("poisoned", "Echo.", provider=Provider(model="fake"), hooks=ExitOnPoison())


class HangOnce(Hooks):
    """Sleeps (a sync hook, so on its own thread, abandoned at the deadline) before the model
    call of a pass whose user message says `hang`."""

    def on_model_start(self, ctx: HookContext, messages: Any) -> None:
        if any(m.get("role") == "user" and "hang" in str(m.get("content")) for m in messages):
            time.sleep(HANG_SECONDS)


hanging = Agent(
    "hanging",
    "Echo.",
    provider=Provider(model="fake"),
    hooks=HangOnce(),
    limits=Limits(deadline_seconds=0.5),
)


def _unwritable(output: Any) -> Any:
    """An output no results file can hold as JSON, named by the user message's text."""
    if output == "bytes":
        return b"\x00\xff"
    if output == "surrogate":
        return "a\x00b\ud800"
    return output


unwritable = Agent(
    "unwritable", "Echo.", provider=Provider(model="fake"), output_validators=[_unwritable]
)
"""Its output (validated in the worker) is bytes for `bytes`, a lone surrogate for `surrogate`."""
