"""Waking the runtime's event loop from another thread only when it sleeps.

`loop.call_soon_threadsafe` writes a byte to the loop's self-pipe on every call, whether the loop
sleeps in `epoll_wait` or is busy running callbacks. When it is busy the byte is wasted: the loop
looks at its ready queue before it next sleeps anyway, and the byte costs a `send` here, then an
extra `epoll_wait` and two `recv`s on the loop thread, and the write lets go of the GIL, so the
loop thread may take it and both threads switch. A caller reading passes one at a time meets a
busy loop at nearly every submission: the pass it just read was settled a few steps before the
loop finished with it (docs/performance.md, S6a).

`QuietWake` watches the loop's selector: `sleeping` is True from just before the loop's last look
at its ready queue until `epoll_wait` returned. A submitter appends its callback to the ready
queue first and reads `sleeping` after; the selector sets `sleeping` first and looks at the ready
queue after (shortening a sleep to a poll when something arrived). Whichever order the two
threads' steps come in (the GIL makes them one sequence), either the submitter sees `sleeping`
and writes the byte, or the loop sees the callback before it sleeps: no callback waits for an
unrelated wake-up.

This reaches into the stock selector loop's internals (`_selector`, `_ready`, `_call_soon`,
`_write_to_self`), the same in CPython 3.11 to 3.13; any other loop (uvloop, a custom policy's)
is left alone and woken with `call_soon_threadsafe` as before.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
from typing import Any

__all__ = ["QuietWake", "Wake", "new_runtime_loop"]


class _WatchedSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type,unused-ignore]
    """The default selector, telling whether the loop sleeps in it (see the module's docstring)."""

    sleeping = False
    ready: Any = ()  # the loop's ready queue, once the loop exists

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self.sleeping = True
        if self.ready and timeout != 0:  # a callback came after the loop last looked
            timeout = 0
        try:
            return super().select(timeout)
        finally:
            self.sleeping = False


class QuietWake:
    """Schedules callbacks on a loop from other threads, waking it only when it sleeps."""

    __slots__ = ("_loop", "_selector")

    def __init__(self, loop: asyncio.AbstractEventLoop, selector: _WatchedSelector) -> None:
        self._loop: Any = loop
        self._selector = selector

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """`loop.call_soon_threadsafe(fn)`, without the self-pipe write while the loop is busy.

        Raises RuntimeError when the loop is closed, as `call_soon_threadsafe` does.
        """
        loop = self._loop
        loop._check_closed()
        loop._call_soon(fn, (), None)  # first: the loop may look at its queue from now on
        if self._selector.sleeping:
            loop._write_to_self()


Wake = Callable[[Callable[[], Any]], object]
"""Schedules a callback on the loop from another thread (RuntimeError once the loop closed)."""


def new_runtime_loop() -> tuple[asyncio.AbstractEventLoop, Wake]:
    """A new event loop for the runtime's thread and how other threads schedule on it: a
    `QuietWake`'s `call_soon` when the policy makes the stock selector loop, else the policy's
    loop and its `call_soon_threadsafe`."""
    policy = asyncio.get_event_loop_policy()
    stock = type(policy) is asyncio.DefaultEventLoopPolicy and hasattr(asyncio, "SelectorEventLoop")
    # The policy's own loop class exactly: a program's subclass (set as `_loop_factory`) is its.
    if not stock or policy._loop_factory is not asyncio.SelectorEventLoop:  # type: ignore[attr-defined]
        loop = asyncio.new_event_loop()
        return loop, loop.call_soon_threadsafe
    selector = _WatchedSelector()
    loop = asyncio.SelectorEventLoop(selector)
    ready = getattr(loop, "_ready", None)
    needed = ("_call_soon", "_write_to_self", "_check_closed")
    if ready is None or not all(hasattr(loop, name) for name in needed):
        return loop, loop.call_soon_threadsafe  # a loop that differs inside: no shortcut
    selector.ready = ready
    return loop, QuietWake(loop, selector).call_soon
