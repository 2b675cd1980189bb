"""An importable agent whose hook ends its worker process (`os._exit`) on a poisoned input, for
the process backend's tests: workers import it by path (`exiting_agents:poisoned`), as the
driver's `sys.path` (with tests/) crosses to them. The driver imports it too, only to read the
agent's definition: the pass, and so the hook, runs in a worker."""

from __future__ import annotations

import os
from typing import Any

from treadle.agents import Agent
from treadle.llm import Provider
from treadle.loop import HookContext, Hooks


class ExitOnPoison(Hooks):
    """Ends the whole worker process, as a crashing C extension or a stray `os._exit` would,
    before the model call of a pass whose user message says `poison`."""

    def on_model_start(self, ctx: HookContext, messages: Any) -> None:
        if any(m.get("role") == "user" and "poison" in str(m.get("content")) for m in messages):
            os._exit(3)


poisoned = Agent("poisoned", "Echo.", provider=Provider(model="fake"), hooks=ExitOnPoison())
