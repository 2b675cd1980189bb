"""Sized, per-event-loop thread limiters for blocking work (sync tools, sandbox file I/O).

Each `LoopThreadLimiter` caps how many worker threads one kind of blocking work may occupy on one
event loop. Sync tools and sandbox I/O use *separate* limiters, so a sync tool that waits on a
sandbox operation can never starve it of a thread, and neither competes with asyncio's default
executor. A call whose wait is abandoned (timeout or cancellation) gives its slot back at once:
Python threads cannot be killed, so a runaway thread keeps running but no longer blocks others.

This module must never block the event loop and never use the loop's default executor.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

__all__ = ["SYNC_TOOL_THREADS", "LoopThreadLimiter", "run_sync_tool", "sync_tool_limiter"]

T = TypeVar("T")

#: Most sync tool calls running at once on one event loop (further calls queue for a slot).
SYNC_TOOL_THREADS = 64


class LoopThreadLimiter:
    """One `anyio.CapacityLimiter` of `total` threads per running event loop."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a thread limiter needs at least one thread")
        self.total = total
        self._lock = threading.Lock()
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter]
        self._by_loop = weakref.WeakKeyDictionary()

    def get(self) -> anyio.CapacityLimiter:
        """The limiter for the current event loop (created on first use)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            limiter = self._by_loop.get(loop)
            if limiter is None:
                limiter = anyio.CapacityLimiter(self.total)
                self._by_loop[loop] = limiter
            return limiter

    async def run(self, fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False) -> T:
        """Run `fn(*args)` on a worker thread under this limiter."""
        return await anyio.to_thread.run_sync(
            fn, *args, limiter=self.get(), abandon_on_cancel=abandon_on_cancel
        )


_SYNC_TOOLS = LoopThreadLimiter(SYNC_TOOL_THREADS)


def sync_tool_limiter() -> LoopThreadLimiter:
    """The limiter sync tools run under."""
    return _SYNC_TOOLS


async def run_sync_tool(fn: Callable[..., T], /, **kwargs: Any) -> T:
    """Call a sync tool on the sync-tool threads; on cancellation the wait is abandoned.

    Inside the call, `anyio.from_thread.run(...)` reaches back to the event loop, so a sync tool
    may await sandbox operations (which use their own threads, never this limiter's).
    """
    return await _SYNC_TOOLS.run(functools.partial(fn, **kwargs), abandon_on_cancel=True)
