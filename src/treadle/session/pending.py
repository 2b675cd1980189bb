"""`pending_output`: the lazy facade of one pass's output, built the short way.

A fan-out of a hundred thousand lazy passes builds one facade per pass on the caller's thread.
`Session._pending` takes seven keywords and goes through the generic `_derive`; this takes its
five arguments by position and builds the same facade (operator `run_session_loop`, kind
`output`, the user and agent sessions as parents), about a microsecond less per submission
(docs/performance.md, issue 33). No I/O here.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from treadle.session.lineage import LineageNode, record_usage
from treadle.session.placement import SandboxHandle
from treadle.session.session import Session, SessionData

if TYPE_CHECKING:
    from treadle.runtime.lazy import LazyValue

__all__ = ["pending_output"]


def pending_output(
    lazy: LazyValue[SessionData],
    id: str,
    user: Session,
    agent: Session,
    sandbox: SandboxHandle | None,
) -> Session:
    """What `Session._pending(lazy, id=id, operator="run_session_loop", kind="output",
    parents=[user, agent], sandbox=sandbox)` returns (taking one reference on `sandbox`)."""
    new = Session.__new__(Session)
    if sandbox is not None:
        sandbox.acquire()
    lineage = LineageNode(id, "run_session_loop", "output", (user.lineage, agent.lineage))
    # `merge` needs the usage even if no one reads this facade (as `Session._derive` records it)
    lazy._future.add_done_callback(partial(record_usage, lineage))
    new._init(id, lineage, None, lazy, sandbox)
    return new
