"""`ChunkRow` and `ChunkTable`: the rows of a session, as immutable values.

A row is one OpenAI chat message (system, user, assistant with tool calls, or a tool result),
validated at the edge when built from outside data. A row encodes its wire JSON once and caches it,
so request bodies are joined from cached bytes instead of re-serialising the transcript each round.

A table is immutable but appends in O(1): tables that extend one another share one backing list,
and only a table that branches from the middle copies. This module does no I/O.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, cast, get_args, overload

import pydantic_core
from pydantic import ValidationError

from treadle.errors import ConfigurationError
from treadle.session.calls import ToolCall, tool_calls_of
from treadle.session.deferred import DeferredModel

__all__ = [
    "ROLE_OF_KIND",
    "ChunkRow",
    "ChunkTable",
    "RowKind",
    "in_call_order",
    "text_of_content",
    "valid_text",
]

RowKind = Literal["system", "user", "assistant", "tool_result"]
ROW_KINDS: frozenset[str] = frozenset(get_args(RowKind))

#: The OpenAI message role each row kind is sent as.
ROLE_OF_KIND: Mapping[str, str] = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool_result": "tool",
}
KIND_OF_ROLE: Mapping[str, RowKind] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool_result",
}


#: A UTF-16 surrogate code point: alone in a `str`, no UTF-8 file or database text can hold it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def valid_text(value: Any) -> Any:
    """`value` with every surrogate code point in its strings (keys too, through dicts and
    lists) replaced by U+FFFD, the same object when it has none.

    Text a pass makes (a tool's result, the model's reply from an executor) goes through this
    where it enters the transcript: a lone surrogate (`"\\udcff"` from a file name read with
    `surrogateescape`) would otherwise fail the pass at its end, when JSONL persistence or a
    store writes it as UTF-8.
    """
    # Every row passes here and almost none has a surrogate: look first, building nothing. A
    # dirty value is rebuilt by `_replaced`, which does not look again at each level (that
    # would walk a deep value once per level: quadratic).
    return value if _clean(value) else _replaced(value)


def _replaced(value: Any) -> Any:
    """`valid_text`'s rebuild: parts without a surrogate come back as the same objects."""
    if isinstance(value, str):
        if value.isascii() or _SURROGATE.search(value) is None:
            return value
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        pairs = [(_replaced(k), _replaced(v)) for k, v in value.items()]
        if all(k2 is k and v2 is v for (k2, v2), (k, v) in zip(pairs, value.items(), strict=True)):
            return value
        return dict(pairs)
    if isinstance(value, list | tuple):
        items = [_replaced(v) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _clean(value: Any) -> bool:
    """True when no string in `value` (keys too, through dicts, lists and tuples) holds a
    surrogate: a walk that builds nothing, where `valid_text`'s rebuild makes a list per level."""
    if isinstance(value, str):
        return value.isascii() or _SURROGATE.search(value) is None
    if isinstance(value, dict):
        for key, item in value.items():
            if not (type(key) is str and key.isascii()) and not _clean(key):
                return False
            if item is not None and not (type(item) is str and item.isascii()) and not _clean(item):
                return False
        return True
    if isinstance(value, list | tuple):
        for item in value:
            if item is not None and not (type(item) is str and item.isascii()) and not _clean(item):
                return False
    return True


def text_of_content(content: object) -> str | None:
    """The text of a message `content`: a string as is, the `text` parts of a parts list joined.

    Parts of other types (Mistral's `thinking`, images, refusals) are not text of the answer.
    """
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text") or "")
            for part in content
            if isinstance(part, dict) and part.get("type", "text") == "text"
        )
    return None


# Roles a row keeps although its kind implies another one.
_KEPT = frozenset({"developer"})


class _Open(DeferredModel):
    # Unknown provider fields (reasoning content, annotations) are kept, never rejected. The
    # schema is built on the first validation, not at import (`import treadle` stays fast).
    pass


class _TextPayload(_Open):
    content: str | list[dict[str, Any]]


class _FunctionPayload(_Open):
    name: str
    arguments: str


class _CustomPayload(_Open):
    name: str
    input: str


class _ToolCallPayload(_Open):
    id: str
    type: Literal["function", "custom"] = "function"
    function: _FunctionPayload | None = None
    custom: _CustomPayload | None = None


class _AssistantPayload(_Open):
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[_ToolCallPayload] | None = None


class _ToolResultPayload(_Open):
    tool_call_id: str
    name: str | None = None  # Treadle records it; the Chat Completions API does not require it
    content: str | list[dict[str, Any]]


_VALIDATORS: Mapping[str, type[_Open]] = {
    "system": _TextPayload,
    "user": _TextPayload,
    "assistant": _AssistantPayload,
    "tool_result": _ToolResultPayload,
}


# Pydantic adds the tried member type to the location of a union error ("content.str"); users
# want the field path only.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def _describe(err: ValidationError) -> str:
    first = err.errors()[0]
    parts = [
        str(p) for p in first["loc"] if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p))
    ]
    field = ".".join(parts) or "<payload>"
    return f"field '{field}': {first['msg']}"


class ChunkRow:
    """One row of a session: a `kind` and its OpenAI wire-shaped `payload` (without `role`).

    Build rows with `ChunkRow(kind, payload)`; bad data raises `ValueError` naming the field.
    Treat a row as immutable: its wire JSON is encoded once and cached.
    """

    __slots__ = ("_json", "kind", "payload")

    kind: RowKind
    payload: dict[str, Any]

    def __init__(self, kind: str, payload: Mapping[str, Any]) -> None:
        if kind not in ROW_KINDS:
            raise ConfigurationError(
                f"row kind {kind!r} is not one of {sorted(ROW_KINDS)}; pick one of those."
            )
        if not isinstance(payload, Mapping):
            raise ConfigurationError(
                f"{kind} row payload must be a mapping, got {type(payload).__name__}."
            )
        # `developer` is a system row that keeps its role (newer OpenAI models read it so).
        body = {
            k: v for k, v in payload.items() if k != "role" or (kind == "system" and v in _KEPT)
        }
        try:
            _VALIDATORS[kind].model_validate(body)
        except ValidationError as err:
            raise ConfigurationError(f"invalid {kind} row: {_describe(err)}") from None
        self.kind = cast(RowKind, kind)
        self.payload = body
        self._json: bytes | None = None

    @classmethod
    def _trusted(cls, kind: RowKind, payload: dict[str, Any]) -> ChunkRow:
        """Build a row from data Treadle itself produced and already validated (hot path)."""
        row = cls.__new__(cls)
        row.kind = kind
        row.payload = payload
        row._json = None
        return row

    # -- constructors in the user's words -------------------------------------------------
    @classmethod
    def system(cls, text: str) -> ChunkRow:
        """A system row holding `text`."""
        return cls("system", {"content": text})

    @classmethod
    def user(cls, text: str) -> ChunkRow:
        """A user row holding `text`."""
        return cls("user", {"content": text})

    @classmethod
    def from_message(cls, message: Mapping[str, Any]) -> ChunkRow:
        """A row from one OpenAI message dict (`role` decides the kind)."""
        if not isinstance(message, Mapping):
            raise ConfigurationError(
                f"a message must be a dict with a 'role', got {type(message).__name__}."
            )
        role = message.get("role")
        kind = KIND_OF_ROLE.get(role) if isinstance(role, str) else None
        if kind is None:
            raise ConfigurationError(
                f"field 'role': {role!r} is not one of {sorted(KIND_OF_ROLE)}."
            )
        return cls(kind, message)

    # -- reading ----------------------------------------------------------------------------
    @property
    def role(self) -> str:
        """The OpenAI role this row is sent as (`developer` stays `developer`)."""
        kept = self.payload.get("role")
        return kept if isinstance(kept, str) else ROLE_OF_KIND[self.kind]

    @property
    def content(self) -> Any:
        """The row's `content` field (text, parts, or None)."""
        return self.payload.get("content")

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The tool calls of an assistant row (empty for other kinds)."""
        calls = self.payload.get("tool_calls")
        return list(calls) if calls else []

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """The tool calls of an assistant row as typed `ToolCall` values (empty otherwise)."""
        return tool_calls_of(self.payload.get("tool_calls"))

    def to_message(self) -> dict[str, Any]:
        """This row as an OpenAI message dict (a fresh dict the caller may change)."""
        return {"role": self.role, **self.payload}

    def message_json(self) -> bytes:
        """This row's message, encoded as JSON once and cached."""
        cached = self._json
        if cached is None:
            cached = pydantic_core.to_json(self.to_message())
            self._json = cached
        return cached

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChunkRow):
            return NotImplemented
        return self.kind == other.kind and self.payload == other.payload

    __hash__ = None  # type: ignore[assignment]  # payloads are dicts

    def __repr__(self) -> str:
        return f"ChunkRow(kind={self.kind!r}, payload={self.payload!r})"


class _Store:
    """The backing list shared by tables that extend one another."""

    __slots__ = ("lock", "rows")

    def __init__(self, rows: list[ChunkRow]) -> None:
        self.rows = rows
        self.lock = threading.Lock()


class ChunkTable(Sequence[ChunkRow]):
    """An immutable, ordered table of `ChunkRow`s with O(1) appends.

    `append` returns a new table. When the table is the newest view of its backing list the row
    is appended in place and shared; a table that branches from an older view copies its prefix.
    """

    __slots__ = ("_n", "_store", "_tuple")

    def __init__(self, rows: Iterable[ChunkRow] = ()) -> None:
        items = list(rows)
        for i, row in enumerate(items):
            if not isinstance(row, ChunkRow):
                raise ConfigurationError(
                    f"row {i} is a {type(row).__name__}, not a ChunkRow; build rows with ChunkRow."
                )
        self._store = _Store(items)
        self._n = len(items)
        self._tuple: tuple[ChunkRow, ...] | None = None

    @classmethod
    def _trusted(cls, rows: list[ChunkRow]) -> ChunkTable:
        """A table owning `rows`, rows Treadle built itself (no per-row type check; hot path)."""
        return cls._view(_Store(rows), len(rows))

    @classmethod
    def _view(cls, store: _Store, n: int) -> ChunkTable:
        table = cls.__new__(cls)
        table._store = store
        table._n = n
        table._tuple = None
        return table

    def append(self, row: ChunkRow) -> ChunkTable:
        """A new table with `row` added at the end."""
        return self.extend((row,))

    def extend(self, rows: Iterable[ChunkRow]) -> ChunkTable:
        """A new table with `rows` added at the end."""
        new = list(rows)
        for row in new:
            if not isinstance(row, ChunkRow):
                raise ConfigurationError(
                    f"cannot append a {type(row).__name__}; build rows with ChunkRow."
                )
        store = self._store
        with store.lock:
            if len(store.rows) == self._n:
                store.rows.extend(new)
                return ChunkTable._view(store, self._n + len(new))
            prefix = store.rows[: self._n]
        return ChunkTable._view(_Store(prefix + new), self._n + len(new))

    @property
    def rows(self) -> tuple[ChunkRow, ...]:
        """The rows as a tuple (built once per table)."""
        cached = self._tuple
        if cached is None:
            cached = tuple(self._store.rows[: self._n])
            self._tuple = cached
        return cached

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> ChunkRow: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[ChunkRow]: ...
    def __getitem__(self, index: int | slice) -> ChunkRow | Sequence[ChunkRow]:
        if isinstance(index, slice):
            return self.rows[index]
        n = self._n
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("chunk table index out of range")
        return self._store.rows[index]

    def __iter__(self) -> Iterator[ChunkRow]:
        rows = self._store.rows
        for i in range(self._n):
            yield rows[i]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChunkTable):
            return NotImplemented
        return self._n == other._n and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def to_messages(self) -> list[dict[str, Any]]:
        """The rows as OpenAI message dicts."""
        return [row.to_message() for row in self]

    def kinds(self) -> list[str]:
        """The kind of each row, in order (handy in tests and logs)."""
        return [row.kind for row in self]

    def __repr__(self) -> str:
        return (
            f"ChunkTable({self._n} rows: {', '.join(self.kinds()[:8])}{'…' if self._n > 8 else ''})"
        )


def in_call_order(rows: Iterable[ChunkRow]) -> list[ChunkRow]:
    """`rows` with each round's tool results in the order of the calls they answer.

    Results are persisted as they finish, and a resumed round answers its calls after the ones
    answered before the crash; the transcript still lists them in call order.
    """
    out: list[ChunkRow] = []
    order: dict[str, int] = {}
    run: list[ChunkRow] = []

    def flush() -> None:
        run.sort(key=lambda r: order.get(str(r.payload.get("tool_call_id")), len(order)))
        out.extend(run)
        run.clear()

    for row in rows:
        if row.kind == "tool_result":
            run.append(row)
            continue
        flush()
        if row.kind == "assistant":
            order = {c.id: i for i, c in enumerate(row.calls)}
        out.append(row)
    flush()
    return out
