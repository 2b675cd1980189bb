"""Test helpers for code built on Treadle: a fake OpenAI-compatible server and its replies.

`FakeOpenAIServer` serves real HTTP on 127.0.0.1, so tests exercise the same client path as
production. Nothing here is imported by Treadle itself.
"""

from treadle.testing.fake_server import FakeOpenAIServer, FaultRule, RecordedRequest
from treadle.testing.scripts import (
    SCRIPTS,
    Reply,
    Script,
    ToolCallSpec,
    echo,
    file_worker,
    get_script,
    tool_loop,
)

__all__ = [
    "SCRIPTS",
    "FakeOpenAIServer",
    "FaultRule",
    "RecordedRequest",
    "Reply",
    "Script",
    "ToolCallSpec",
    "echo",
    "file_worker",
    "get_script",
    "tool_loop",
]
