"""Treadle: an asyncio-first runtime for LLM agent passes, with lazy session handles.

This module is the map of the public API. Names are imported lazily on first access so that
`import treadle` stays fast; everything listed in `__all__` is part of the contract.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # values
    "Session": "treadle.session",
    "SessionData": "treadle.session",
    "ChunkRow": "treadle.session",
    "ChunkTable": "treadle.session",
    "LineageNode": "treadle.session",
    "Usage": "treadle.session",
    # runtime
    "LazyValue": "treadle.runtime",
    "run_lazy": "treadle.runtime",
    "get_runtime": "treadle.runtime",
    # the pass
    "Provider": "treadle.llm",
    "run_session_loop": "treadle.loop",
    "arun_session_loop": "treadle.loop",
    "stream_session_loop": "treadle.loop",
    "Limits": "treadle.loop",
    "Guardrail": "treadle.loop",
    "GuardrailInput": "treadle.loop",
    "Tripwire": "treadle.loop",
    "PassControl": "treadle.loop",
    "before_model": "treadle.loop",
    "after_model": "treadle.loop",
    "CompletionRequest": "treadle.loop",
    "Executor": "treadle.loop",
    "AsyncExecutor": "treadle.loop",
    # agents and workflows
    "Agent": "treadle.agents",
    "map": "treadle.agents",
    "amap": "treadle.agents",
    "map_iter": "treadle.agents",
    "pipeline": "treadle.agents",
    "brainstorm": "treadle.agents",
    "handoff": "treadle.agents",
    "run_session_compress": "treadle.agents",
    "arun_session_compress": "treadle.agents",
    "StructuredOutputError": "treadle.agents",
    # tools and sandbox
    "tool": "treadle.tools",
    "Tool": "treadle.tools",
    "BaseTool": "treadle.tools",
    "SandboxHandle": "treadle.sandbox",
    "LocalBackend": "treadle.sandbox",
    "Isolated": "treadle.sandbox",
    "ResourceLimits": "treadle.sandbox",
    "global_system_tools": "treadle.sandbox",
    # persistence
    "load_session": "treadle.persist",
    "LoadedSession": "treadle.persist",
    # errors
    "ToolArgumentsError": "treadle.errors",
    "TreadleError": "treadle.errors",
    "ConfigurationError": "treadle.errors",
    "RuntimeLoopError": "treadle.errors",
    "ProviderError": "treadle.errors",
    "AuthenticationError": "treadle.errors",
    "RateLimitError": "treadle.errors",
    "ContextLengthError": "treadle.errors",
    "ProviderTimeout": "treadle.errors",
    "ProviderConnectionError": "treadle.errors",
    "MalformedResponse": "treadle.errors",
    "ToolError": "treadle.errors",
    "ToolTimeoutError": "treadle.errors",
    "SandboxError": "treadle.errors",
    "PathViolation": "treadle.errors",
    "BudgetExceededError": "treadle.errors",
    "PersistenceError": "treadle.errors",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from treadle.agents import (
        Agent,
        StructuredOutputError,
        amap,
        arun_session_compress,
        brainstorm,
        handoff,
        map,
        map_iter,
        pipeline,
        run_session_compress,
    )
    from treadle.errors import (
        AuthenticationError,
        BudgetExceededError,
        ConfigurationError,
        ContextLengthError,
        MalformedResponse,
        PathViolation,
        PersistenceError,
        ProviderConnectionError,
        ProviderError,
        ProviderTimeout,
        RateLimitError,
        RuntimeLoopError,
        SandboxError,
        ToolArgumentsError,
        ToolError,
        ToolTimeoutError,
        TreadleError,
    )
    from treadle.llm import Provider
    from treadle.loop import (
        AsyncExecutor,
        CompletionRequest,
        Executor,
        Guardrail,
        GuardrailInput,
        Limits,
        PassControl,
        Tripwire,
        after_model,
        arun_session_loop,
        before_model,
        run_session_loop,
        stream_session_loop,
    )
    from treadle.persist import LoadedSession, load_session
    from treadle.runtime import LazyValue, get_runtime, run_lazy
    from treadle.sandbox import (
        Isolated,
        LocalBackend,
        ResourceLimits,
        SandboxHandle,
        global_system_tools,
    )
    from treadle.session import ChunkRow, ChunkTable, LineageNode, Session, SessionData, Usage
    from treadle.tools import BaseTool, Tool, tool


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treadle' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
