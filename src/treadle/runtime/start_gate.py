"""The runtime's start gate: how many passes submitted from other threads run at once, and how
long a full gate may show no progress before more start anyway (`Runtime`)."""

from __future__ import annotations

from treadle.runtime.environment import int_setting

__all__ = ["DEFAULT_MAX_STARTED", "STALL_SECONDS", "max_started_default"]

DEFAULT_MAX_STARTED = 4096
"""Passes submitted from other threads that run at once (override with the
TREADLE_MAX_STARTED_PASSES environment variable, 0 for no cap); the rest wait, not yet started,
until one ends. Four times the default cap on requests in flight: enough to keep every connection
busy while passes run their tools, few enough that a hundred thousand submitted passes do not
each hold a started coroutine chain (memory, and the garbage collector walking it)."""
STALL_SECONDS = 0.5
"""With passes waiting to start and none of the started ones ending, nor any HTTP reply arriving,
for this long, more start anyway: passes that wait on later passes cannot deadlock (replies
count too: a pass queued behind thousands for a connection takes far longer than this to end
while the others move, see `treadle.runtime.progress`). (Passes submitted by a pass's own worker
thread, a sync tool running a sub-agent, never wait: they start at once.)"""


def max_started_default() -> int:
    """The cap from `TREADLE_MAX_STARTED_PASSES`, else `DEFAULT_MAX_STARTED` (0: no cap)."""
    return int_setting("TREADLE_MAX_STARTED_PASSES", DEFAULT_MAX_STARTED)
