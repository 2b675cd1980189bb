"""Where a pass on a stored conversation starts: `open_conversation` reads the conversation (or
takes over a pending pass) and returns the rows to continue from with the pass's
`ConversationJournal` (see `treadle.stores.journal`). Never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treadle.errors import ConfigurationError, ConflictError
from treadle.session import ChunkRow, Usage
from treadle.session.rows import in_call_order
from treadle.stores.backend import StoreBackend
from treadle.stores.journal import ConversationJournal, inflight
from treadle.stores.owner import LIVE, Running, runs_here
from treadle.stores.pass_records import waiting_error
from treadle.stores.records import (
    PassRecord,
    PendingPass,
    StoredConversation,
    check_key,
    check_storable,
    conflict_error,
)
from treadle.tools.unanswered import answer_gaps

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
        key = check_key(conversation.key)  # a value the caller may have built or changed
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
    taking = conversation.pass_id
    record, stored, running = await _take_over(backend, taking, key)
    adopted = in_call_order(record.rows)
    answered = {str(r.payload.get("tool_call_id")) for r in adopted if r.kind == "tool_result"}
    unknown = [cid for cid in record.intents if cid not in answered]
    metadata: dict[str, Any] = dict(stored.metadata)
    if unknown:
        metadata["unknown_outcome_tool_calls"] = unknown
    try:
        new = _answered_first((*stored.rows, *adopted), _new_rows(key, user_rows, stored.rows))
        if new and stored.metadata.get("pending_approvals"):
            # The new rows would follow tool calls that have no results (and the decisions
            # would be lost with them): the calls are decided first, in a resume of their own.
            raise ConfigurationError(
                f"conversation {key!r} waits for decisions on tool calls: resume it with "
                "approvals= and no new message first, then send the message as a new turn."
            )
    except BaseException:
        if LIVE.get(taking) is running:
            del LIVE[taking]
        _give_back_soon(backend, taking, record.status, running.loop)
        raise
    journal = ConversationJournal(backend, key, pass_id, len(stored.rows), agent_rows)
    journal.born = stored.created_at or 0.0
    journal.claimed = (taking, record.status)
    journal.running = running  # this process runs the pass taken over, and now this one
    fresh = [*adopted, *new]
    journal.buffered.extend(("row", r) for r in fresh)
    # Calls of unknown outcome stay so: if this pass stops before it answers them, the next
    # resume must not take them for calls that never started.
    journal.buffered.extend(("intent", (cid, "")) for cid in unknown)
    try:
        await journal.take()
    except BaseException as err:  # its end is recorded (the write again first): resumable
        await journal.aclose(err)
        raise
    return ConversationStart([*stored.rows, *fresh], stored.usage, metadata, journal)


#: Passes a resume in this process is taking over, with the loop doing it: from the takeover's
#: start until the resume's journal holds the pass, or the takeover is given back (a resume
#: cancelled mid-takeover). A loop closed meanwhile can finish neither: its entries are stale.
_TAKING: dict[str, asyncio.AbstractEventLoop] = {}


async def _take_over(
    backend: StoreBackend, taking: str, key: str
) -> tuple[PassRecord, StoredConversation, Running]:
    """Take pending pass `taking` over (`claim`) and read its conversation; what `LIVE` holds
    for it (the caller keeps it: the pass's journal takes it over).

    The takeover records the pass `running`, owned by this process (`StoreBackend.claim`); from
    then on this process runs it (`LIVE`) until the resume's first write supersedes it or the
    resume gives it back. A resume cancelled (or failing) before gives it back itself: the
    takeover runs as a task of its own, so a cancellation that arrives while it is in flight
    (it lands all the same, wherever the backend runs it) still sees its outcome, and settles
    the pass back to its status before; until then no other resume in this process takes it
    (one that did could be set back under it). Whatever prevents the give-back (the loop ends
    first) leaves the pass `running` but not run here: resumable in this process, and in others
    once this one ends.
    """
    loop = asyncio.get_running_loop()
    held = _TAKING.get(taking)
    if runs_here(taking) or (held is not None and not held.is_closed()):
        raise ConflictError(
            f"pass {taking} is being resumed in this process; wait for that resume to end.",
            key=key,
        )
    _TAKING[taking] = loop
    handed = False  # the give-back, not this call, ends the `_TAKING` entry
    try:
        claim = asyncio.ensure_future(backend.claim(taking, key))
        try:
            record = await asyncio.shield(claim)
        except asyncio.CancelledError:
            # `Store.asettled` waits for the takeover and, once it lands, its give-back.
            late = asyncio.ensure_future(_claimed_late(backend, taking, loop, claim))
            settling = inflight(backend)
            settling.add(late)
            late.add_done_callback(settling.discard)
            handed = True
            raise
        running = Running(loop)
        LIVE[taking] = running  # runs here now (the resume's journal keeps `running`)
        try:
            stored = await backend.load(key)
        except BaseException:
            LIVE.pop(taking, None)
            _give_back_soon(backend, taking, record.status, loop)
            handed = True
            raise
    finally:
        if not handed and _TAKING.get(taking) is loop:
            del _TAKING[taking]
    return record, stored, running


async def _claimed_late(
    backend: StoreBackend,
    taking: str,
    loop: asyncio.AbstractEventLoop,
    claim: asyncio.Future[PassRecord],
) -> int:
    """The takeover of a resume cancelled while it was in flight: once it ends, give the pass
    back if it landed (then let other resumes in), else let them in now."""
    try:
        record = await claim
    except BaseException:  # it did not land (or its loop is ending): nothing to give back
        if _TAKING.get(taking) is loop:
            del _TAKING[taking]
        return 0
    await _give_back(backend, taking, record.status, loop)
    return 0


async def _give_back(
    backend: StoreBackend, taking: str, status: str, loop: asyncio.AbstractEventLoop
) -> None:
    try:
        await backend.settle(taking, status, was="running")
    except Exception as err:  # the store itself may be what failed
        log.warning("could not give pass %s back after its resume ended: %s", taking, err)
    finally:
        if _TAKING.get(taking) is loop:
            del _TAKING[taking]


def _give_back_soon(
    backend: StoreBackend, taking: str, status: str, loop: asyncio.AbstractEventLoop
) -> None:
    """Settle a pass this process took over back to `status`, in a task `Store.asettled`
    waits for; until it has, no other resume in this process takes the pass over."""
    _TAKING[taking] = loop

    async def give_back() -> int:
        await _give_back(backend, taking, status, loop)
        return 0

    task = asyncio.ensure_future(give_back())
    settling = inflight(backend)
    settling.add(task)
    task.add_done_callback(settling.discard)


def _started(
    backend: StoreBackend,
    key: str,
    pass_id: str,
    user_rows: Sequence[ChunkRow],
    agent_rows: Sequence[ChunkRow],
    stored: StoredConversation,
) -> ConversationStart:
    """Where a new pass on `key` starts, from the conversation as read."""
    refused = waiting_error(key, stored.metadata, stored.version) if stored.metadata else None
    if refused is not None:
        raise refused
    committed = stored.rows
    new = _answered_first(committed, _new_rows(key, user_rows, committed))
    journal = ConversationJournal(
        backend, key, pass_id, len(committed), agent_rows, [("row", r) for r in new]
    )
    journal.born = stored.created_at or 0.0
    return ConversationStart([*committed, *new], stored.usage, dict(stored.metadata), journal)


def _answered_first(committed: tuple[ChunkRow, ...], new: Sequence[ChunkRow]) -> Sequence[ChunkRow]:
    """`new`, with a "no result" row for each tool call that has none before the first row
    that goes on past it (`answer_gaps`): a conversation can end inside a round (a session
    imported or appended so, a fork cut between a call and its result, a pass interrupted
    mid-round), the input can hold such a gap itself (a session interrupted, then given a new
    message), and a message after calls without results is a transcript the model's API
    refuses. Input of results only leaves the pass to run the calls still unanswered (a resume:
    `pending_tool_calls`); results the input brings itself are kept, and a misplaced or
    repeated one is a `ConfigurationError` (nothing is written yet)."""
    return answer_gaps(new, committed) if new else new


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
