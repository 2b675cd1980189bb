"""Test helpers for code built on Treadle: a fake OpenAI-compatible server and its replies.

`FakeOpenAIServer` serves real HTTP on 127.0.0.1, so tests exercise the same client path as
production. Nothing here is imported by Treadle itself. Names load lazily so that
`python -m treadle.testing.fake_server` runs the module cleanly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.testing.fake_replies import (
        SCRIPTS,
        Reply,
        Script,
        ToolCallSpec,
        echo,
        file_worker,
        get_script,
        tool_loop,
    )
    from treadle.testing.fake_server import FakeOpenAIServer, FaultRule, RecordedRequest
    from treadle.testing.scripted import ScriptedExecutor
    from treadle.testing.telemetry import in_memory_telemetry

__all__ = [
    "SCRIPTS",
    "FakeOpenAIServer",
    "FaultRule",
    "RecordedRequest",
    "Reply",
    "Script",
    "ScriptedExecutor",
    "ToolCallSpec",
    "echo",
    "file_worker",
    "get_script",
    "in_memory_telemetry",
    "tool_loop",
]

_HOMES = {
    "FakeOpenAIServer": "fake_server",
    "FaultRule": "fake_server",
    "RecordedRequest": "fake_server",
    "SCRIPTS": "fake_replies",
    "Reply": "fake_replies",
    "Script": "fake_replies",
    "ToolCallSpec": "fake_replies",
    "echo": "fake_replies",
    "file_worker": "fake_replies",
    "get_script": "fake_replies",
    "tool_loop": "fake_replies",
    "ScriptedExecutor": "scripted",
    "in_memory_telemetry": "telemetry",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'treadle.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"treadle.testing.{home}"), name)
    globals()[name] = value
    return value
