"""How a pass keeps a conversation in a store: it starts from the committed rows, makes its
tool work durable as it goes, and commits its new rows in one transaction when it ends.

`treadle.stores.opening.open_conversation` reads the conversation (or takes over a pending
pass) and returns a `ConversationJournal`, which the pass calls as it calls its JSONL writer.
Until the commit the pass's rows live in the store's journal, never in the conversation: a
crash, a cancellation or a lost store leaves the conversation at its last committed version,
and the journal lets another process resume. The assistant row that asks for tools is made
durable together with the intents of those calls, before any of them runs, and each tool
result as it finishes, so a crash loses only a reply the model is asked for again, never a tool
outcome. An answer without tool calls is written once, by the commit. Never blocks the event
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from treadle.errors import ConflictError
from treadle.session import ChunkRow, Usage
from treadle.stores.backend import JournalEntry, StoreBackend
from treadle.stores.owner import LIVE, Running, lease_seconds
from treadle.stores.queueing import KeyLock

__all__ = ["ConversationJournal", "inflight"]

log = logging.getLogger("treadle.stores")


@dataclass(slots=True, weakref_slot=True)
class ConversationJournal:
    """The pass's side of a stored conversation (the same calls as its JSONL writer)."""

    backend: StoreBackend
    key: str
    pass_id: str
    base: int
    """The version the pass read: its commit succeeds only if the conversation is still there."""
    agent_rows: Sequence[ChunkRow]
    buffered: list[JournalEntry] = field(default_factory=list)
    """Rows not yet durable: made durable with the next intents or tool result, or the commit."""
    version: int | None = None
    """The version the commit made (None until it succeeds)."""
    recorded: bool = False
    """True once the pass wrote anything to the store's journal."""
    claimed: tuple[str, str] | None = None
    """`(pass id, its status)` of the pending pass this one took over, if any."""
    heartbeat: asyncio.Task[None] | None = None
    """Renews the pass's owner lease while it is recorded as running (see `owner`)."""
    held: KeyLock | None = None
    """The conversation's lock, in queue mode: given back when the pass has ended."""
    abandoned: bool = False
    """The pass was cancelled while its commit was in flight: the commit (its task, or
    `_landed`) settles it."""
    failure: BaseException | None = None
    """Why the commit failed, once it has (the pass reads it from its waiter; kept here for a
    pass cancelled in the same instant, whose waiter then holds nothing)."""
    waiter: asyncio.Future[int] | None = None
    """Where the commit task hands its outcome to the pass (see `finish`)."""
    started: bool = False
    """True once the commit task's body runs (until then only its done callback settles it)."""
    end: asyncio.Future[int] | None = None
    """A commit without a task (`commit_soon`): its end, what `inflight` holds."""
    journaled: int = 0
    """How many journal entries the pass has sent: the next write's place."""
    unsure: list[tuple[int, list[JournalEntry]]] = field(default_factory=list)
    """Writes (place, entries) sent but not known to have landed (see `_flush`)."""
    running: Running | None = None
    """What `LIVE` holds for this pass (and the pass it took over) while this process runs it."""
    born: float | None = None
    """The read conversation's `created_at` (0.0: the key had none): its writes and commit land
    only on that conversation, not on one started again under the key after a delete."""

    def run_here(self, *pass_ids: str) -> None:
        """This process runs the pass (it is recorded `running` from its first write on), and
        the pass it took over, if any."""
        if self.running is None:
            self.running = Running(asyncio.get_running_loop())
        for pass_id in pass_ids:
            LIVE[pass_id] = self.running

    async def take(self) -> None:
        """A resume's first write, right after its takeover: the pass records itself (with
        what it adopted) and supersedes the pass it took over in the same transaction, so
        the resume's own record (with its lease and heartbeat) holds the pass from now on,
        even when it ends without another write (a resume that stops for the same approval
        again)."""
        await self._flush(force=True)

    async def _flush(
        self, more: Sequence[JournalEntry] = (), *, lease: bool = True, force: bool = False
    ) -> None:
        entries = [*self.buffered, *more]
        self.buffered.clear()
        if not entries and not force:
            return
        if not self.recorded:  # recorded `running` from now on: this process runs it
            self.run_here(self.pass_id)
        self.recorded = True
        # Each write has its own place, taken before it is sent (tool results of one round
        # flush at once). Until it is known to have landed it stays in `unsure`: cancelled
        # while in flight (it goes on, wherever the backend runs it, and may land after the
        # pass's later calls) or failed, it is written again at the same place when the pass
        # records its end, before the end is settled; the backend keeps the first copy (see
        # `StoreBackend.record`), so nothing is journaled twice and no late write makes an
        # ended pass look `running`.
        write = (self.journaled, entries)
        self.journaled += len(entries)
        self.unsure.append(write)
        await self._write(*write)
        self.unsure.remove(write)
        if lease and self.heartbeat is None:
            self.heartbeat = asyncio.ensure_future(self._renew_lease())

    async def _write(self, start: int, entries: Sequence[JournalEntry]) -> None:
        await self.backend.record(
            self.pass_id, self.key, self.base, self.agent_rows, entries,
            start=start, supersedes=None if self.claimed is None else self.claimed[0],
            born=self.born,
        )  # fmt: skip

    async def _renew_lease(self) -> None:
        """Every third of the lease, renew it: a long tool call on another host must not look
        like a dead owner (its pass would be resumed, and run twice)."""
        every = lease_seconds() / 3
        while True:
            await asyncio.sleep(every)
            try:
                await self.backend.renew(self.pass_id)
            except Exception as err:  # the pass's own next write reports a lost store
                log.warning("could not renew the lease of pass %s: %s", self.pass_id, err)

    def _stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.cancel()

    async def rows(self, rows: Sequence[ChunkRow], *, turn_boundary: bool = False) -> None:
        """New rows of the pass: a tool result is made durable at once, others with the next."""
        flush = self.rows_soon(rows)
        if flush is not None:
            await flush

    def rows_soon(self, rows: Sequence[ChunkRow]) -> Coroutine[Any, Any, None] | None:
        """`rows` without a coroutine when nothing is written now: the rows are buffered and
        None is returned, or (a tool result among them) the flush to await is returned."""
        for r in rows:
            if r.kind == "tool_result":
                return self._flush([("row", r) for r in rows])
        self.buffered += [("row", r) for r in rows]
        return None

    async def intents(self, calls: Sequence[tuple[str, str]]) -> None:
        """Record (durably, with the rows before them) that these calls are about to run."""
        await self._flush([("intent", call) for call in calls])

    async def finish(
        self,
        rows: Sequence[ChunkRow],
        *,
        usage: Usage,
        stop_reason: str | None,
        metadata: Mapping[str, Any],
    ) -> int:
        """Commit the pass's new rows (`rows` is the whole transcript) in one transaction.

        Once started, the commit is never torn: it runs as a task the store owns, or, on a
        backend with `commit_soon` (SQLite) and outside queue mode, as a job its database
        thread runs to its end, settled by one call on this loop (no task: two loop callbacks
        fewer per turn); either is in `inflight`. So a cancellation of the pass is delivered at
        once (`CancelledError`, with a note naming the conversation) while the commit goes on to
        land the whole turn or none.
        If it does not land, the pass is recorded `cancelled` (`Store.pending()` lists it);
        `Store.asettled()` / `Store.aclose()` wait for such commits to settle.
        """
        if self.heartbeat is not None:
            self.heartbeat.cancel()
        # The commit task hands its outcome to `waiter` itself and leaves `inflight` itself:
        # no shield and no done callback once it runs, so a turn's commit wakes this task once
        # (a shield cost three more loop callbacks per turn). The waiter is cancelled with this
        # task; the commit task is not. (Futures are made without `loop.create_future`, a
        # Python call each.)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[int] = asyncio.Future(loop=loop)
        self.waiter = waiter
        commit_soon = getattr(self.backend, "commit_soon", None)
        commit: asyncio.Future[int]
        if commit_soon is not None and self.held is None:
            # A backend that settles a commit by a call on this loop (SQLite) needs no task:
            # `commit` is only the commit's end, for `inflight`; `_landed` settles the pass.
            self.end = commit = asyncio.Future(loop=loop)
            self.started = True
            commit_soon(
                self._landed,
                self.pass_id, self.key, self.base, rows[self.base :],
                usage=usage, stop_reason=stop_reason, metadata=metadata,
                agent_rows=self.agent_rows, recorded=self.recorded, born=self.born,
            )  # fmt: skip
            inflight(self.backend).add(commit)  # settled on the database thread's reply, later
        else:
            commit = asyncio.ensure_future(
                self._commit(
                    waiter, rows[self.base :], usage=usage, stop_reason=stop_reason,
                    metadata=metadata,
                )
            )  # fmt: skip
            # An eager task factory (Python 3.12) may have run the commit to its end already,
            # its `finally` included: only a commit still running is added (its `finally` is
            # then still to come). A task cancelled before its first step never runs its body:
            # until the body starts (and removes it), a done callback settles the pass in its
            # place.
            if not commit.done():
                inflight(self.backend).add(commit)
                if not self.started:
                    commit.add_done_callback(self._unstarted)
        try:
            version = await waiter
        except asyncio.CancelledError as cancel:
            if commit.done():  # it ended first: its outcome is the pass's, settled as usual
                error = _outcome_error(waiter) or self.failure
                if error is not None:
                    cancel.__cause__ = error
                    cancel.add_note(
                        f"treadle: the commit of conversation {self.key!r} (pass "
                        f"{self.pass_id}) had failed; the turn did not land."
                    )
                elif not commit.cancelled() and commit.result() >= 0:
                    cancel.add_note(
                        f"treadle: the commit of conversation {self.key!r} (pass "
                        f"{self.pass_id}) had ended: the turn landed (version {commit.result()})."
                    )
                raise
            self.abandoned = True  # the commit task settles the pass (see `_commit`)
            cancel.add_note(
                f"treadle: the commit of conversation {self.key!r} (pass {self.pass_id}) was in "
                "flight: it goes on (the pass's cancellation does not reach it); whether the "
                "turn landed is in the store "
                "(after `await store.asettled()`, store.conversation(key) holds the turn "
                "if it landed; see docs/stores.md)."
            )
            raise
        self.buffered.clear()
        return version

    async def _commit(
        self,
        waiter: asyncio.Future[int],
        new: Sequence[ChunkRow],
        *,
        usage: Usage,
        stop_reason: str | None,
        metadata: Mapping[str, Any],
    ) -> int:
        """The commit task: the turn, then the queue's lock; its outcome goes to `waiter` (when
        the pass still waits); if it fails once the pass was cancelled (`abandoned`), the pass's
        record is settled here as `cancelled`. Never raises but its own cancellation (nobody
        awaits the task: the pass reads `waiter`)."""
        self.started = True
        task = asyncio.current_task()
        if task is not None:  # running now: the `finally` below settles the pass
            task.remove_done_callback(self._unstarted)
        try:
            try:
                version = await self.backend.commit(
                    self.pass_id,
                    self.key,
                    self.base,
                    new,
                    usage=usage,
                    stop_reason=stop_reason,
                    metadata=metadata,
                    agent_rows=self.agent_rows,
                    recorded=self.recorded,
                    born=self.born,
                )
            except BaseException as err:
                if isinstance(err, Exception):
                    self.failure = err
                if self.abandoned:  # nobody reads this error: the record says what happened
                    if isinstance(err, ConflictError):
                        await self._release()
                    else:
                        await self._record_end("cancelled")
                    return -1
                if not waiter.done():
                    if isinstance(err, asyncio.CancelledError):
                        waiter.cancel()
                    else:
                        waiter.set_exception(err)
                if isinstance(err, Exception):
                    return -1  # given to the pass through `waiter`
                raise
            self.version = version
            await self._release()  # committed: the next pass in the queue may start
            if not waiter.done():
                waiter.set_result(version)
            return version
        finally:
            inflight(self.backend).discard(asyncio.current_task())

    def _landed(self, outcome: int | BaseException) -> None:
        """A commit without a task (`commit_soon`) has its outcome, on this loop: settle the pass
        as `_commit` does (no lock to give back: only passes without one come here), then end
        `self.end` (what `Store.asettled` waits for)."""
        waiter, commit = self.waiter, self.end
        assert waiter is not None and commit is not None
        if type(outcome) is int:  # landed (the common case first)
            self.version = outcome
            if not waiter.done():
                waiter.set_result(outcome)
            self._ended(commit, outcome)
            return
        if isinstance(outcome, BaseException):
            if isinstance(outcome, Exception):
                self.failure = outcome
            if self.abandoned and not isinstance(outcome, ConflictError):
                # Nobody reads this error: the record says what happened (then `commit` ends).
                end = asyncio.ensure_future(self._record_end("cancelled"))
                _ENDING.add(end)
                end.add_done_callback(_ENDING.discard)
                end.add_done_callback(lambda _: self._ended(commit, -1))
                return
            if not waiter.done():
                waiter.set_exception(outcome)
            self._ended(commit, -1)
            return
        self.version = outcome
        if not waiter.done():
            waiter.set_result(outcome)
        self._ended(commit, outcome)

    def _ended(self, commit: asyncio.Future[int], version: int) -> None:
        self._unlive()
        inflight(self.backend).discard(commit)
        if not commit.done():
            commit.set_result(version)

    def _unstarted(self, commit: asyncio.Future[int]) -> None:
        """The commit task ended before its body ran (cancelled before its first step, as a
        shutdown cancelling every task does): nothing was sent. It leaves `inflight`, and the
        pass is settled as the body would have: its waiter cancelled, or, once the pass was
        cancelled itself, its record ended `cancelled` (resumable, listed by `pending()`)."""
        inflight(self.backend).discard(commit)
        if self.abandoned:
            end = asyncio.ensure_future(self._record_end("cancelled"))
            _ENDING.add(end)
            end.add_done_callback(_ENDING.discard)
        elif self.waiter is not None and not self.waiter.done():
            self.waiter.cancel()

    async def _release(self) -> None:
        self._unlive()
        held, self.held = self.held, None
        if held is not None:
            await held.release()

    def _unlive(self) -> None:
        """The pass has ended: no record of it (or of the pass it took over) is run here now."""
        running, self.running = self.running, None
        if running is None:
            return
        for pass_id in (self.pass_id, *(() if self.claimed is None else (self.claimed[0],))):
            if LIVE.get(pass_id) is running:
                del LIVE[pass_id]

    async def aclose(self, error: BaseException | None) -> None:
        """The pass ended without a commit: keep what it had, resumable.

        Its rows so far (input, adopted, made) are made durable and the pass is marked
        `cancelled` or `failed`, so `Store.pending()` lists it; a pass that took over another and
        has nothing of its own gives that one back. A lost race (`ConflictError`) keeps nothing:
        the conversation moved on. Never raises: the pass's own error is what its reader sees.
        """
        self._stop_heartbeat()
        if self.abandoned:  # the commit in flight settles the pass (landed, or `cancelled`)
            return
        if (
            self.version is not None
            or isinstance(error, ConflictError)
            or isinstance(getattr(error, "__cause__", None), ConflictError)  # lost, then cancelled
        ):
            await self._release()
            return
        status = "cancelled" if isinstance(error, asyncio.CancelledError) else "failed"
        # The end is recorded by a task of its own, awaited through every further cancellation:
        # a pass is often cancelled more than once (its reader leaves, then its scope closes),
        # and an asyncio cancellation goes through anyio's shields. Cut between the flush and
        # the settle, the pass would stay `running` in the store for good.
        end = asyncio.ensure_future(self._record_end(status))
        _ENDING.add(end)
        end.add_done_callback(_ENDING.discard)
        while not end.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(end)

    async def _record_end(self, status: str) -> None:
        try:
            if self.recorded or self.buffered:
                for write in list(self.unsure):  # again, at its place: before the end
                    await self._write(*write)
                    self.unsure.remove(write)
                await self._flush(lease=False)  # the pass is ending: no lease to renew
                await self.backend.settle(self.pass_id, status)
            elif self.claimed is not None:  # give the pass it took over back, as it was
                await self.backend.settle(self.claimed[0], self.claimed[1], was="running")
        except Exception as err:  # the store itself may be what failed
            log.warning("could not record the end of pass %s: %s", self.pass_id, err)
        finally:  # recorded (or not): the next pass in the queue starts from the same rows
            await self._release()


def _outcome_error(waiter: asyncio.Future[int]) -> BaseException | None:
    """The commit's error as the commit task left it in `waiter` (None: it landed or the
    waiter was cancelled first)."""
    if waiter.cancelled() or not waiter.done():
        return None
    return waiter.exception()


def inflight(backend: StoreBackend) -> set[asyncio.Future[int]]:
    """The commits in flight on `backend` (strong references: the store owns them)."""
    # Kept on the backend itself when it takes attributes: looked up twice every turn, where a
    # weak dictionary's lookup is a Python call and a new weak reference.
    found: set[asyncio.Future[int]] | None = getattr(backend, "_treadle_inflight", None)
    if found is not None:
        return found
    try:
        return _INFLIGHT[backend]
    except KeyError:
        found = _INFLIGHT.setdefault(backend, set())
    with contextlib.suppress(AttributeError):  # a backend with __slots__: the weak dictionary
        backend._treadle_inflight = found  # type: ignore[attr-defined]
    return found


#: Commits in flight, per backend (see `inflight`, `Store.asettled`).
_INFLIGHT: weakref.WeakKeyDictionary[Any, set[asyncio.Future[int]]] = weakref.WeakKeyDictionary()


#: Ends of passes being recorded (strong references while their tasks run).
_ENDING: set[asyncio.Future[None]] = set()
