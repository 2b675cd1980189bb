"""Treadle: an asyncio-first runtime for LLM agent passes, with lazy session handles.

This module is the map of the public API. Names are imported lazily on first access so that
`import treadle` stays fast; everything listed in `__all__` is part of the contract.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from treadle.session import ports as _ports

__version__ = "0.1.0"

# Public name -> module that exports it: the one list of the public face. `__all__` and the lazy
# `__getattr__` are built from it; the `TYPE_CHECKING` block below repeats it for type checkers
# (tests/test_exports.py checks that the two agree).
_EXPORTS: dict[str, str] = {
    # values
    "Session": "treadle.session",
    "SessionData": "treadle.session",
    "ChunkRow": "treadle.session",
    "ChunkTable": "treadle.session",
    "LineageNode": "treadle.session",
    "Usage": "treadle.session",
    "StopReason": "treadle.session",
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
    "StopAtTools": "treadle.loop",
    "PassControl": "treadle.loop",
    "before_model": "treadle.loop",
    "after_model": "treadle.loop",
    "Hooks": "treadle.loop",
    "ToolGuardrail": "treadle.loop",
    "CompletionRequest": "treadle.loop",
    "Executor": "treadle.loop",
    "AsyncExecutor": "treadle.loop",
    # agents and workflows
    "Agent": "treadle.agents",
    "map": "treadle.distributed",
    "amap": "treadle.distributed",
    "map_iter": "treadle.distributed",
    "pipeline": "treadle.agents",
    "brainstorm": "treadle.agents",
    "handoff": "treadle.agents",
    "triage": "treadle.agents",
    "run_session_compress": "treadle.agents",
    "arun_session_compress": "treadle.agents",
    # tools and sandbox
    "tool": "treadle.tools",
    "Tool": "treadle.tools",
    "BaseTool": "treadle.tools",
    "ToolContext": "treadle.tools",
    "SandboxHandle": "treadle.sandbox",
    "LocalBackend": "treadle.sandbox",
    "Isolated": "treadle.sandbox",
    "ResourceLimits": "treadle.sandbox",
    "global_system_tools": "treadle.sandbox",
    # persistence
    "load_session": "treadle.persist",
    "LoadedSession": "treadle.persist",
    # conversation stores
    "Store": "treadle.stores",
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
    "ToolEnabledError": "treadle.errors",
    "SandboxError": "treadle.errors",
    "PathViolation": "treadle.errors",
    "BudgetExceededError": "treadle.errors",
    "PersistenceError": "treadle.errors",
    "StructuredOutputError": "treadle.errors",
    "ModelRetry": "treadle.errors",
    "ModelRefusalError": "treadle.errors",
    "StoreError": "treadle.errors",
    "ConflictError": "treadle.errors",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # explicit re-exports (`X as X`), so `mypy --strict` users may import them
    from treadle.agents import Agent as Agent
    from treadle.agents import arun_session_compress as arun_session_compress
    from treadle.agents import brainstorm as brainstorm
    from treadle.agents import handoff as handoff
    from treadle.agents import pipeline as pipeline
    from treadle.agents import run_session_compress as run_session_compress
    from treadle.agents import triage as triage
    from treadle.distributed import amap as amap
    from treadle.distributed import map as map
    from treadle.distributed import map_iter as map_iter
    from treadle.errors import AuthenticationError as AuthenticationError
    from treadle.errors import BudgetExceededError as BudgetExceededError
    from treadle.errors import ConfigurationError as ConfigurationError
    from treadle.errors import ConflictError as ConflictError
    from treadle.errors import ContextLengthError as ContextLengthError
    from treadle.errors import MalformedResponse as MalformedResponse
    from treadle.errors import ModelRefusalError as ModelRefusalError
    from treadle.errors import ModelRetry as ModelRetry
    from treadle.errors import PathViolation as PathViolation
    from treadle.errors import PersistenceError as PersistenceError
    from treadle.errors import ProviderConnectionError as ProviderConnectionError
    from treadle.errors import ProviderError as ProviderError
    from treadle.errors import ProviderTimeout as ProviderTimeout
    from treadle.errors import RateLimitError as RateLimitError
    from treadle.errors import RuntimeLoopError as RuntimeLoopError
    from treadle.errors import SandboxError as SandboxError
    from treadle.errors import StoreError as StoreError
    from treadle.errors import StructuredOutputError as StructuredOutputError
    from treadle.errors import ToolArgumentsError as ToolArgumentsError
    from treadle.errors import ToolEnabledError as ToolEnabledError
    from treadle.errors import ToolError as ToolError
    from treadle.errors import ToolTimeoutError as ToolTimeoutError
    from treadle.errors import TreadleError as TreadleError
    from treadle.llm import Provider as Provider
    from treadle.loop import AsyncExecutor as AsyncExecutor
    from treadle.loop import CompletionRequest as CompletionRequest
    from treadle.loop import Executor as Executor
    from treadle.loop import Guardrail as Guardrail
    from treadle.loop import GuardrailInput as GuardrailInput
    from treadle.loop import Hooks as Hooks
    from treadle.loop import Limits as Limits
    from treadle.loop import PassControl as PassControl
    from treadle.loop import StopAtTools as StopAtTools
    from treadle.loop import ToolGuardrail as ToolGuardrail
    from treadle.loop import Tripwire as Tripwire
    from treadle.loop import after_model as after_model
    from treadle.loop import arun_session_loop as arun_session_loop
    from treadle.loop import before_model as before_model
    from treadle.loop import run_session_loop as run_session_loop
    from treadle.loop import stream_session_loop as stream_session_loop
    from treadle.persist import LoadedSession as LoadedSession
    from treadle.persist import load_session as load_session
    from treadle.runtime import LazyValue as LazyValue
    from treadle.runtime import get_runtime as get_runtime
    from treadle.runtime import run_lazy as run_lazy
    from treadle.sandbox import Isolated as Isolated
    from treadle.sandbox import LocalBackend as LocalBackend
    from treadle.sandbox import ResourceLimits as ResourceLimits
    from treadle.sandbox import SandboxHandle as SandboxHandle
    from treadle.sandbox import global_system_tools as global_system_tools
    from treadle.session import ChunkRow as ChunkRow
    from treadle.session import ChunkTable as ChunkTable
    from treadle.session import LineageNode as LineageNode
    from treadle.session import Session as Session
    from treadle.session import SessionData as SessionData
    from treadle.session import StopReason as StopReason
    from treadle.session import Usage as Usage
    from treadle.stores import Store as Store
    from treadle.tools import BaseTool as BaseTool
    from treadle.tools import Tool as Tool
    from treadle.tools import ToolContext as ToolContext
    from treadle.tools import tool as tool


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treadle' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


def _open_placement(placement: Any, backend: object | None) -> Any:
    """Open a sandbox placement; the sandbox layer loads on the first open, not at import."""
    from treadle.sandbox.opening import open_placement

    return open_placement(placement, backend)


def _prepare_placement(placement: Any, backend: object | None) -> Any:
    """Check a placement and build its (unopened) backend when a session binds it."""
    from treadle.sandbox.opening import prepare_placement

    return prepare_placement(placement, backend)


def _load_session(path: str) -> Any:
    """Read a session file; the persist layer loads on the first read, not at import."""
    from treadle.persist import load_session

    return load_session(path).session


# The session layer counts sandbox shares and names files; opening a placement and reading a file
# are the sandbox and persist layers' jobs. Wiring them here keeps `session` free of upward
# imports and `import treadle` free of both layers.
_ports.install_opener(_open_placement)
_ports.install_preparer(_prepare_placement)
_ports.install_loader(_load_session)
