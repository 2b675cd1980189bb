"""The session loop: one agent pass as a coroutine, its control, events and entry points.

Names load on first access (PEP 562 `__getattr__`), so `from treadle import run_session_loop`
imports `treadle.loop.api` alone; the engine and the layers below it load with the first pass.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Public name -> the module that defines it.
_HOMES = {
    "AsyncExecutor": "treadle.llm",
    "CompletionRequest": "treadle.llm",
    "Executor": "treadle.llm",
    "HttpExecutor": "treadle.llm",
    "DEFAULT_MAX_TOOL_ROUNDS": "treadle.loop.api",
    "PassOptions": "treadle.loop.api",
    "arun_session_loop": "treadle.loop.api",
    "run_session_loop": "treadle.loop.api",
    "stream_session_loop": "treadle.loop.api",
    "DEFAULT_GUARDRAIL_TIMEOUT": "treadle.loop.control",
    "Guardrail": "treadle.loop.control",
    "GuardrailInput": "treadle.loop.control",
    "GuardrailResult": "treadle.loop.control",
    "Limits": "treadle.loop.control",
    "PassControl": "treadle.loop.control",
    "ToolGuardrail": "treadle.loop.control",
    "ToolGuardrailInput": "treadle.loop.control",
    "Tripwire": "treadle.loop.control",
    "after_model": "treadle.loop.control",
    "before_model": "treadle.loop.control",
    "AssistantRowEvent": "treadle.loop.events",
    "Event": "treadle.loop.events",
    "GuardrailTripped": "treadle.loop.events",
    "Interrupted": "treadle.loop.events",
    "PassStarted": "treadle.loop.events",
    "PassStopped": "treadle.loop.events",
    "TextDelta": "treadle.loop.events",
    "ToolCallDelta": "treadle.loop.events",
    "ToolResultEvent": "treadle.loop.events",
    "ToolStarted": "treadle.loop.events",
    "UsageEvent": "treadle.loop.events",
    "DEFAULT_HOOK_TIMEOUT": "treadle.loop.hooks",
    "HookContext": "treadle.loop.hooks",
    "Hooks": "treadle.loop.hooks",
    "RequestUsage": "treadle.loop.request_usage",
    "StopAtTools": "treadle.loop.tooling",
    "ToolUseBehavior": "treadle.loop.tooling",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'treadle.loop' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
