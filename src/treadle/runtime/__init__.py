"""The background event-loop runtime and lazy values (see `loop` and `lazy`)."""

from treadle.runtime.background import (
    DEFAULT_DRAIN_SECONDS,
    Runtime,
    add_shutdown_hook,
    get_runtime,
    shutdown,
    submit,
)
from treadle.runtime.lazy import LazyValue
from treadle.runtime.lazy_session import run_lazy

__all__ = [
    "DEFAULT_DRAIN_SECONDS",
    "LazyValue",
    "Runtime",
    "add_shutdown_hook",
    "get_runtime",
    "run_lazy",
    "shutdown",
    "submit",
]
