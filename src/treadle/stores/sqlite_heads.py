"""A SQLite database thread's heads: conversations' head rows as its connection last read or
wrote them (used from the database thread only; see `HeadCache`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.session import Usage
from treadle.stores.records import ROW_CACHE_CONVERSATIONS, decode_usage

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
        self.get: Callable[[str], Head | None] = self._heads.get
        """The head of `key`, if known (the dictionary's own `get`: every read and commit asks,
        and a method of this class would cost each a Python call)."""

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
