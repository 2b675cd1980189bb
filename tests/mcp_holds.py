"""How long one call held the GIL while an MCP message was parsed (the `parse_hold` fixture in
conftest.py times `_parse` with `timed`), and the bound the MCP shape tests hold it to."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from loop_watch import STALL_LIMIT


def timed(real: Callable[..., Any], held: list[float]) -> Callable[..., Any]:
    """`real`, appending the thread CPU time of each call to `held` (timed on the thread that
    runs it, which holds the GIL while a C call such as `json.loads` runs)."""

    def timed_call(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            held.append(time.thread_time() - start)

    return timed_call


def bounded(held: list[float], stall: Any) -> None:
    """No single parse held the GIL, and the loop thread did not run, past `STALL_LIMIT`."""
    assert max(held) < STALL_LIMIT, f"a parse held the GIL {max(held) * 1000:.1f} ms of CPU"
    assert stall.cpu < STALL_LIMIT, stall
