"""Tools: `@tool` / `BaseTool` definitions, schemas, validation, and dispatch of a round of calls.

The session loop calls `ToolSet.build(...)` once per pass and `run_tool_calls(...)` once per round.
"""

from treadle.tools.dispatch import ToolOutcome, ToolSet, run_tool_calls
from treadle.tools.results import MAX_CONTENT_CHARS, MAX_DETAIL_CHARS, MAX_TEXT_CHARS
from treadle.tools.threads import SYNC_TOOL_THREADS
from treadle.tools.tool import BaseTool, FunctionTool, ResourceKey, Tool, tool

__all__ = [
    "MAX_CONTENT_CHARS",
    "MAX_DETAIL_CHARS",
    "MAX_TEXT_CHARS",
    "SYNC_TOOL_THREADS",
    "BaseTool",
    "FunctionTool",
    "ResourceKey",
    "Tool",
    "ToolOutcome",
    "ToolSet",
    "run_tool_calls",
    "tool",
]
