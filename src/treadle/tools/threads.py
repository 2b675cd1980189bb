"""The sync-tool threads: a 64-slot per-loop limiter, separate from every other kind of work.

Sync tools and sandbox I/O use *separate* limiters, so a sync tool that waits on a sandbox
operation can never starve it of a thread; callbacks and the runtime's own I/O have theirs too
(`treadle.runtime.threads`). A sync tool that reads a pending sub-pass gives its slot back while it
waits, so agent-as-tool nests at any depth. A call whose wait is abandoned (timeout or
cancellation) gives its slot back at once; the thread runs on and is counted in
`treadle.runtime.thread_stats()`.

This module must never block the event loop and never use the loop's default executor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from treadle.runtime.threads import LoopThreadLimiter

__all__ = ["SYNC_TOOL_THREADS", "LoopThreadLimiter", "run_sync_tool", "sync_tool_limiter"]

T = TypeVar("T")

#: Most sync tool calls running at once on one event loop (further calls queue for a slot).
SYNC_TOOL_THREADS = 64

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
