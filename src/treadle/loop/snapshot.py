"""`Snapshot`: the `with` block of a pass's output so far, as tools and callbacks see it.

A class, not a `@contextmanager` generator: every tool round takes one, and a generator-based
context manager (the generator, its wrapper object, two steps and a `StopIteration`) cost about
as much as building the snapshot's session (docs/performance.md, issue 33's fifth round).
"""

from __future__ import annotations

from treadle.session import Session

__all__ = ["Snapshot"]


class Snapshot:
    """`with Snapshot(session) as session`: closes the session's sandbox share at the end."""

    __slots__ = ("session",)

    def __init__(self, session: Session) -> None:
        self.session = session

    def __enter__(self) -> Session:
        return self.session

    def __exit__(self, *exc: object) -> None:
        self.session.close_sandbox()
