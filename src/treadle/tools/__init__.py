"""Tools: `@tool` / `BaseTool` definitions, schemas, validation, and the one dispatcher.

The session loop calls `ToolSet.build(...)` once per pass and `run_tool_calls(...)` once per round.
"""

from treadle.tools.base import BaseTool
from treadle.tools.context import ToolContext
from treadle.tools.dispatch import (
    DEFAULT_TOOL_TIMEOUT,
    AsyncToolExecutor,
    ToolExecutor,
    ToolOutcome,
    has_tool_dispatch,
    run_tool_calls,
)
from treadle.tools.results import MAX_CONTENT_CHARS, MAX_DETAIL_CHARS, MAX_TEXT_CHARS
from treadle.tools.threads import SYNC_TOOL_THREADS
from treadle.tools.tool import (
    ErrorPolicy,
    FunctionTool,
    IsEnabled,
    ResourceKey,
    TimeoutPolicy,
    Tool,
    tool,
)
from treadle.tools.toolset import ToolSet, ToolSource

__all__ = [
    "DEFAULT_TOOL_TIMEOUT",
    "MAX_CONTENT_CHARS",
    "MAX_DETAIL_CHARS",
    "MAX_TEXT_CHARS",
    "SYNC_TOOL_THREADS",
    "AsyncToolExecutor",
    "BaseTool",
    "ErrorPolicy",
    "FunctionTool",
    "IsEnabled",
    "ResourceKey",
    "TimeoutPolicy",
    "Tool",
    "ToolContext",
    "ToolExecutor",
    "ToolOutcome",
    "ToolSet",
    "ToolSource",
    "has_tool_dispatch",
    "run_tool_calls",
    "tool",
]
