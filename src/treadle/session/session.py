"""`Session`: an ordered table of rows with an id, lineage, usage and a shared sandbox handle.

A session is a value: every operation returns a new session. It may also be a *lazy facade* over a
pass still running on the runtime: its `id` and `lineage` are known at once, while reading
`chunk_table`, `usage` or `stop_reason` blocks (sync) or is awaited (async) until the pass ends.
A failed pass re-raises its error on every read, never a partial transcript. A sync read of a
pending session on a thread running an event loop raises `RuntimeLoopError` (await it there).
Deriving from a pending session (`append`, `add_user_message`, `fork`, `to`, `with_data`,
`merge`) returns a new lazy session at once (the pending value's `then` / `join`). No I/O here.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Self, cast

from typing_extensions import TypeVar

from treadle._frozen import quick_init
from treadle.errors import ConfigurationError
from treadle.session import ports
from treadle.session.combine import check_data_fields, merged_rows_and_usage, require_text
from treadle.session.ids import new_session_id
from treadle.session.lineage import LineageNode, record_usage
from treadle.session.placement import SandboxHandle
from treadle.session.rows import ChunkRow, ChunkTable, text_of_content
from treadle.session.stops import StopReason
from treadle.session.usage import Usage

if TYPE_CHECKING:
    from treadle.runtime.lazy import LazyValue
    from treadle.sandbox import Sandbox
    from treadle.sandbox.placements import PlacementLike

__all__ = ["Output", "Session", "SessionData", "new_session_id"]

Output = TypeVar("Output", default=Any)
"""The type of `Session.output` (an `Agent[Deps, Output]` returns `Session[Output | None]`)."""

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@quick_init
@dataclass(frozen=True, slots=True)
class SessionData:
    """What a session holds once materialised (shared between a facade and its result)."""

    table: ChunkTable
    """The rows."""
    usage: Usage = field(default_factory=Usage)
    """Cumulative token usage."""
    stop_reason: StopReason | None = None
    """Why the pass that produced this session ended (None when no pass produced it)."""
    metadata: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    """Extra facts set by the loop (interrupt reason, tripwire, structured output, ...)."""


_DATA_FIELDS = frozenset(f.name for f in fields(SessionData))


class Session(Generic[Output]):
    """An ordered table of chunk rows with an id, lineage, usage and a sandbox handle.

    `Session[T]` is a session whose `output` is typed `T`: an `Agent[Deps, Model]` returns
    `Session[Model | None]` (None when the pass stopped without an answer, e.g. `max_steps`).

    Build one with `Session.from_agent_prompt`, `Session.from_user_message` or
    `Session.from_messages`; bind a sandbox placement with `.to("local")`. A session returned by
    `run_session_loop` may still be running: read it (blocks), `await` it, or `synchronize()`.
    """

    __slots__ = ("__weakref__", "_data", "_finalizer", "_lazy", "_sandbox", "id", "lineage")
    __treadle_inject__: ClassVar[str] = "session"  # a tool parameter of this type gets the caller

    id: str
    lineage: LineageNode

    def __init__(
        self,
        rows: Iterable[ChunkRow] | ChunkTable = (),
        *,
        id: str | None = None,
        usage: Usage | None = None,
        operator: str = "new",
        kind: str = "user",
        parents: Sequence[Session] = (),
    ) -> None:
        table = rows if isinstance(rows, ChunkTable) else ChunkTable(rows)
        sid = id or new_session_id()
        lineage = LineageNode(sid, operator, kind, (p.lineage for p in parents))
        self._init(sid, lineage, SessionData(table, usage or Usage()), None, None)

    def _init(
        self,
        id: str,
        lineage: LineageNode,
        data: SessionData | None,
        lazy: LazyValue[SessionData] | None,
        sandbox: SandboxHandle | None,
    ) -> None:
        self.id = id
        self.lineage = lineage
        self._data = data
        if data is not None:
            lineage.usage = data.usage
        self._lazy = lazy
        self._sandbox = sandbox
        self._finalizer: weakref.finalize[Any, Session] | None = (
            weakref.finalize(self, SandboxHandle.release, sandbox) if sandbox is not None else None
        )

    @classmethod
    def _derive(
        cls,
        data: SessionData | None,
        *,
        operator: str,
        kind: str,
        parents: Sequence[Session],
        sandbox: SandboxHandle | None,
        lazy: LazyValue[SessionData] | None = None,
        id: str | None = None,
    ) -> Session:
        """A new session made by `operator` from `parents`, taking one reference on `sandbox`."""
        new = cls.__new__(cls)
        sid = id or new_session_id()
        if sandbox is not None:
            sandbox.acquire()
        lineage = LineageNode(sid, operator, kind, (p.lineage for p in parents))
        if lazy is not None:  # `merge` needs the usage even if no one reads this facade
            # On the future itself, with a partial (not two nested closures): objects each of a
            # fan-out's pending outputs holds (docs/performance.md, issue 33).
            lazy._future.add_done_callback(partial(record_usage, lineage))
        new._init(sid, lineage, data, lazy, sandbox)
        return new

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def from_agent_prompt(cls, text: str) -> Session:
        """An agent session holding one system row with `text`."""
        require_text("text", text)
        return cls([ChunkRow.system(text)], operator="from_agent_prompt", kind="agent")

    @classmethod
    def from_user_message(cls, text: str) -> Session:
        """A user session holding one user row with `text`."""
        require_text("text", text)
        return cls([ChunkRow.user(text)], operator="from_user_message", kind="user")

    @classmethod
    def from_messages(cls, messages: Iterable[Mapping[str, Any]]) -> Session:
        """A session from a plain OpenAI `messages` list (system rows stay system rows)."""
        if isinstance(messages, (str, bytes, Mapping)):
            raise ConfigurationError(
                "from_messages takes a list of message dicts, not a single string or dict."
            )
        rows = []
        for i, message in enumerate(messages):
            try:
                rows.append(ChunkRow.from_message(message))
            except ConfigurationError as err:
                raise ConfigurationError(f"message {i}: {err}") from None
        return cls(rows, operator="from_messages", kind="user")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Session:
        """The session persisted at `path` (see `treadle.load_session` for the full record).

        `session.metadata["closed"]` tells whether the pass that wrote it ended gracefully; pass
        the result back to `run_session_loop` to continue it.
        """
        load = ports.loader()
        if load is None:
            raise ConfigurationError("no persist layer is loaded to read sessions; import treadle.")
        session = load(os.fspath(path))
        assert isinstance(session, Session)
        return session

    @classmethod
    def _pending(
        cls,
        lazy: LazyValue[SessionData],
        *,
        id: str,
        operator: str,
        kind: str,
        parents: Sequence[Session],
        sandbox: SandboxHandle | None,
    ) -> Session:
        """A lazy facade whose data arrives when `lazy` settles."""
        return cls._derive(
            None,
            operator=operator,
            kind=kind,
            parents=parents,
            sandbox=sandbox,
            lazy=lazy,
            id=id,
        )

    # -- laziness -------------------------------------------------------------------------------
    def done(self) -> bool:
        """True when the session's rows are available without waiting."""
        return self._data is not None or (self._lazy is not None and self._lazy.done())

    def synchronize(self, timeout: float | None = None) -> Self:
        """Block until the session is materialised; `TimeoutError` after `timeout` seconds."""
        self._materialise(timeout)
        return self

    def _materialise(self, timeout: float | None = None) -> SessionData:
        data = self._data
        if data is None:
            assert self._lazy is not None
            data = self._lazy.result(timeout)
            self._data = data
            self.lineage.usage = data.usage
        return data

    async def _await(self) -> Self:
        if self._data is None:
            assert self._lazy is not None
            self._data = await self._lazy.wait()
            self.lineage.usage = self._data.usage
        return self

    async def wait_ready(self) -> SessionData:
        """Await the data without cancelling the producing pass if this waiter is cancelled."""
        if self._data is None:
            assert self._lazy is not None
            self._data = await self._lazy.wait(propagate_cancel=False)
            self.lineage.usage = self._data.usage
        return self._data

    def __await__(self) -> Generator[Any, None, Self]:
        return self._await().__await__()

    def cancel(self, *, after_turn: bool = False) -> None:
        """Ask the producing pass to stop; `after_turn=True` lets the current turn finish first."""
        if self._lazy is not None and not (after_turn and ports.stop_after_turn(self.id)):
            self._lazy.cancel()

    # -- reading ----------------------------------------------------------------------------
    @property
    def chunk_table(self) -> ChunkTable:
        """The rows (blocks until a pending pass ends)."""
        return self._materialise().table

    @property
    def rows(self) -> tuple[ChunkRow, ...]:
        """Shortcut for `chunk_table.rows`."""
        return self._materialise().table.rows

    @property
    def usage(self) -> Usage:
        """Cumulative token usage (blocks until a pending pass ends)."""
        return self._materialise().usage

    @property
    def stop_reason(self) -> StopReason | None:
        """Why the producing pass ended (`final_answer`, `max_steps`, `budget`, ...)."""
        return self._materialise().stop_reason

    @property
    def metadata(self) -> Mapping[str, Any]:
        """Extra facts the producing pass recorded (read-only)."""
        return self._materialise().metadata

    @property
    def interrupt_reason(self) -> str | None:
        """Why the pass was interrupted (`stop_reason == "interrupted"`), else None."""
        value = self._materialise().metadata.get("interrupt_reason")
        return value if isinstance(value, str) else None

    @property
    def tripwire(self) -> Any:
        """The guardrail `Tripwire` that blocked the pass (stop_reason "blocked"), else None."""
        return self._materialise().metadata.get("tripwire")

    @property
    def pending_approvals(self) -> list[dict[str, Any]]:
        """Tool calls waiting for a human decision (pass them back as `approvals=`)."""
        return list(self._materialise().metadata.get("pending_approvals", ()))

    @property
    def output(self) -> Output:
        """The validated structured output of an agent with an `output_type`, else None."""
        return cast(Output, self._materialise().metadata.get("output"))

    @property
    def data(self) -> SessionData:
        """The materialised data (blocks until a pending pass ends)."""
        return self._materialise()

    def to_messages(self) -> list[dict[str, Any]]:
        """The rows as a plain OpenAI `messages` list."""
        return self._materialise().table.to_messages()

    @property
    def final_text(self) -> str | None:
        """The text of the last assistant row, if any."""
        for row in reversed(self._materialise().table.rows):
            if row.kind == "assistant":
                return text_of_content(row.content)
        return None

    # -- deriving -------------------------------------------------------------------------------
    def _derived(
        self,
        make: Callable[[SessionData], SessionData],
        operator: str,
        sandbox: SandboxHandle | None,
    ) -> Session:
        """A child with data `make(self's data)`: lazy while this one is pending, else built now."""
        lazy = self._pending_value()
        return Session._derive(
            make(self._materialise()) if lazy is None else None,
            operator=operator,
            kind=self.lineage.kind,
            parents=[self],
            sandbox=sandbox,
            lazy=lazy.then(make) if lazy is not None else None,
        )

    def _with_rows(self, rows: Iterable[ChunkRow], operator: str) -> Session:
        added = tuple(rows)
        return self._derived(
            lambda data: SessionData(data.table.extend(added), data.usage), operator, self._sandbox
        )

    def append(self, *rows: ChunkRow) -> Session:
        """A new session with `rows` added (shares this session's sandbox)."""
        return self._with_rows(rows, "append")

    def add_user_message(self, text: str) -> Session:
        """A new session with one more user row: the next turn of a conversation."""
        require_text("text", text)
        return self._with_rows([ChunkRow.user(text)], "add_user_message")

    def fork(self) -> Session:
        """A copy with a new id and this session as parent (shares the rows and the sandbox)."""
        return self._derived(_rows_and_usage, "fork", self._sandbox)

    def merge(self, other: Session) -> Session:
        """A session with this session's rows, then the rows of `other` past their common prefix.

        Usage adds up, counting what a shared ancestor spent once: both sides inherit the usage
        of the sessions they came from, so the nearest common ancestor's usage is subtracted.
        The sandbox is this session's (or `other`'s when this one has none).
        """
        if not isinstance(other, Session):
            raise ConfigurationError(f"merge takes a Session, got {type(other).__name__}.")
        lineages = (self.lineage, other.lineage)

        def make(mine: SessionData, theirs: SessionData) -> SessionData:
            return SessionData(
                *merged_rows_and_usage(
                    (mine.table, mine.usage), (theirs.table, theirs.usage), lineages
                )
            )

        mine, theirs = self._pending_value(), other._pending_value()
        lazy: LazyValue[SessionData] | None = None
        if mine is not None and theirs is not None:  # both still running: settle when both do
            lazy = mine.join(theirs, make)
        elif mine is not None:
            theirs_data = other._materialise()
            lazy = mine.then(lambda data: make(data, theirs_data))
        elif theirs is not None:
            mine_data = self._materialise()
            lazy = theirs.then(lambda data: make(mine_data, data))
        return Session._derive(
            make(self._materialise(), other._materialise()) if lazy is None else None,
            operator="merge",
            kind=self.lineage.kind,
            parents=[self, other],
            sandbox=self._sandbox or other._sandbox,
            lazy=lazy,
        )

    def with_data(self, **changes: Any) -> Session:
        """A copy whose `SessionData` fields are replaced (same id, lineage and sandbox share).

        On a pending session it returns at once a pending copy, as `append` and `fork` do.
        """
        check_data_fields(changes, _DATA_FIELDS)
        pending = self._pending_value()
        new = Session.__new__(Session)
        if self._sandbox is not None:
            self._sandbox.acquire()
        data = None if pending is not None else replace(self._materialise(), **changes)
        lazy = None if pending is None else pending.then(lambda d: replace(d, **changes))
        new._init(self.id, self.lineage, data, lazy, self._sandbox)
        return new

    def _pending_value(self) -> LazyValue[SessionData] | None:
        """This facade's lazy value while its pass still runs (None once data is here)."""
        lazy = self._lazy
        if self._data is None and lazy is not None and not lazy.done():
            return lazy
        return None

    # -- lineage ----------------------------------------------------------------------------------
    def ancestors(self) -> list[LineageNode]:
        """Lineage nodes of every ancestor, nearest first."""
        return self.lineage.ancestors()

    def descendants(self) -> list[LineageNode]:
        """Lineage nodes of every living descendant, nearest first."""
        return self.lineage.descendants()

    def lineage_mermaid(self) -> str:
        """The lineage graph around this session as Mermaid text."""
        return self.lineage.to_mermaid()

    # -- sandbox ----------------------------------------------------------------------------------
    def to(self, placement: PlacementLike) -> Session:
        """A copy bound to a sandbox `placement` (`"local"`, a directory, `"isolated"` or an
        `Isolated(...)` value); opens nothing yet."""
        handle = SandboxHandle(placement)  # ConfigurationError for a placement that is none
        try:
            new = self._derived(_rows_and_usage, "to", handle)
        finally:
            handle.release()  # _derive took the reference the new session owns; drop the creator's
        return new

    @property
    def placement(self) -> str | None:
        """The sandbox placement this session is bound to, if any."""
        return self._sandbox.placement if self._sandbox is not None else None

    @property
    def placement_spec(self) -> dict[str, Any] | None:
        """The placement's options as plain data (`Isolated(...).to_spec()`); None for a name
        (`"local"`, `"isolated"`: defaults), a directory or no placement."""
        return self._sandbox.options_spec() if self._sandbox is not None else None

    @property
    def sandbox_handle(self) -> SandboxHandle | None:
        """The shared, refcounted sandbox handle (None without a placement)."""
        return self._sandbox

    @property
    def sandbox_closed(self) -> bool:
        """True once this session released its sandbox share (or never had one)."""
        return self._finalizer is None or not self._finalizer.alive

    def require_sandbox(self) -> Sandbox:
        """The session's sandbox, opened on first use."""
        if self._sandbox is None:
            raise ConfigurationError(
                "this session has no sandbox placement; bind one with session.to('local')."
            )
        if self.sandbox_closed:
            raise ConfigurationError(
                "this session already closed its sandbox share; use a session that still holds it."
            )
        return self._sandbox.open()

    def close_sandbox(self) -> None:
        """Release this session's share of the sandbox (the backend closes at zero shares)."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close_sandbox()

    async def __aenter__(self) -> Session:
        return await self._await()

    async def __aexit__(self, *exc_info: object) -> None:
        handle = self._sandbox
        if self._finalizer is not None and self._finalizer.alive and handle is not None:
            self._finalizer.detach()
            await handle.arelease()

    def __repr__(self) -> str:
        if self._pending_value() is not None:
            return f"<Session {self.id[:8]} pending>"
        if self._data is None:
            try:
                self._materialise()
            except Exception:
                return f"<Session {self.id[:8]} failed>"
        data = self._data
        assert data is not None
        reason = f" stop={data.stop_reason}" if data.stop_reason else ""
        return f"<Session {self.id[:8]} rows={len(data.table)}{reason}>"


def _rows_and_usage(data: SessionData) -> SessionData:
    return SessionData(data.table, data.usage)
