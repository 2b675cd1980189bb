"""Ports: the two things the session layer needs from layers above it, installed from above.

Opening a sandbox placement belongs to the sandbox layer and reading a session file to the
persist layer; both sit above this one, so `treadle/__init__.py` installs their entry points here
(each loads its layer on first use). This module is a leaf: it imports nothing of Treadle's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "install_loader",
    "install_opener",
    "install_preparer",
    "install_soft_stopper",
    "loader",
    "opener",
    "preparer",
    "soft_stopper",
    "stop_after_turn",
]

_opener: list[Callable[[Any, Any], Any]] = []
_preparer: list[Callable[[Any, Any], Any]] = []
_loader: list[Callable[[str], Any]] = []
_soft_stopper: list[Callable[[str], bool]] = []


def install_opener(open_placement: Callable[[Any, Any], Any]) -> None:
    """Set how a placement opens: `open(placement_or_options, backend_or_None) -> Sandbox`."""
    _opener[:] = [open_placement]


def install_preparer(prepare: Callable[[Any, Any], Any]) -> None:
    """Set how a placement is checked and its backend built (unopened) when a session binds it:
    `prepare(placement_or_options, backend_or_None) -> backend`. Errors surface at `.to(...)`."""
    _preparer[:] = [prepare]


def preparer() -> Callable[[Any, Any], Any] | None:
    """The installed preparer, if any."""
    return _preparer[0] if _preparer else None


def install_loader(load: Callable[[str], Any]) -> None:
    """Set how a session file loads: `load(path) -> Session`."""
    _loader[:] = [load]


def opener() -> Callable[[Any, Any], Any] | None:
    """The installed opener, if any."""
    return _opener[0] if _opener else None


def loader() -> Callable[[str], Any] | None:
    """The installed loader, if any."""
    return _loader[0] if _loader else None


def install_soft_stopper(stop: Callable[[str], bool]) -> None:
    """Set how a soft cancel reaches a running pass: `stop(session_id) -> found`."""
    _soft_stopper[:] = [stop]


def soft_stopper() -> Callable[[str], bool] | None:
    """The installed soft stopper, if any."""
    return _soft_stopper[0] if _soft_stopper else None


def stop_after_turn(session_id: str) -> bool:
    """Ask the running pass producing `session_id` to stop after its turn; False if none."""
    stop = soft_stopper()
    return stop is not None and stop(session_id)
