"""The session loop: one agent pass as a coroutine, its control, events and entry points."""

from treadle.llm import AsyncExecutor, CompletionRequest, Executor, HttpExecutor
from treadle.loop.api import (
    DEFAULT_MAX_TOOL_ROUNDS,
    PassOptions,
    arun_session_loop,
    run_session_loop,
    stream_session_loop,
)
from treadle.loop.control import (
    Guardrail,
    GuardrailInput,
    Limits,
    PassControl,
    Tripwire,
    after_model,
    before_model,
)
from treadle.loop.events import (
    AssistantRowEvent,
    Event,
    GuardrailTripped,
    Interrupted,
    PassStarted,
    PassStopped,
    TextDelta,
    ToolCallDelta,
    ToolResultEvent,
    ToolStarted,
    UsageEvent,
)
from treadle.loop.tooling import StopAtTools, ToolUseBehavior

__all__ = [
    "DEFAULT_MAX_TOOL_ROUNDS",
    "AssistantRowEvent",
    "AsyncExecutor",
    "CompletionRequest",
    "Event",
    "Executor",
    "Guardrail",
    "GuardrailInput",
    "GuardrailTripped",
    "HttpExecutor",
    "Interrupted",
    "Limits",
    "PassControl",
    "PassOptions",
    "PassStarted",
    "PassStopped",
    "StopAtTools",
    "TextDelta",
    "ToolCallDelta",
    "ToolResultEvent",
    "ToolStarted",
    "ToolUseBehavior",
    "Tripwire",
    "UsageEvent",
    "after_model",
    "arun_session_loop",
    "before_model",
    "run_session_loop",
    "stream_session_loop",
]
