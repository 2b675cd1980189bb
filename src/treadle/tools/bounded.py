"""Awaiting a tool call under its time limit, with the timer armed only where it can act.

A timer stops a call where the call waits, never between two waits, so a call that finishes
without waiting (an async tool that returns at once, a cached answer) cannot time out, and its
cancel scope (a timer on the loop, a backend lookup, the current task) bought nothing. `bounded`
runs a coroutine's first step itself: a call that ends there is done with no scope; one that waits
goes on under a scope whose limit still counts from the call's start, so every call that can
overrun is still stopped at the same moment as before. Anything but a coroutine is awaited under
the scope from the start. Nothing here blocks the loop.
"""

from __future__ import annotations

import time
import types
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any

import anyio

__all__ = ["bounded"]

_COROUTINE = types.CoroutineType


async def bounded(call: Awaitable[Any], limit: float) -> tuple[Any, bool]:
    """`(result, timed_out)` of awaiting `call` for at most `limit` seconds from now.

    A timed-out call is cancelled where it waits (result None). Its exceptions propagate, as an
    `await` inside `anyio.move_on_after(limit)` would let them.
    """
    result: Any = None
    if type(call) is not _COROUTINE:
        with anyio.move_on_after(limit) as scope:
            result = await call
        return result, scope.cancelled_caught
    coro: Coroutine[Any, Any, Any] = call
    started = time.monotonic()
    try:
        signal = coro.send(None)  # the call's first step, up to its first wait
    except StopIteration as done:
        return done.value, False  # it never waited: no timer could have stopped it
    with anyio.move_on_after(limit - (time.monotonic() - started)) as scope:
        result = await _resumed(coro, signal)
    return result, scope.cancelled_caught


@types.coroutine
def _resumed(coro: Coroutine[Any, Any, Any], signal: Any) -> Generator[Any, Any, Any]:
    """Go on awaiting `coro`, whose first step yielded `signal` to the task: what `await coro`
    does from there (a cancellation thrown in reaches the call where it waits)."""
    while True:
        try:
            sent = yield signal
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # a cancellation, most often: the call decides what it does
            try:
                signal = coro.throw(exc)
            except StopIteration as done:
                return done.value
            continue
        if sent is None:  # what an asyncio task always sends: plain delegation from here on
            return (yield from coro)
        try:
            signal = coro.send(sent)
        except StopIteration as done:
            return done.value
