"""Where a pass's trace hangs: the caller's context, carried across threads and processes.

A pass started from the caller's thread runs on the runtime's thread; the runtime schedules it
with `loop.call_soon_threadsafe`, which runs the scheduling callback (and so the task it creates)
in a copy of the caller's `contextvars` context, so the caller's current span is the parent
without anything here. Across processes (the process and Ray backends) the context travels as a
W3C trace-context carrier in each work item: `inject_parent` in the driver, `parent_from_carrier`
and `use_parent` in the worker. Nothing here imports OpenTelemetry unless the application already
did and configured a tracer provider.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TraceParent",
    "capture_parent",
    "flush",
    "inject_parent",
    "parent_from_carrier",
    "trace_api",
    "use_parent",
]


def trace_api() -> Any | None:
    """`opentelemetry.trace` when the application configured a tracer provider, else None."""
    api = sys.modules.get("opentelemetry.trace")
    if api is None:
        return None
    provider = api.get_tracer_provider()
    if isinstance(provider, (api.ProxyTracerProvider, api.NoOpTracerProvider)):
        return None
    return api


@dataclass(frozen=True, slots=True)
class TraceParent:
    """The caller's OpenTelemetry context, captured where a pass was asked for."""

    context: Any


def capture_parent() -> TraceParent | None:
    """The current OpenTelemetry context when tracing is on (else None, at no cost).

    Called where a pass is planned, so the span current there becomes the parent of the pass.
    """
    if trace_api() is None:
        return None
    from opentelemetry.context import get_current

    return TraceParent(get_current())


def inject_parent(parent: TraceParent | None) -> dict[str, str]:
    """W3C trace-context headers of `parent`, for a pass run in another process."""
    if parent is None:
        return {}
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier, context=parent.context)
    return carrier


def parent_from_carrier(carrier: Mapping[str, str] | None) -> TraceParent | None:
    """The parent a worker process continues from (None when tracing is off there)."""
    if not carrier or trace_api() is None:
        return None
    from opentelemetry.propagate import extract

    return TraceParent(extract(dict(carrier)))


@contextmanager
def use_parent(parent: TraceParent | None) -> Iterator[None]:
    """Make `parent` the current context inside the block (nothing when it is None).

    Use it around code running in one task (a worker's pass): passes planned inside the block
    capture `parent` as theirs.
    """
    if parent is None:
        yield
        return
    from opentelemetry import context

    token = context.attach(parent.context)
    try:
        yield
    finally:
        context.detach(token)


def flush(timeout_seconds: float = 10.0) -> None:
    """Export the spans and metrics this process still buffers (a worker about to exit).

    Blocks up to about `timeout_seconds` per provider; does nothing when tracing is off.
    """
    api = trace_api()
    if api is None:
        return
    millis = int(timeout_seconds * 1000)
    providers = [api.get_tracer_provider()]
    metrics = sys.modules.get("opentelemetry.metrics")
    if metrics is not None:
        providers.append(metrics.get_meter_provider())
    for provider in providers:
        force_flush = getattr(provider, "force_flush", None)
        if force_flush is not None:
            force_flush(timeout_millis=millis)
