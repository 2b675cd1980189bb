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
    DEFAULT_GUARDRAIL_TIMEOUT,
    Guardrail,
    GuardrailInput,
    GuardrailResult,
    Limits,
    PassControl,
    ToolGuardrail,
    ToolGuardrailInput,
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
from treadle.loop.hooks import DEFAULT_HOOK_TIMEOUT, HookContext, Hooks
from treadle.loop.request_usage import RequestUsage
from treadle.loop.tooling import StopAtTools, ToolUseBehavior

__all__ = [
    "DEFAULT_GUARDRAIL_TIMEOUT",
    "DEFAULT_HOOK_TIMEOUT",
    "DEFAULT_MAX_TOOL_ROUNDS",
    "AssistantRowEvent",
    "AsyncExecutor",
    "CompletionRequest",
    "Event",
    "Executor",
    "Guardrail",
    "GuardrailInput",
    "GuardrailResult",
    "GuardrailTripped",
    "HookContext",
    "Hooks",
    "HttpExecutor",
    "Interrupted",
    "Limits",
    "PassControl",
    "PassOptions",
    "PassStarted",
    "PassStopped",
    "RequestUsage",
    "StopAtTools",
    "TextDelta",
    "ToolCallDelta",
    "ToolGuardrail",
    "ToolGuardrailInput",
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
