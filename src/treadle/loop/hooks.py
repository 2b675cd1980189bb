"""`Hooks`: one object of lifecycle callbacks (agent, model call, tool, handoff; start and end).

Subclass `Hooks` and override the methods you need, as plain or `async def` methods. A pass (or
an `Agent`) calls only the methods a subclass overrides, so an unused hook costs nothing. Hooks
are isolated like every other callback: sync ones run on the user-code threads, a hook that
raises (`SystemExit` and `KeyboardInterrupt` too) fails only its own pass with `HookError`, and a
hook that runs past `Hooks.timeout` seconds fails its pass the same way (a sync hook's thread is
abandoned). This module never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from treadle.errors import HookError
from treadle.runtime.threads import _USER_CODE

if TYPE_CHECKING:
    from treadle.session import ChunkRow, ToolCall, Usage

__all__ = ["DEFAULT_HOOK_TIMEOUT", "HookContext", "Hooks", "both", "fire"]

#: Seconds a hook may run before its pass fails with `HookError` (`Hooks.timeout` overrides).
DEFAULT_HOOK_TIMEOUT = 60.0

_NAMES = (
    "on_agent_start",
    "on_agent_end",
    "on_model_start",
    "on_model_end",
    "on_tool_start",
    "on_tool_end",
    "on_handoff",
)


@dataclass(frozen=True, slots=True)
class HookContext:
    """What every hook receives first: whose pass it is and how far it got."""

    agent: str | None
    """The agent's name (None for a bare `run_session_loop` pass)."""
    session_id: str
    """Id of the output session being produced."""
    usage: Usage
    """The pass's token usage so far."""


class Hooks:
    """Lifecycle callbacks; override any of the methods (sync or `async def`).

    Give one to `run_session_loop(..., hooks=...)` (that pass) or `Agent(..., hooks=...)` (every
    run of the agent). Return values are ignored.
    """

    timeout: float = DEFAULT_HOOK_TIMEOUT
    """Seconds one hook call may run before its pass fails with `HookError`."""

    def on_agent_start(self, ctx: HookContext) -> Any:
        """An agent run (or a handoff target) starts."""

    def on_agent_end(self, ctx: HookContext, output: Any) -> Any:
        """An agent run ends; `output` is its structured output or its final text."""

    def on_model_start(self, ctx: HookContext, messages: list[dict[str, Any]]) -> Any:
        """A model request is about to be sent (`messages` as sent)."""

    def on_model_end(self, ctx: HookContext, row: ChunkRow) -> Any:
        """The model answered; `row` is the assistant row."""

    def on_tool_start(self, ctx: HookContext, call: ToolCall) -> Any:
        """A tool call is about to run."""

    def on_tool_end(self, ctx: HookContext, call: ToolCall, row: ChunkRow) -> Any:
        """A tool call finished; `row` is its tool_result row."""

    def on_handoff(self, ctx: HookContext, source: str, target: str) -> Any:
        """Agent `source` handed the conversation to agent `target`."""

    @functools.cached_property
    def overridden(self) -> frozenset[str]:
        """The hook names this object implements (the others are never called)."""
        cls = type(self)
        return frozenset(n for n in _NAMES if getattr(cls, n) is not getattr(Hooks, n))


async def fire(hooks: Hooks | None, name: str, *args: Any) -> None:
    """Call hook `name` if `hooks` overrides it; any failure becomes `HookError`."""
    if hooks is None or name not in hooks.overridden:
        return
    fn = getattr(hooks, name)
    timeout = hooks.timeout
    try:
        with anyio.move_on_after(timeout) as scope:
            if inspect.iscoroutinefunction(fn):
                await fn(*args)
            else:
                result = await _USER_CODE.run(functools.partial(fn, *args), abandon_on_cancel=True)
                if inspect.isawaitable(result):
                    await result
    except HookError:
        raise
    except asyncio.CancelledError as err:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # a real cancellation of the pass: it must go on
        raise HookError(  # raised by the hook itself: not a cancel, and never one of its pass
            f"hook {name} raised CancelledError without being cancelled; its pass failed "
            "(other passes were not affected); raise another exception to fail it."
        ) from err
    except BaseException as err:  # SystemExit too: the hook ends its own pass, not others
        raise HookError(
            f"hook {name} raised {type(err).__name__}: {err}; its pass failed (other passes "
            "were not affected)."
        ) from err
    if scope.cancelled_caught:
        raise HookError(
            f"hook {name} ran over {timeout} s, so its pass failed; make it return sooner or "
            "raise Hooks.timeout."
        )


class _Pair(Hooks):
    """Two hook objects called in turn (a run's hooks, then the answering agent's)."""

    def __init__(self, first: Hooks, second: Hooks) -> None:
        self.first, self.second = first, second
        self.timeout = first.timeout + second.timeout  # each call keeps its own bound

    @functools.cached_property
    def overridden(self) -> frozenset[str]:
        """Every hook either object implements."""
        return self.first.overridden | self.second.overridden

    def __getattribute__(self, name: str) -> Any:
        if name in _NAMES:

            async def both_of(*args: Any) -> None:
                await fire(self.first, name, *args)
                await fire(self.second, name, *args)

            return both_of
        return super().__getattribute__(name)


def both(first: Hooks | None, second: Hooks | None) -> Hooks | None:
    """Hooks calling `first` then `second` (either may be None)."""
    if first is None or second is None or first is second:
        return first or second
    return _Pair(first, second)
