"""A pass's record in a store: how a pending pass is listed, taken over and given back, from
its stored fields (owner, status, the metadata a resume carries). Shared by both backends."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from treadle.errors import ConfigurationError, ConflictError, StoreError
from treadle.session import ChunkRow
from treadle.stores.owner import owner_alive, this_owner
from treadle.stores.records import (
    RESUMABLE,
    PendingPass,
    conflict_error,
    decode_json,
    encode_json,
)

__all__ = [
    "carried_metadata",
    "check_first_write",
    "check_pass_key",
    "claimed_metadata",
    "gone_error",
    "owner_check",
    "owner_metadata",
    "pending_from",
    "pending_list",
    "resumed_from",
    "waiting_error",
]

log = logging.getLogger("treadle.stores")


def pending_list(found: Sequence[Sequence[Any]], key: str | None) -> list[PendingPass]:
    """`pending()`'s answer from its rows (the fields `pending_from` takes). A damaged record
    fails only the listing of its own conversation: listing every conversation leaves it out
    with an error in the log, so one bad record does not hide every other pending pass."""
    listed = []
    for item in found:
        try:
            listed.append(pending_from(*item))
        except (StoreError, ConfigurationError, ValueError, TypeError, ArithmeticError) as err:
            damage = StoreError(
                f"the pending pass {item[0]} of conversation {item[1]!r} is damaged: {err}"
            )
            if key is not None:
                raise damage from None
            log.error("%s (left out of store.pending())", damage)
    return listed


def pending_from(
    pass_id: str,
    key: str,
    status: str,
    version: int,
    updated: float,
    meta: str,
    agents: str,
    now: float | None = None,
) -> PendingPass:
    """A pending pass from its stored fields; `now` is the clock its `updated` was written by
    (the database server's on PostgreSQL), this machine's when not given."""
    metadata = decode_json(meta, key)
    clock = time.time() if now is None else float(now)
    alive = status == "running" and owner_alive(metadata, float(updated), clock, pass_id)
    if status == "running" and not alive:  # a takeover that nobody runs: its status before it
        status = resumed_from(metadata, status)
    approvals = metadata.get("pending_approvals") if isinstance(metadata, dict) else None
    reason = metadata.get("interrupt_reason") if isinstance(metadata, dict) else None
    messages = decode_json(agents, key)
    return PendingPass(
        pass_id,
        key,
        status,
        int(version),
        float(updated),
        tuple(a for a in approvals or () if isinstance(a, dict)),
        reason if isinstance(reason, str) else None,
        tuple(ChunkRow.from_message(m) for m in messages if isinstance(m, dict)),
        not alive,
    )


def check_pass_key(pass_id: str, stored_key: object, claimed_key: str) -> None:
    """`ConfigurationError` when the pass a resume takes over is another conversation's (a
    `PendingPass` whose key was changed): its rows would go on in the wrong conversation."""
    if stored_key is not None and stored_key != claimed_key:
        raise ConfigurationError(
            f"pass {pass_id} belongs to conversation {stored_key!r}, not {claimed_key!r}: "
            "resume an item of store.pending() as it was listed."
        )


def owner_check(
    pass_id: str, key: str, status: str, meta: str, updated: float, now: float | None = None
) -> None:
    """`ConflictError` when a claimed `running` pass's owner process is still alive (`now` as
    in `pending_from`)."""
    clock = time.time() if now is None else float(now)
    if status == "running" and owner_alive(decode_json(meta, key), float(updated), clock, pass_id):
        raise ConflictError(
            f"pass {pass_id} is still running in a live process; wait for it to end (or stop "
            "that process) before resuming it.",
            key=key,
        )


def owner_metadata() -> str:
    """The metadata a running pass is recorded with: its owner process."""
    return encode_json({"owner": this_owner()})


def waiting_error(key: str, metadata: object, version: int) -> ConflictError | None:
    """The `ConflictError` of a new turn or an append on a conversation whose last pass waits
    for decisions on tool calls (None when it waits for none): rows after tool calls that have
    no results make a transcript no model accepts, and would bury the pending approval."""
    waiting = metadata.get("pending_approvals") if isinstance(metadata, Mapping) else None
    if not waiting:
        return None
    names = ", ".join(str(c.get("name")) for c in waiting if isinstance(c, Mapping))
    return ConflictError(
        f"conversation {key!r} waits for a decision on {names}; resume it first: "
        "run_session_loop(Session(), agent, store=store, conversation=store.pending(key)[0], "
        "approvals={call_id: True or False}).",
        key=key,
        expected=version,
        actual=version,
    )


def carried_metadata(meta: str | None, key: str) -> str:
    """The metadata a resume's own pass is recorded with: its owner (this process), and what
    the pass it took over held for a resume (the approvals it waits for, why it stopped), so a
    resume that ends before it answers them is listed with them."""
    found = decode_json(meta, key) if meta else None
    carried = (
        {k: v for k, v in found.items() if k not in _OWNED} if isinstance(found, Mapping) else {}
    )
    return encode_json({**carried, "owner": this_owner()})


#: Metadata keys that belong to one pass's record, not carried to the pass that resumes it.
_OWNED = frozenset({"owner", "resumed_from"})


def resumed_from(metadata: object, status: str) -> str:
    """The status a pass had before a takeover made it `running` (`status` when it had none)."""
    was = metadata.get("resumed_from") if isinstance(metadata, Mapping) else None
    return was if isinstance(was, str) and was in RESUMABLE else status


def claimed_metadata(meta: str, key: str, status: str) -> tuple[str, str]:
    """A pass taken over for a resume: its metadata as the takeover records it (this process
    its owner, its status before the takeover kept, whatever it held kept too), and that
    status. A takeover records the pass `running`, owned by the resuming process, until the
    resume records rows of its own (then it is `resumed`) or gives it back: a resume that never
    gets that far leaves it to be taken over again once its owner is gone."""
    found = decode_json(meta, key)
    metadata = dict(found) if isinstance(found, Mapping) else {}
    was = resumed_from(metadata, status) if status == "running" else status
    metadata["owner"] = this_owner()
    metadata["resumed_from"] = was
    return encode_json(metadata), was


#: Conversations whose validated rows a backend keeps in memory (least recently used go first).


def gone_error(key: str, pass_id: str, version: int) -> ConflictError:
    """The `ConflictError` of a running pass whose conversation was deleted (its record with
    it) while it ran: nothing more of it is written (the deleted user's text stays deleted)."""
    return ConflictError(
        f"conversation {key!r} was deleted while pass {pass_id} ran (or deleted and started "
        "again): nothing more of the pass was written; start a new pass to go on.",
        key=key,
        expected=version,
        actual=version,
    )


def check_first_write(
    pass_id: str,
    key: str,
    version: int,
    start: int,
    born: float | None,
    head: tuple[int | None, float],
) -> None:
    """A `record` that finds no record of its pass: refused (`ConflictError`) unless it is the
    pass's first write (`start` 0) and the conversation is still the one it read (`head`: its
    version and `created_at` now, (None, 0.0) when there is none; `born` as the pass read it,
    None: not checked). A later write without a record is a pass whose conversation a delete
    or prune took (with the record) while it ran: writing it again would bring back what was
    deleted."""
    if start > 0:
        raise gone_error(key, pass_id, version)
    found, created = head
    if born is not None and created != born:
        if born:  # the conversation it read is gone (another may hold the key now)
            raise gone_error(key, pass_id, version)
        raise conflict_error(key, version, found or 0, ())  # another writer started the key
