"""The session loop: one agent pass as a coroutine, and its lazy public entry points."""

from treadle.loop.api import DEFAULT_MAX_TOOL_ROUNDS, arun_session_loop, run_session_loop
from treadle.loop.executor import AsyncExecutor, CompletionRequest, Executor, HttpExecutor

__all__ = [
    "DEFAULT_MAX_TOOL_ROUNDS",
    "AsyncExecutor",
    "CompletionRequest",
    "Executor",
    "HttpExecutor",
    "arun_session_loop",
    "run_session_loop",
]
