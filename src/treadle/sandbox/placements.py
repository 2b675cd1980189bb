"""Which backend a placement names: `"local"` or a directory for `local`, `"isolated"` or an
`Isolated` value for the bubblewrap box. The one place a new backend's name is registered.
This module must never open a backend (constructing one is cheap and does no I/O beyond a
`PATH` lookup).
"""

from __future__ import annotations

from treadle.errors import ConfigurationError
from treadle.sandbox.backend import Backend
from treadle.sandbox.bwrap import Isolated
from treadle.sandbox.local import LocalBackend

__all__ = ["PlacementLike", "backend_for", "placement_name"]

PlacementLike = str | Isolated
"""What `session.to(...)` accepts."""


def placement_name(placement: PlacementLike) -> str:
    """The placement as recorded on the session and in a saved file (`"isolated"` for options)."""
    if isinstance(placement, Isolated):
        return "isolated"
    if not isinstance(placement, str) or not placement:
        raise ConfigurationError(
            "placement must be 'local', 'isolated', an Isolated(...) value or a directory path, "
            "e.g. session.to('local')."
        )
    return placement


def backend_for(placement: PlacementLike) -> Backend:
    """A new, unopened backend for `placement`."""
    if isinstance(placement, Isolated) or placement == "isolated":
        from treadle.sandbox.isolated import IsolatedBackend  # loads only when asked for

        return IsolatedBackend(placement if isinstance(placement, Isolated) else None)
    return LocalBackend(placement_name(placement))
