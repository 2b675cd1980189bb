"""Ports: the two things the session layer needs from layers above it, installed from above.

Opening a sandbox placement belongs to the sandbox layer and reading a session file to the
persist layer; both sit above this one, so `treadle/__init__.py` installs their entry points here
(each loads its layer on first use). This module is a leaf: it imports nothing of Treadle's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["install_loader", "install_opener", "loader", "opener"]

_opener: list[Callable[[str, Any], Any]] = []
_loader: list[Callable[[str], Any]] = []


def install_opener(open_placement: Callable[[str, Any], Any]) -> None:
    """Set how a placement opens: `open_placement(placement, backend_or_None) -> Sandbox`."""
    _opener[:] = [open_placement]


def install_loader(load: Callable[[str], Any]) -> None:
    """Set how a session file loads: `load(path) -> Session`."""
    _loader[:] = [load]


def opener() -> Callable[[str, Any], Any] | None:
    """The installed opener, if any."""
    return _opener[0] if _opener else None


def loader() -> Callable[[str], Any] | None:
    """The installed loader, if any."""
    return _loader[0] if _loader else None
