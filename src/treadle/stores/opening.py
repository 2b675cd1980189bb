"""Where a pass on a stored conversation starts: `open_conversation` reads the conversation (or
takes over a pending pass) and returns the rows to continue from with the pass's
`ConversationJournal` (see `treadle.stores.journal`). Never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treadle.errors import ConfigurationError, ConflictError
from treadle.session import ChunkRow, Usage
from treadle.session.rows import in_call_order
from treadle.stores.backend import StoreBackend
from treadle.stores.journal import ConversationJournal
from treadle.stores.owner import LIVE
from treadle.stores.records import (
    PassRecord,
    PendingPass,
    StoredConversation,
    check_key,
    check_storable,
    conflict_error,
)

__all__ = ["ConversationStart", "open_conversation"]

log = logging.getLogger("treadle.stores")


@dataclass(slots=True)
class ConversationStart:
    """Where a pass on a stored conversation starts."""

    rows: list[ChunkRow]
    """The rows the pass continues from: the committed conversation, then its new input."""
    usage: Usage
    """The conversation's usage so far."""
    metadata: dict[str, Any]
    """What the last pass left (pending approvals) and tool calls of unknown outcome."""
    journal: ConversationJournal
    """Where the pass records its progress and commits."""


async def open_conversation(
    backend: StoreBackend,
    conversation: str | PendingPass,
    pass_id: str,
    user_rows: Sequence[ChunkRow],
    agent_rows: Sequence[ChunkRow],
    *,
    queue: bool = False,
) -> ConversationStart:
    """Read the conversation (or take over a pending pass) a pass continues.

    With `queue` the pass first waits for the conversation's lock and holds it until it ends
    (the store's `on_conflict="queue"` mode), so it reads the rows the previous pass committed.

    The input rows are added after the committed ones, unless they already begin with all of
    them (a session read with `store.conversation(key)` and extended): then only the rows past
    them are new. Input that begins like the conversation but not with all of it was read from
    an older version, and is a `ConflictError` (it would repeat rows).
    """
    if isinstance(conversation, PendingPass):
        key = conversation.key
    elif isinstance(conversation, str):
        key = check_key(conversation)
    else:
        raise ConfigurationError(
            "conversation= takes a key (str) or an item of store.pending(), got "
            f"{type(conversation).__name__}."
        )
    check_storable(user_rows, "user input")
    check_storable(agent_rows, "agent rows")
    if not queue and key is conversation:
        # The common turn (a key, no queue): the read is awaited here and the start built by
        # a plain call (one coroutine frame fewer on every resume of the pass's await chain).
        return _started(backend, key, pass_id, user_rows, agent_rows, await backend.load(key))
    held = await backend.lock(key) if queue else None
    try:
        start = await _start(backend, conversation, key, pass_id, user_rows, agent_rows)
    except BaseException:
        if held is not None:
            await held.release()
        raise
    start.journal.held = held
    return start


async def _start(
    backend: StoreBackend,
    conversation: str | PendingPass,
    key: str,
    pass_id: str,
    user_rows: Sequence[ChunkRow],
    agent_rows: Sequence[ChunkRow],
) -> ConversationStart:
    if not isinstance(conversation, PendingPass):
        return _started(backend, key, pass_id, user_rows, agent_rows, await backend.load(key))
    record, stored, token = await _take_over(backend, conversation.pass_id, key)
    adopted = in_call_order(record.rows)
    answered = {str(r.payload.get("tool_call_id")) for r in adopted if r.kind == "tool_result"}
    unknown = [cid for cid in record.intents if cid not in answered]
    metadata: dict[str, Any] = dict(stored.metadata)
    if unknown:
        metadata["unknown_outcome_tool_calls"] = unknown
    try:
        new = _new_rows(key, user_rows, stored.rows)
    except BaseException:
        del LIVE[conversation.pass_id], token
        _schedule_give_back(backend, conversation.pass_id, record.status)
        raise
    journal = ConversationJournal(backend, key, pass_id, len(stored.rows), agent_rows)
    journal.claimed = (conversation.pass_id, record.status)
    LIVE[conversation.pass_id] = journal  # until its first write supersedes it, or it ends
    fresh = [*adopted, *new]
    journal.buffered.extend(("row", r) for r in fresh)
    # Calls of unknown outcome stay so: if this pass stops before it answers them, the next
    # resume must not take them for calls that never started.
    journal.buffered.extend(("intent", (cid, "")) for cid in unknown)
    return ConversationStart([*stored.rows, *fresh], stored.usage, metadata, journal)


class _Taking:
    """What `LIVE` holds for a pass a resume took over, until its journal exists."""

    __slots__ = ("__weakref__",)


#: Passes a resume in this process is taking over (the takeover in flight).
_TAKING: set[str] = set()
#: Give-backs of takeovers whose resume was cancelled (strong references while they run).
_GIVING: set[asyncio.Task[None]] = set()


async def _take_over(
    backend: StoreBackend, taking: str, key: str
) -> tuple[PassRecord, StoredConversation, _Taking]:
    """Take pending pass `taking` over (`claim`) and read its conversation; the token `LIVE`
    holds for it (the caller keeps it until the pass's journal takes its place).

    The takeover records the pass `running`, owned by this process (`StoreBackend.claim`); from
    then on this process runs it (`LIVE`) until the resume's journal supersedes it or gives it
    back. A resume cancelled (or failing) in between gives it back itself: the takeover runs
    as a task of its own, so a cancellation that arrives while it is in flight (it lands all the
    same, wherever the backend runs it) still sees its outcome, and settles the pass back to
    its status before. Whatever prevents that too (the loop ends first) leaves the pass
    `running` but out of `LIVE`: resumable in this process, and in others once this one ends.
    """
    if taking in LIVE or taking in _TAKING:  # one resume of a pass at a time in a process
        raise ConflictError(
            f"pass {taking} is being resumed in this process; wait for that resume to end.",
            key=key,
        )
    _TAKING.add(taking)
    token = _Taking()
    try:
        claim = asyncio.ensure_future(backend.claim(taking))
        try:
            record = await asyncio.shield(claim)
        except asyncio.CancelledError:
            claim.add_done_callback(functools.partial(_give_back, backend, taking))
            raise
        LIVE[taking] = token  # runs here now (its journal takes the place when made)
        try:
            stored = await backend.load(key)
        except BaseException:
            del LIVE[taking]
            _schedule_give_back(backend, taking, record.status)
            raise
    finally:
        _TAKING.discard(taking)
    return record, stored, token


def _give_back(backend: StoreBackend, taking: str, claim: asyncio.Future[PassRecord]) -> None:
    """A takeover whose resume was cancelled while it was in flight has ended: if it landed,
    give the pass back."""
    if not claim.cancelled() and claim.exception() is None:
        _schedule_give_back(backend, taking, claim.result().status)


def _schedule_give_back(backend: StoreBackend, taking: str, status: str) -> None:
    async def give_back() -> None:
        try:
            await backend.settle(taking, status, was="running")
        except Exception as err:  # the store itself may be what failed
            log.warning("could not give pass %s back after its resume ended: %s", taking, err)

    task = asyncio.ensure_future(give_back())
    _GIVING.add(task)
    task.add_done_callback(_GIVING.discard)


def _started(
    backend: StoreBackend,
    key: str,
    pass_id: str,
    user_rows: Sequence[ChunkRow],
    agent_rows: Sequence[ChunkRow],
    stored: StoredConversation,
) -> ConversationStart:
    """Where a new pass on `key` starts, from the conversation as read."""
    waiting = stored.metadata.get("pending_approvals") if stored.metadata else None
    if waiting:
        # A new turn after an assistant row whose calls have no results would be a transcript
        # no model accepts: the calls must be decided first (approved or denied).
        names = ", ".join(str(c.get("name")) for c in waiting if isinstance(c, dict))
        raise ConflictError(
            f"conversation {key!r} waits for a decision on {names}; resume it first: "
            "run_session_loop(Session(), agent, store=store, conversation=store.pending(key)[0], "
            "approvals={call_id: True or False}).",
            key=key,
            expected=stored.version,
            actual=stored.version,
        )
    committed = stored.rows
    new = _new_rows(key, user_rows, committed)
    journal = ConversationJournal(
        backend, key, pass_id, len(committed), agent_rows, [("row", r) for r in new]
    )
    return ConversationStart([*committed, *new], stored.usage, dict(stored.metadata), journal)


def _new_rows(
    key: str, user_rows: Sequence[ChunkRow], committed: tuple[ChunkRow, ...]
) -> Sequence[ChunkRow]:
    """The input rows past the committed ones (see `open_conversation`)."""
    if not committed:
        return user_rows
    n = len(committed)
    if len(user_rows) >= n and tuple(user_rows[:n]) == committed:
        return user_rows[n:]
    if len(user_rows) > 1 and user_rows[0] == committed[0]:
        raise conflict_error(key, _read_version(user_rows, committed), n, user_rows)
    return user_rows


def _read_version(rows: Sequence[ChunkRow], committed: Sequence[ChunkRow]) -> int:
    """How many committed rows `rows` begins with (the version it was read at)."""
    n = 0
    for mine, theirs in zip(rows, committed, strict=False):
        if mine != theirs:
            break
        n += 1
    return n
