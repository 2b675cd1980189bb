"""`run_lazy`: run a session-producing coroutine on the runtime; return a lazy facade at once."""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from treadle.runtime.background import submit
from treadle.session.session import Session, SessionData, new_session_id

__all__ = ["run_lazy"]


async def _data_of(coro: Coroutine[Any, Any, Session]) -> SessionData:
    session = await coro
    if not isinstance(session, Session):
        raise TypeError(
            f"run_lazy's coroutine must return a Session, got {type(session).__name__}."
        )
    data = await session.wait_ready()
    return data


def run_lazy(
    coro: Coroutine[Any, Any, Session],
    *,
    parents: Sequence[Session] = (),
    operator: str = "run_lazy",
    kind: str = "output",
) -> Session:
    """Run `coro` on the runtime; return at once a lazy `Session` that holds its result's rows.

    The facade has its own id and lineage (`parents`, `operator`) at once; its rows, usage and
    stop reason are those of the session `coro` returns. It shares the first parent's sandbox.
    """
    if not isinstance(coro, Coroutine):
        raise TypeError("run_lazy takes a coroutine object, e.g. run_lazy(make_session()).")
    sandbox = next((p.sandbox_handle for p in parents if p.sandbox_handle is not None), None)
    return Session._pending(
        submit(_data_of(coro)),
        id=new_session_id(),
        operator=operator,
        kind=kind,
        parents=parents,
        sandbox=sandbox,
    )
