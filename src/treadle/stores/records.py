"""The values a conversation store hands back, and how rows become database text and back.

Plain frozen dataclasses cross the boundary between a backend and the rest of Treadle; nothing
here does I/O. Text read back from a database is treated as hostile (it may have been edited or
damaged): each row is parsed with pydantic-core and validated as a `ChunkRow` before use, and a
value that does not parse is a `StoreError` naming the conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic_core

from treadle.errors import ConfigurationError, ConflictError, StoreError
from treadle.session import ChunkRow, Usage

__all__ = [
    "MAX_KEY_LENGTH",
    "ConversationInfo",
    "PassRecord",
    "PendingPass",
    "StoredConversation",
    "check_key",
    "check_storable",
    "decode_json",
    "decode_row",
    "decode_usage",
    "encode_json",
    "encode_row",
    "stored_from_head",
]

#: Longest conversation key accepted (keys are indexed text; a key is a name, not a document).
MAX_KEY_LENGTH = 512

#: How a pass recorded in a store stands. `running`: it started and has not ended (or its process
#: died); `interrupted`: it stopped for an approval or an interrupt and was committed; `cancelled`
#: and `failed`: it was cancelled or raised before it could commit; `done`, `conflict`, `resumed`:
#: settled.
PassStatus = Literal["running", "interrupted", "cancelled", "done", "failed", "conflict", "resumed"]

#: Statuses a resume may pick up (`Store.pending()` lists them).
RESUMABLE: frozenset[str] = frozenset({"running", "interrupted", "cancelled", "failed"})


def check_key(key: object, what: str = "conversation key") -> str:
    """`key` if it is a usable conversation key, else `ConfigurationError`."""
    if not isinstance(key, str) or not key or len(key) > MAX_KEY_LENGTH:
        raise ConfigurationError(
            f"a {what} must be a non-empty str of at most {MAX_KEY_LENGTH} characters, "
            f"got {key!r:.60}."
        )
    if "\x00" in key:  # PostgreSQL text cannot hold NUL and SQLite would cut the key there
        raise ConfigurationError(f"a {what} cannot contain a NUL character, got {key!r:.60}.")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: no database can store it as text
        raise ConfigurationError(
            f"a {what} must be valid Unicode text (it holds a lone surrogate), got {key!r:.60}."
        ) from None
    return key


@dataclass(frozen=True, slots=True)
class StoredConversation:
    """A conversation as committed: its rows in order and the version they make."""

    key: str
    """The conversation's key."""
    rows: tuple[ChunkRow, ...] = ()
    """Every committed row, in commit order."""
    usage: Usage = field(default_factory=Usage)
    """Token usage summed over every committed pass. A fork starts from its parent's total
    when it was made (every pass the parent had committed, also those after the fork point:
    the store keeps one total a conversation, none a pass) and adds its own passes."""
    stop_reason: str | None = None
    """The stop reason of the last committed pass."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """What the last committed pass left for the next one (pending approvals, interrupt reason)."""
    parent_key: str | None = None
    """The conversation this one was forked from (None for a root)."""
    parent_version: int | None = None
    """The version of `parent_key` it was forked at."""
    created_at: float | None = field(default=None, compare=False)
    """When this conversation was created under its key (seconds since the epoch; None for a
    new key): a key deleted and used again is another conversation, with another `created_at`
    (a pass commits only onto the conversation it read, not merely the same version)."""

    @property
    def version(self) -> int:
        """The version: the number of committed rows (a new key is at version 0)."""
        return len(self.rows)


# A read builds one `StoredConversation` a turn: the frozen dataclass's `__init__` sets each
# field through `object.__setattr__` (about 10k instructions for the seven), where the slots'
# own setters do the same in a fifth of that. Same object, same checks on the way out.
_NEW = object.__new__
_SETS = tuple(
    StoredConversation.__dict__[name].__set__
    for name in (
        "key", "rows", "usage", "stop_reason", "metadata", "parent_key", "parent_version",
        "created_at",
    )
)  # fmt: skip


def stored_conversation(
    key: str,
    rows: tuple[ChunkRow, ...],
    usage: Usage,
    stop_reason: str | None,
    metadata: Mapping[str, Any],
    parent_key: str | None,
    parent_version: int | None,
    created_at: float | None = None,
) -> StoredConversation:
    """`StoredConversation(key, rows, ...)` with every field given, built without the frozen
    `__init__` (see `_SETS`): a store's read path."""
    found: StoredConversation = _NEW(StoredConversation)
    s_key, s_rows, s_usage, s_stop, s_meta, s_parent, s_version, s_created = _SETS
    s_key(found, key)
    s_rows(found, rows)
    s_usage(found, usage)
    s_stop(found, stop_reason)
    s_meta(found, metadata)
    s_parent(found, parent_key)
    s_version(found, parent_version)
    s_created(found, created_at)
    return found


@dataclass(frozen=True, slots=True)
class ConversationInfo:
    """One line of `Store.conversations()`: a key, its version and when it last changed."""

    key: str
    version: int
    updated_at: float
    """Seconds since the epoch of the last commit."""
    parent_key: str | None = None
    """The conversation this one was forked from (None for a root)."""


@dataclass(frozen=True, slots=True)
class PendingPass:
    """A pass a store holds that another process may resume (see `Store.pending`).

    `status` is `interrupted` (it stopped for an approval or an interrupt, and its rows are
    committed), `cancelled` (cancelled before it committed) or `running` (it has not ended: it
    may still be running, or its process died; `updated_at` tells how long it has been quiet).
    """

    pass_id: str
    key: str
    status: str
    version: int
    """The conversation version a resume continues from."""
    updated_at: float
    pending_approvals: tuple[Mapping[str, Any], ...] = ()
    """Tool calls waiting for a human decision (`{"id", "name", "arguments"}`)."""
    interrupt_reason: str | None = None
    agent_rows: tuple[ChunkRow, ...] = ()
    """The agent rows (system prompt) the pass ran with."""
    resumable: bool = True
    """False for a `running` pass whose process is still alive (same host: its pid runs with the
    same start id; another host: its lease has not expired): a takeover of it is refused."""


@dataclass(frozen=True, slots=True)
class PassRecord:
    """What an unfinished pass had made durable: its new rows and its tool-call intents."""

    rows: tuple[ChunkRow, ...] = ()
    intents: tuple[str, ...] = ()
    """Ids of tool calls recorded as about to run, in order."""
    status: str = "running"
    """The status the pass had before it was claimed (a failed resume gives it back)."""


def encode_json(value: Any) -> str:
    """`value` as JSON text."""
    return pydantic_core.to_json(value).decode()


def check_storable(rows: Sequence[ChunkRow], what: str = "input rows") -> None:
    """`ConfigurationError` unless `rows` can be stored as JSON text (a lone surrogate such as
    `"\\ud800"`, which a JSON body's escape can carry, cannot): raised before a pass starts, so
    it never fails half-way when it records or commits."""
    try:
        for r in rows:  # the row's wire JSON, cached: the request and the commit reuse it
            r.message_json()
    except (pydantic_core.PydanticSerializationError, ValueError) as err:
        reason = " ".join(str(err).split())
        raise ConfigurationError(
            f"the {what} cannot be stored (text must be valid Unicode, without lone "
            f"surrogates): {reason:.200}"
        ) from None


def decode_json(text: str | bytes, key: str) -> Any:
    """JSON text read from the store; damage is a `StoreError` naming the conversation."""
    try:
        return pydantic_core.from_json(text)
    except ValueError:
        raise StoreError(
            f"conversation {key!r} holds a value that is not JSON; the store is damaged "
            "(delete the conversation or restore it from an export)."
        ) from None


def encode_row(row: ChunkRow) -> tuple[str, str]:
    """`(kind, payload JSON)` for a row.

    The JSON is the row's wire message (`message_json`, encoded once per row and cached: the
    model request has usually encoded it already), which is its payload with a `role` first;
    `decode_row` (any version: `ChunkRow` drops a `role` its kind implies) reads both forms."""
    return row.kind, row.message_json().decode()


def decode_row(kind: str, payload: str | bytes, key: str) -> ChunkRow:
    """A validated row from its stored kind and payload."""
    body = decode_json(payload, key)
    if not isinstance(body, dict):
        raise StoreError(f"conversation {key!r} holds a row that is not a JSON object.")
    try:
        return ChunkRow(kind, body)
    except ConfigurationError as err:
        raise StoreError(f"conversation {key!r} holds an invalid row ({err}).") from None


def decode_usage(text: str | bytes | None, key: str) -> Usage:
    """The `Usage` stored as JSON text (zero when absent)."""
    if not text:
        return Usage()
    u = decode_json(text, key)
    if not isinstance(u, dict):
        return Usage()
    try:
        return Usage(
            int(u.get("prompt_tokens", 0)),
            int(u.get("completion_tokens", 0)),
            int(u.get("total_tokens", 0)),
            int(u.get("requests", 0)),
        )
    except (TypeError, ValueError, OverflowError):  # a count that is text, a list, 1e400
        shown = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise StoreError(
            f"conversation {key!r} holds a usage that is not token counts ({shown!r:.80}); "
            "the store is damaged (delete the conversation or restore it from an export)."
        ) from None


def encode_usage(usage: Usage) -> str:
    """`usage` as JSON text (for integer counts, the text `encode_json(usage.to_dict())` makes)."""
    try:  # four integers: formatted here, without a dict and an encoder call per commit
        return (
            f'{{"prompt_tokens":{usage.prompt_tokens:d},"completion_tokens":'
            f'{usage.completion_tokens:d},"total_tokens":{usage.total_tokens:d},'
            f'"requests":{usage.requests:d}}}'
        )
    except (TypeError, ValueError):  # not integers after all: the encoder says what they are
        return encode_json(usage.to_dict())


def rows_text(rows: Sequence[ChunkRow]) -> list[tuple[str, str]]:
    """Every row as `(kind, payload JSON)`."""
    return [encode_row(r) for r in rows]


#: Metadata of a pass that the conversation keeps for the next pass (and `Store.conversation`).
KEPT_METADATA = ("pending_approvals", "interrupt_reason", "approval_decisions")


def conflict_error(key: str, expected: int, actual: int, rows: Sequence[ChunkRow]) -> ConflictError:
    """The `ConflictError` of a write based on version `expected` of `key`, which is at
    `actual` (the same version: the conversation read was deleted, and the key started again)."""
    if actual == expected:
        what = (
            f"conversation {key!r} was deleted since this writer read it (at version "
            f"{expected}), and the key holds another conversation now"
        )
    else:
        what = (
            f"conversation {key!r} is at version {actual}, not {expected} as this writer read "
            "it: another writer appended first (or the conversation was deleted)"
        )
    return ConflictError(
        f"{what}, so nothing was written; read the conversation again and retry.",
        key=key,
        expected=expected,
        actual=actual,
        rows=tuple(rows),
    )


def exists_error(key: str, version: int) -> ConflictError:
    """The `ConflictError` of a write meant for a new key (an import) to `key`, which holds a
    conversation at `version` (0: created, no rows yet; it exists all the same, as for a fork)."""
    return ConflictError(
        f"conversation {key!r} already exists (version {version}), so nothing was written.",
        key=key,
        expected=0,
        actual=version,
    )


def fork_point(key: str, found: int | None, version: int | None) -> int:
    """The version a fork of `key` (at version `found`; None: no conversation) copies up to:
    `version`, or all of it. No conversation there (an empty one exists: it forks at 0), or a
    version past its end, is a `ConfigurationError`."""
    if found is None:
        raise ConfigurationError(
            f"conversation {key!r} does not exist, so there is nothing to fork; fork an "
            "existing conversation (store.conversations() lists them)."
        )
    if version is not None and not 0 <= version <= found:
        raise ConfigurationError(
            f"conversation {key!r} has versions 0 to {found}; fork at one of those."
        )
    return found if version is None else version


def journal_text(entry: tuple[str, Any]) -> tuple[str, str, str]:
    """`(entry, kind, body)` columns of a journal entry."""
    what, value = entry
    if what == "row":
        assert isinstance(value, ChunkRow)
        return ("row", *rows_text([value])[0])
    call_id, name = value
    return ("intent", str(name), str(call_id))


def journal_record(
    entries: Sequence[tuple[str, str, str]], key: str, status: str = "running"
) -> PassRecord:
    rows: list[ChunkRow] = []
    intents: list[str] = []
    for entry, kind, body in entries:
        if entry == "row":
            rows.append(decode_row(kind, body, key))
        else:
            intents.append(body)
    return PassRecord(tuple(rows), tuple(intents), status)


ROW_CACHE_CONVERSATIONS = 4096


class RowCache:
    """Validated rows of recently read conversations, so a read decodes only rows it has not
    seen. Committed rows never change (a conversation only grows; delete and fork make a new
    `created_at`), so cached rows stay true; a read still asks the database for the version and
    fetches the rows past what it holds. Used from one thread (the backend's) only."""

    def __init__(self, size: int = ROW_CACHE_CONVERSATIONS) -> None:
        self.size = size
        self._rows: dict[str, tuple[float, tuple[ChunkRow, ...]]] = {}
        self._usage: dict[str, tuple[str, Usage]] = {}  # the head's usage text, decoded

    def usage(self, key: str, text: str | None) -> Usage:
        """The `Usage` of `key`'s head usage JSON `text`: decoded once per text (a read after
        this process's own commit finds the text it wrote, and the value it wrote it from)."""
        found = self._usage.get(key)
        if found is not None and found[0] == text:
            return found[1]
        usage = decode_usage(text, key)
        if text is not None:
            self.keep_usage(key, text, usage)
        return usage

    def keep_usage(self, key: str, text: str, usage: Usage) -> None:
        """Remember that `key`'s head usage `text` is `usage` (a commit wrote it)."""
        self._usage.pop(key, None)
        self._usage[key] = (text, usage)
        if len(self._usage) > self.size:
            del self._usage[next(iter(self._usage))]

    def get(self, key: str, created_at: float, version: int) -> tuple[ChunkRow, ...]:
        """The cached rows of `key` if they belong to this incarnation (else none)."""
        found = self._rows.pop(key, None)
        if found is None or found[0] != created_at or len(found[1]) > version:
            return ()
        self._rows[key] = found  # most recently used last
        return found[1]

    def put(self, key: str, created_at: float, rows: tuple[ChunkRow, ...]) -> None:
        """Remember the rows of `key`."""
        self._rows.pop(key, None)
        self._rows[key] = (created_at, rows)
        if len(self._rows) > self.size:
            del self._rows[next(iter(self._rows))]

    def extend(
        self, key: str, base: int, rows: Sequence[ChunkRow], created_at: float | None = None
    ) -> None:
        """A commit of `rows` at version `base`: cached rows that end at `base` grow by them,
        if they are of the conversation the commit checked (`created_at`; None: not checked):
        one deleted and started again meanwhile may hold `base` rows of its own."""
        found = self._rows.pop(key, None)
        if found is None:
            return
        if len(found[1]) == base and (created_at is None or found[0] == created_at):
            found = (found[0], found[1] + tuple(rows))
        self._rows[key] = found  # most recently used last (`put`'s order, without its call)

    def drop(self, key: str) -> None:
        """Forget `key` (deleted)."""
        self._rows.pop(key, None)
        self._usage.pop(key, None)

    def clear(self) -> None:
        """Forget everything."""
        self._rows.clear()
        self._usage.clear()


def stored_from_head(
    key: str, rows: tuple[ChunkRow, ...], head: Sequence[Any], usage: Usage | None = None
) -> StoredConversation:
    """A conversation from its rows and its head row as both backends select it: (usage,
    stop_reason, metadata, parent_key, parent_version, created_at, version); `usage` is the
    head's, when already decoded."""
    meta = {} if head[2] == "{}" else decode_json(head[2], key)  # most heads keep nothing
    if usage is None:
        usage = decode_usage(head[0], key)
    return stored_conversation(key, rows, usage, head[1], meta, head[3], head[4], head[5])
