"""The background event-loop runtime, lazy values and worker-thread limits (see `background`,
`lazy` and `threads`)."""

from treadle.runtime.background import (
    DEFAULT_DRAIN_SECONDS,
    Runtime,
    add_shutdown_hook,
    get_runtime,
    shutdown,
    stats,
    submit,
)
from treadle.runtime.lazy import LazyValue
from treadle.runtime.lazy_session import run_lazy
from treadle.runtime.start_gate import DEFAULT_MAX_STARTED
from treadle.runtime.threads import thread_stats

__all__ = [
    "DEFAULT_DRAIN_SECONDS",
    "DEFAULT_MAX_STARTED",
    "LazyValue",
    "Runtime",
    "add_shutdown_hook",
    "get_runtime",
    "run_lazy",
    "shutdown",
    "stats",
    "submit",
    "thread_stats",
]
