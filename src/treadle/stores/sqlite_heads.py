"""A SQLite database thread's heads: conversations' head rows as its connection last read or
wrote them (used from the database thread only; see `HeadCache`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treadle.session import ChunkRow, Usage
from treadle.stores.records import (
    ROW_CACHE_CONVERSATIONS,
    StoredConversation,
    decode_json,
    decode_usage,
    stored_conversation,
)

__all__ = ["Head", "HeadCache"]


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs a setattr call a field
class Head:
    """A conversation's head row, decoded: what a read returns besides its rows. A commit of
    this thread moves its head in place (version, usage, stop reason, metadata); nothing else
    holds a head (a read copies its fields out), and a batch that is undone clears them all."""

    usage: Usage
    stop_reason: str | None
    metadata: str
    """As stored (JSON text): each read decodes its own copy, which its reader may change."""
    parent_key: str | None
    parent_version: int | None
    created_at: float
    version: int

    @classmethod
    def of(cls, key: str, found: Sequence[Any]) -> Head:
        """The head from its row as a read selects it (usage, stop_reason, metadata,
        parent_key, parent_version, created_at, version)."""
        usage, stop, meta, parent_key, parent_version, created_at, version = found
        return cls(
            decode_usage(usage, key), stop, meta, parent_key, parent_version, created_at, version
        )

    def stored(self, key: str, rows: tuple[ChunkRow, ...]) -> StoredConversation:
        """The conversation with this head and its `rows` (its own copy of the metadata)."""
        meta = {} if self.metadata == "{}" else decode_json(self.metadata, key)
        return stored_conversation(
            key, rows, self.usage, self.stop_reason, meta, self.parent_key, self.parent_version,
            self.created_at,
        )  # fmt: skip


class HeadCache:
    """Conversation heads as this thread's connection last read or wrote them, so a read (and a
    commit's version check) needs no statement. They are true only while no other connection
    has committed to the file: every transaction of the thread first reads `PRAGMA
    data_version` (which moves only for other connections' commits) and clears them when it
    moved. Writes of this connection update or drop the heads they change. Used from the
    database thread only."""

    def __init__(self, size: int = ROW_CACHE_CONVERSATIONS) -> None:
        self.size = size
        self._heads: dict[str, Head] = {}

    def get(self, key: str) -> Head | None:
        """The head of `key`, if known."""
        return self._heads.get(key)

    def put(self, key: str, head: Head) -> None:
        """Remember the head of `key` (the oldest goes past `size`)."""
        self._heads.pop(key, None)
        self._heads[key] = head
        if len(self._heads) > self.size:
            del self._heads[next(iter(self._heads))]

    def drop(self, key: str) -> None:
        """Forget `key` (a write this cache does not follow)."""
        self._heads.pop(key, None)

    def clear(self) -> None:
        """Forget everything."""
        self._heads.clear()
