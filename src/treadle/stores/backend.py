"""`StoreBackend`: the small protocol every conversation store backend implements.

A backend keeps four tables: `conversations` (key, version, usage, what the last pass left),
`rows` (one per committed row, numbered from 0 per conversation: a conversation's version is its
row count), `passes` (every pass that used the store, with its status) and `journal` (the rows
and tool-call intents of a pass that has not committed yet: what a crash must not lose). The
schema is created on first use and versioned (`SCHEMA_VERSION`, `treadle_schema`), and each
later change is one more entry in the backend's migration list.

Every method is a coroutine and none blocks the event loop it is awaited on. A backend raises
`StoreError` when the database fails and `ConflictError` when a version check fails; it never
leaves a half-written commit behind (each method is one transaction).
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from treadle.errors import ConfigurationError
from treadle.session import ChunkRow, Usage
from treadle.stores.queueing import KeyLock
from treadle.stores.records import ConversationInfo, PassRecord, PendingPass, StoredConversation

__all__ = ["SCHEMA_VERSION", "JournalEntry", "StoreBackend", "schema_found"]

#: The schema version a backend creates and migrates to (see each backend's `MIGRATIONS`).
SCHEMA_VERSION = 3


def schema_found(found: object, where: str) -> int:
    """The schema version `max(version)` of a store's `treadle_schema` table gave (`found`;
    None: no row yet, 0), or `ConfigurationError`: the table holds something else than a
    version number (another application's table, or a hand edit), or a newer Treadle's."""
    if found is None:
        return 0
    if isinstance(found, bool) or not isinstance(found, int):
        raise ConfigurationError(
            f"{where} has a treadle_schema table whose version is {found!r:.40}, not a number: "
            "it was not made by Treadle, or was edited; use another database for the store "
            "(or drop that table if nothing else uses it)."
        )
    if found > SCHEMA_VERSION:
        raise ConfigurationError(
            f"the store's schema is version {found}, newer than this Treadle's "
            f"{SCHEMA_VERSION}; upgrade Treadle."
        )
    return found


#: One journal entry of an uncommitted pass: `("row", row)` or `("intent", (call_id, name))`.
JournalEntry = tuple[str, Any]


@runtime_checkable
class StoreBackend(Protocol):
    """What `Store` needs from a database. Implemented by the SQLite and PostgreSQL backends."""

    @property
    def url(self) -> str:
        """Where the store lives, for messages (never holds a password)."""
        ...

    async def lock(self, key: str) -> KeyLock:
        """Wait until this caller holds conversation `key`'s lock, across processes (the
        queue-per-conversation mode: see `treadle.stores.queueing`)."""
        ...

    def load(self, key: str) -> Awaitable[StoredConversation]:
        """The committed conversation (empty at version 0 for a new key): a coroutine, or
        (SQLite) a future of the calling loop, which saves every read two coroutine frames."""
        ...

    async def record(
        self,
        pass_id: str,
        key: str,
        version: int,
        agent_rows: Sequence[ChunkRow],
        entries: Sequence[JournalEntry],
        *,
        start: int,
        supersedes: str | None = None,
        born: float | None = None,
    ) -> None:
        """Make `entries` of a running pass durable as its journal entries from number `start`
        on, keeping any entry already there (a caller cancelled while a write was in flight
        never learns whether it landed, and writes the same entries at the same place again);
        the first call records the pass itself, based on `version`. `supersedes`: the pass a
        resume took over (`claim`), which becomes `resumed` in the same transaction (the
        resume's journal holds its rows from now on). `born`: the `created_at` of the
        conversation the pass read (0.0: none; None: not checked). A write that finds no record
        of its pass is refused with `ConflictError` unless it is the first (`start` 0) and the
        conversation is still the one read: a delete or prune took the record with its
        conversation, and nothing of the pass may come back."""
        ...

    async def commit(
        self,
        pass_id: str,
        key: str,
        base: int,
        rows: Sequence[ChunkRow],
        *,
        usage: Usage,
        stop_reason: str | None,
        metadata: Mapping[str, Any],
        agent_rows: Sequence[ChunkRow],
        recorded: bool = True,
        born: float | None = None,
    ) -> int:
        """Append `rows` at version `base` in one transaction and settle the pass; the new
        version, or `ConflictError` when the conversation is no longer at `base`, is not the
        one the pass read (its `created_at` is not `born`: 0.0 when the pass found none, None
        not checked), or, with `born` given, the pass's record is gone (a recorded pass whose
        conversation was deleted meanwhile). `recorded` False says the pass never called
        `record` (a pass that ends done then needs no record of its own)."""
        ...

    async def settle(self, pass_id: str, status: str, *, was: str = "running") -> None:
        """Move a pass from status `was` to `status` (no effect from any other status)."""
        ...

    async def renew(self, pass_id: str) -> None:
        """Renew a running pass's owner lease (its `updated_at`); no effect once it ended."""
        ...

    async def claim(self, pass_id: str, key: str) -> PassRecord:
        """Take over a pending pass of conversation `key` for a resume: its journal (and its
        status before), or `ConflictError` when another process took it first or the
        conversation moved on (`ConfigurationError` when the pass is another conversation's:
        a `PendingPass` whose key was changed). The
        pass is recorded `running`, owned by this process (`owner`), until the resume's first
        `record` supersedes it or the resume gives it back (`settle`): a resume that never gets
        that far leaves it to be taken over again once this process no longer runs it."""
        ...

    async def append(
        self, key: str, rows: Sequence[ChunkRow], expected: int | None, *, new: bool = False
    ) -> int:
        """Append rows (at the end, or only at version `expected`); the new version. With `new`
        only to a key that holds no conversation, not even an empty one (`exists_error`)."""
        ...

    async def pending(self, key: str | None) -> list[PendingPass]:
        """Passes a resume may pick up, oldest first (of one conversation, or all)."""
        ...

    async def conversations(self) -> list[ConversationInfo]:
        """Every conversation, most recently changed first."""
        ...

    async def fork(self, key: str, new_key: str, version: int | None) -> int:
        """Copy `key` (up to `version`, default all) to the new key `new_key`; its version."""
        ...

    async def delete(self, key: str) -> bool:
        """Delete a conversation, its passes and journal (also the records of passes on the key
        that never committed); True when the key held any of them."""
        ...

    async def prune(self, before: float) -> int:
        """Delete conversations not changed since `before` (epoch seconds), and the records of
        passes that never committed on keys without a conversation, none changed since
        `before`; how many keys."""
        ...

    async def aclose(self, grace: float = 30.0) -> None:
        """Release connections and threads (safe to call twice), waiting at most `grace`
        seconds for work still running."""
        ...
