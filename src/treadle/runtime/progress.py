"""A process-wide count of the steps started passes make, for the runtime's start gate.

The start gate (`Runtime`, `DEFAULT_MAX_STARTED`) lets more passes start when the started ones
stall, so passes waiting on later passes cannot deadlock. "No pass ended lately" alone is not a
stall: with thousands of passes queued for a thousand connections, the first pass can take many
seconds to end while replies stream in all along, and treating that as a stall started every
waiting pass (issue 33: 10,000 passes all started, the first ending after 25 s). The HTTP pool
counts each reply it finishes here; the stall check sees the count move and waits.
"""

from __future__ import annotations

__all__ = ["step", "steps"]

_steps = 0


def step() -> None:
    """Count one step of work done (a reply read to its end, or its connection lost).

    Called on the runtime's loop thread; a lost count from another thread only makes the stall
    check a little more eager, never wrong about a deadlock."""
    global _steps
    _steps += 1


def steps() -> int:
    """Steps counted so far in this process."""
    return _steps
