"""What crosses the wire per pass: `PassItem` (a session going out) and `PassOutcome` (its result).

Both are plain JSON: sessions travel as OpenAI message lists (`session.to_messages()` and back
with `Session.from_messages`), usage as its four counters. An outcome records every attempt (the
worker it ran on and how it ended), so at-least-once delivery is visible in the results. This
module must never hold a live `Session` in an outcome: outcomes are data.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from treadle.distributed.frozen import positional
from treadle.distributed.outcome_metadata import (
    expanded_usage,
    json_data,
    local_metadata,
    portable_metadata,
)
from treadle.errors import ConfigurationError, PassFailed, PassLost
from treadle.session import Session, SessionData, Usage, new_session_id
from treadle.session.rows import (
    KIND_OF_ROLE,
    ROLE_OF_KIND,
    ROW_KINDS,
    ChunkRow,
    ChunkTable,
    RowKind,
)

__all__ = [
    "OUTCOME_METADATA_KEY",
    "PassFailed",
    "PassItem",
    "PassLost",
    "PassOutcome",
    "PassStatus",
    "input_data",
    "local_metadata",
    "pass_failure",
    "portable_metadata",
    "received_rows",
    "received_session",
]

PassStatus = Literal["ok", "error", "timeout", "lost"]
"""How a pass ended: it finished, it raised, it ran past `pass_timeout`, or every attempt was on
a worker that died."""

#: The metadata key of a rebuilt output session holding `{status, attempts, worker, ...}`.
OUTCOME_METADATA_KEY = "treadle.distributed"


@dataclass(frozen=True, slots=True)
class PassItem:
    """One session sent to a worker: its position, id, messages and sandbox placement (with its
    options' spec, env values included: workers are the caller's own)."""

    index: int
    session_id: str
    messages: list[dict[str, Any]]
    placement: str | None = None
    attempt: int = 1
    trace_context: dict[str, str] | None = None
    """W3C trace-context headers of the map's caller (None when tracing is off there)."""
    placement_options: dict[str, Any] | None = None
    """`Isolated(...).to_spec()` of the session's placement (None for a name or a directory)."""

    @classmethod
    def from_input(
        cls, index: int, value: Any, trace_context: dict[str, str] | None = None
    ) -> PassItem:
        """An item from a map input: a finished `Session` or a user message string."""
        if isinstance(value, str):  # the message `Session.from_user_message` holds, without it
            message = {"role": "user", "content": value}
            if cls is PassItem:  # one per input: no `__init__` (`frozen.positional`)
                return _build_item(index, new_session_id(), [message], None, 1, trace_context, None)
            return cls(index, new_session_id(), [message], trace_context=trace_context)
        if not isinstance(value, Session):
            raise ConfigurationError(
                f"a distributed map takes Sessions or strs, got {type(value).__name__}."
            )
        return cls(
            index,
            value.id,
            value.to_messages(),
            value.placement,
            trace_context=trace_context,
            placement_options=value.placement_spec,
        )

    def to_json(self) -> dict[str, Any]:
        """The item as a JSON-able dict (its fields are JSON data already: not copied)."""
        # Read in C (`attrgetter`, `zip`): a `getattr` per field in a comprehension was a
        # tenth of the driver's own Python per input.
        return dict(zip(_ITEM_FIELDS, _item_attributes(self), strict=True))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PassItem:
        """The item from `to_json` output."""
        return cls(**data)


@dataclass(frozen=True, slots=True)
class PassOutcome:
    """The result of one input: status, attempts, worker, and the output session as data."""

    index: int
    """Position of the input in the map's iterable."""
    session_id: str
    """Id of the input session."""
    status: PassStatus
    attempts: int
    """Attempts made (more than 1 when a worker died with the pass in flight)."""
    worker: str
    """The worker of the last attempt, `host:pid`."""
    messages: list[dict[str, Any]] | None = None
    """The output session's rows as OpenAI messages (None unless status is ok)."""
    usage: dict[str, int] = field(default_factory=dict)
    """Token usage: `prompt_tokens`, `completion_tokens`, `total_tokens`, `requests`."""
    stop_reason: str | None = None
    error: str | None = None
    """`ErrorType: message` when the pass did not finish."""
    history: tuple[dict[str, Any], ...] = ()
    """One `{attempt, worker, status, error}` per attempt, oldest first."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """The output's metadata as JSON data: `output` (a structured output, dumped), `agent`,
    `handoffs`, `tripwire`, `guardrail_results`, `request_usage`, `handled_error`, ..."""
    rows: list[tuple[RowKind, dict[str, Any]]] | None = field(
        default=None, compare=False, repr=False
    )
    """(internal) The output's rows as `(kind, payload)` pairs, the form a process worker sends
    them in: it skips `to_messages` and the driver builds rows from them without copying a
    message. `treadle.map` builds its output sessions from them; every outcome a caller sees
    (`map_outcomes`, `PassWorker.run`, the results file) has `messages` instead (`_public`)."""

    @property
    def ok(self) -> bool:
        """True when the pass finished (whatever its stop reason)."""
        return self.status == "ok"

    def session(self) -> Session:
        """The output session rebuilt from the outcome (raises `PassFailed` if it failed,
        `PassLost` when its workers were lost)."""
        outcome = self._public()
        if outcome.status != "ok" or outcome.messages is None:
            raise pass_failure(outcome)
        return outcome._output(Session.from_messages(outcome.messages))

    def _public(self) -> PassOutcome:
        """This outcome as a caller sees it: `messages` made from the worker's `rows`."""
        if self.rows is None:
            return self
        metadata = expanded_usage(self.metadata)  # a failed item's caller gets the dicts too
        try:
            messages = rows_messages(self.rows)
        except _MalformedRows as err:  # that pass fails, naming the row (not the whole map)
            error = f"MalformedOutput: the worker's output: {err}"
            return dataclasses.replace(
                self, status="error", error=error, messages=None, metadata=metadata, rows=None
            )
        return dataclasses.replace(self, messages=messages, metadata=metadata, rows=None)

    def _output(self, base: Session) -> Session:
        """`base` (the rows) with this outcome's usage, stop reason and metadata."""
        info = {
            "status": self.status,
            "attempts": self.attempts,
            "worker": self.worker,
            "input_session_id": self.session_id,
        }
        return base.with_data(
            usage=Usage(**self.usage) if self.usage else Usage(),
            stop_reason=self.stop_reason,
            metadata={**local_metadata(self.metadata), OUTCOME_METADATA_KEY: info},
        )

    def to_json(self) -> dict[str, Any]:
        """The outcome as a JSON-able dict (one line of the results file).

        Messages, usage and history are JSON data already and go out as they are:
        `dataclasses.asdict` deep-copied every message of every outcome, a third of a process
        worker's CPU in a fan-out of short passes. Metadata gets the conversion asdict made (a
        dataclass value anywhere in it becomes a dict).
        """
        if self.rows is not None:
            return self._public().to_json()
        data = {name: getattr(self, name) for name in _JSON_FIELDS}
        data["history"] = list(self.history)
        data["metadata"] = json_data(self.metadata)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PassOutcome:
        """The outcome from `to_json` output (or a worker's, with `rows`)."""
        if cls is PassOutcome and type(data) is dict and len(data) == len(_OUTCOME_FIELDS):
            # A worker's outcome has every field: built positionally. Its keys were unpickled,
            # equal to the parameter names but not the same strings, so the keyword call
            # compared each with the names before it (36 k -> 22 k instructions an outcome).
            try:
                values = list(_outcome_values(data))
            except KeyError:
                pass  # another key: the keyword call refuses it as it always did
            else:
                values[_HISTORY] = tuple(values[_HISTORY])
                return _build_outcome(*values)
        if cls is PassOutcome and type(data) is dict and len(data) == len(_FINISHED_FIELDS):
            try:  # a worker's finished pass (`PassWorker.run_wire`)
                (
                    index,
                    session_id,
                    status,
                    attempts,
                    worker,
                    usage,
                    stop,
                    metadata,
                    kinds,
                    payloads,
                ) = _finished_values(data)
            except KeyError:
                pass  # another key: the keyword call refuses it as it always did
            else:
                record = {"attempt": attempts, "worker": worker, "status": status, "error": None}
                rows = _wire_rows(kinds, payloads)
                return _build_outcome(
                    index, session_id, status, attempts, worker, None, usage, stop, None,
                    (record,), metadata, rows,
                )  # fmt: skip
        return cls(**{**data, "history": tuple(data.get("history", ()))})


def received_session(outcome: PassOutcome) -> Session:
    """The output session of an outcome one of this map's own workers sent (what
    `treadle.map(..., backend="process" | "ray")` returns): `outcome.session()`, but its rows are
    built without validating them again.

    The worker built those rows (its output session's rows as `(kind, payload)` pairs, or
    `messages` from a Ray worker, pickled to the process that spawned it: rows its loop
    validated, after the input's rows as the caller passed them, which an in-process map does
    not validate again either), and validating them again was two thirds of the driver's CPU per
    pass (docs/performance.md, issue 33). Only their shape is checked: a row no worker of this
    version sends (not a pair, a payload not a dict, a role that disagrees with its kind, an
    unknown kind or role) takes the validating path, which raises `PassFailed` naming the row
    (`MalformedOutput: ...`) or `ConfigurationError` naming the field. Anything else (a results
    file, an outcome built by hand) uses `outcome.session()`."""
    if outcome.status != "ok" or (outcome.messages is None and outcome.rows is None):
        raise pass_failure(outcome)
    if outcome.rows is not None:
        table = _pairs_table(outcome.rows)
    else:
        table = received_rows(outcome.messages)  # type: ignore[arg-type]
    if table is None:
        return outcome.session()
    # One session with its data built once: `_output` builds a first session and copies its
    # data into a second (`with_data`), a fifth of the rebuild (docs/performance.md, issue 33).
    info = {
        "status": outcome.status,
        "attempts": outcome.attempts,
        "worker": outcome.worker,
        "input_session_id": outcome.session_id,
    }
    metadata = local_metadata(outcome.metadata)
    metadata[OUTCOME_METADATA_KEY] = info
    # The frozen values built without `__init__`'s per-field `object.__setattr__`
    # (`treadle.distributed.frozen`), as `_request_usages` and `from_json` build theirs.
    data = _build_data(table, _usage(outcome.usage), cast(Any, outcome.stop_reason), metadata)
    return Session._derive(data, operator="from_messages", kind="user", parents=(), sandbox=None)


def received_rows(messages: list[dict[str, Any]]) -> ChunkTable | None:
    """The rows of `messages` that crossed a map's pipe (a worker's output session, or a
    driver's input: an input session's `to_messages()` or a user message from a `str`),
    built without validating them again; None for a message no Treadle of this version sends
    (then `Session.from_messages` is the way, and names the problem).

    Only the role is checked. An input session's rows were validated when they were made, but
    a caller may have edited them since (content an int, say): such rows are not refused here,
    as an in-process map, which runs the session itself, does not refuse them either."""
    rows: list[ChunkRow] = []
    append, trusted, kinds = rows.append, ChunkRow._trusted, KIND_OF_ROLE
    for message in messages:
        role = message.get("role") if type(message) is dict else None
        kind = kinds.get(role) if type(role) is str else None
        if kind is None:
            return None
        payload = dict(message)  # the messages stay as they are (an outcome's record)
        if role != "developer":  # a row keeps only that role (see `ChunkRow`)
            del payload["role"]
        append(trusted(kind, payload))
    return ChunkTable._trusted(rows)


def _pairs_table(pairs: list[tuple[RowKind, dict[str, Any]]]) -> ChunkTable | None:
    """The rows of a worker's `(kind, payload)` pairs, the payloads taken as they are (the
    worker's own rows, pickled to this process); None for a pair no worker of this version
    sends (then the validating rebuild names the problem)."""
    if type(pairs) is not list:
        return None
    rows: list[ChunkRow] = []
    append, trusted, kinds, kind_of_role = rows.append, ChunkRow._trusted, ROW_KINDS, KIND_OF_ROLE
    try:  # a pair of another length: ValueError; an unhashable kind or role: TypeError
        for pair in pairs:
            kind, payload = pair
            if type(pair) is not tuple or kind not in kinds or type(payload) is not dict:
                return None
            # A row keeps a role only when it is its kind's (`developer`, a system row): a role
            # that disagrees would reach the caller's output beside the kind.
            if "role" in payload and kind_of_role.get(payload["role"]) != kind:
                return None
            append(trusted(kind, payload))
    except (TypeError, ValueError):
        return None
    return ChunkTable._trusted(rows)


class _MalformedRows(ValueError):
    """A worker's rows no worker of this version sends, beyond what validating them can name."""


def rows_messages(pairs: list[tuple[RowKind, dict[str, Any]]]) -> list[dict[str, Any]]:
    """A worker's `(kind, payload)` rows as OpenAI messages (what `to_messages` makes).

    Raises `_MalformedRows`, naming the row, for what is not a list of `(kind, payload)` pairs
    with dict payloads whose role (if kept) agrees with their kind; an unknown kind is left to
    `Session.from_messages`, which names it."""
    if type(pairs) is not list:
        raise _MalformedRows(f"the rows are a {type(pairs).__name__}, not a list")
    roles, kind_of_role = ROLE_OF_KIND, KIND_OF_ROLE
    out: list[dict[str, Any]] = []
    for i, pair in enumerate(pairs):
        if type(pair) is not tuple or len(pair) != 2:
            raise _MalformedRows(f"row {i} is not a (kind, payload) pair")
        kind, payload = pair
        if type(kind) is not str:
            raise _MalformedRows(f"row {i}'s kind is a {type(kind).__name__}, not a str")
        if type(payload) is not dict:
            raise _MalformedRows(f"row {i}'s payload is a {type(payload).__name__}, not a dict")
        if "role" in payload:
            kept = payload["role"]
            if type(kept) is not str or kind_of_role.get(kept) != kind:
                raise _MalformedRows(f"row {i} ({kind[:40]}) has the role {kept!r:.60}")
            out.append({"role": kept, **payload})
        else:
            out.append({"role": roles.get(kind, kind), **payload})
    return out


# Field names, once: `dataclasses.fields` on every item and outcome was a driver's hot spot.
_ITEM_FIELDS = tuple(f.name for f in dataclasses.fields(PassItem))
_item_attributes = operator.attrgetter(*_ITEM_FIELDS)
_OUTCOME_FIELDS = tuple(f.name for f in dataclasses.fields(PassOutcome))
_JSON_FIELDS = tuple(name for name in _OUTCOME_FIELDS if name != "rows")
_outcome_values = operator.itemgetter(*_OUTCOME_FIELDS)
_HISTORY = _OUTCOME_FIELDS.index("history")
#: A finished pass's wire form (`PassWorker.run_wire`): no `messages`, `error` or `history`, the
#: rows as two lists.
_FINISHED_FIELDS = (
    "index", "session_id", "status", "attempts", "worker", "usage", "stop_reason", "metadata",
    "kinds", "payloads",
)  # fmt: skip
_finished_values = operator.itemgetter(*_FINISHED_FIELDS)


def _wire_rows(kinds: Any, payloads: Any) -> Any:
    """A finished pass's rows as `PassOutcome.rows`' `(kind, payload)` pairs; two lists that do
    not pair up are kept as they came (a tuple of the two), which the rows' checks refuse."""
    if type(kinds) is list and type(payloads) is list and len(kinds) == len(payloads):
        return list(zip(kinds, payloads, strict=True))
    return (kinds, payloads)


_build_item = positional(PassItem)
_build_outcome = positional(PassOutcome)
_build_data = positional(SessionData)
_build_usage = positional(Usage)
_USAGE_TOTALS = tuple(f.name for f in dataclasses.fields(Usage))
_usage_totals = operator.itemgetter(*_USAGE_TOTALS)


def input_data(table: ChunkTable) -> SessionData:
    """The data `Session(table)` holds (no usage, stop reason or metadata), built without the
    frozen dataclasses' `__init__`s (`frozen.positional`): a worker's input session."""
    return _build_data(table, _build_usage(0, 0, 0, 0), None, _NO_METADATA)


_NO_METADATA = SessionData(ChunkTable._trusted([])).metadata  # the default, shared (read-only)


def _usage(usage: dict[str, int]) -> Usage:
    """An outcome's usage counters as the output's `Usage` (a worker's: its four, unpickled)."""
    if not usage:
        return Usage()
    if type(usage) is dict and len(usage) == len(_USAGE_TOTALS):
        try:
            return _build_usage(*_usage_totals(usage))
        except KeyError:
            pass  # another key: the keyword call refuses it as it always did
    return Usage(**usage)


def pass_failure(outcome: PassOutcome) -> PassFailed:
    """The typed error of a failed outcome: `PassLost` (also a `WorkerLost`) when its workers
    were lost under it, else `PassFailed`."""
    return PassLost(outcome) if outcome.status == "lost" else PassFailed(outcome)
