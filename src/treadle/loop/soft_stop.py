"""Soft cancel: `session.cancel(after_turn=True)` lets the current turn finish, then stops.

A running pass (or agent run) registers a `StopRequest` under its output session's id; the
session handle asks through the session layer's port, which this module installs. A pass reads
the flag at each turn boundary (one attribute read), so the request costs nothing until used.
An `Agent` run shares one request with every pass it starts (retries, handoffs), so a soft cancel
of the agent's handle stops whichever pass is running and starts no other.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from treadle.session import ports

__all__ = ["StopRequest", "current_stop", "registered", "request_stop", "sharing_stop"]


class StopRequest:
    """A flag set from any thread: stop after the current turn."""

    __slots__ = ("requested",)

    def __init__(self) -> None:
        self.requested = False


_lock = threading.Lock()
_running: dict[str, StopRequest] = {}
_shared: ContextVar[StopRequest | None] = ContextVar("treadle_shared_stop", default=None)


def current_stop() -> StopRequest:
    """The request the next pass planned here shares (its agent's), or a fresh one."""
    return _shared.get() or StopRequest()


@contextmanager
def sharing_stop(stop: StopRequest) -> Iterator[None]:
    """Passes planned inside the block share `stop` (how an `Agent` run hands its own down)."""
    token = _shared.set(stop)
    try:
        yield
    finally:
        _shared.reset(token)


@contextmanager
def registered(session_id: str, stop: StopRequest) -> Iterator[None]:
    """While the block runs, `request_stop(session_id)` sets `stop`."""
    with _lock:
        _running[session_id] = stop
    try:
        yield
    finally:
        with _lock:
            _running.pop(session_id, None)


def request_stop(session_id: str) -> bool:
    """Ask the pass producing `session_id` to stop after its turn; False if none is running."""
    with _lock:
        stop = _running.get(session_id)
    if stop is None:
        return False
    stop.requested = True
    return True


ports.install_soft_stopper(request_stop)
