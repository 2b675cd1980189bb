"""The results log of an evaluation: a header line, then one line per finished sample.

```
{"type": "header", "schema": 2, "config_hash", "config", "dataset", "items", "samples",
 "created_at", "treadle", "producer"?}
{"type": "sample", "item_id", "sample", "score", "passed", ...}      one per finished sample
```

`LogWriter` appends from a writer thread (the event loop never waits on the disk), writing each
sample's transcript file first and its log line second, and fsyncs the log whenever its queue
drains: a line on disk means its sample is done. A crash leaves at most a torn last line, which
`read_log` ignores and `LogWriter` cuts off before appending.

A log has one writer: `LogWriter` holds an exclusive `flock` on the log file itself (so every
path to it, a symlink, a hard link or a relative path, meets the same lock) from before it reads
the log until `close`, notes its holder (pid, host, start time) in `<log>.lock` beside the log's
real path (opened without following a planted symlink), and a second writer is refused with
`EvalLogBusyError` naming the holder. Every line is checked when a
log is read or resumed (known fields only, each of its type, no sample twice): a damaged line is
an `EvalLogDamagedError` naming the file and line, raised before a resume spends anything. This
module must never rewrite a line already written.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pydantic_core import from_json, to_json

from treadle import __version__
from treadle.errors import (
    EvalConfigMismatch,
    EvalLogDamagedError,
    PersistenceError,
)
from treadle.evals.failures import ERROR_KINDS
from treadle.evals.loglock import lock_log, lock_path, unlock_log

__all__ = [
    "LOG_SCHEMA",
    "EvalLog",
    "LogHeader",
    "LogWriter",
    "SampleRecord",
    "config_changes",
    "lock_path",
    "read_log",
]

#: Version of the log format in every header (2: sample lines may carry `expected`; a log of
#: version 1 is read and resumed as it is).
LOG_SCHEMA = 2


@dataclass(frozen=True, slots=True)
class LogHeader:
    """The first line of a log: what was run."""

    config_hash: str
    config: Mapping[str, Any]
    """The fingerprints hashed: agent, dataset, scorer."""
    dataset: str
    items: int
    samples: int
    """Samples per item the run was started with."""
    created_at: float = field(default_factory=time.time)
    treadle: str = __version__
    producer: Mapping[str, Any] = field(default_factory=dict)
    """What ran the samples: model, endpoint origin, Treadle version and output options (see
    `treadle.persist.producer`); empty in logs written before it was recorded."""

    def to_json(self) -> dict[str, Any]:
        """The header line as a dict."""
        return {"type": "header", "schema": LOG_SCHEMA, **asdict(self)}


@dataclass(frozen=True, slots=True)
class SampleRecord:
    """One finished sample: its score, cost, timing and how it ended."""

    item_id: str
    sample: int
    """0-based sample number within the item."""
    score: float
    """In [0, 1]; 0 for a sample that ended in an error."""
    passed: bool
    explanation: str | None = None
    answer: str | None = None
    """The final assistant text, capped at `ANSWER_CAP` characters."""
    transcript: str | None = None
    """Path of the output session's transcript (Treadle's JSONL format; `treadle show` reads
    it), relative to the log's directory."""
    usage: Mapping[str, int] = field(default_factory=dict)
    latency_s: float = 0.0
    """Seconds of the last attempt's pass, scoring included."""
    retries: int = 0
    """Attempts beyond the first, after infrastructure failures."""
    error_kind: str | None = None
    """None, or what went wrong (see `treadle.evals.errors.ERROR_KINDS`)."""
    error: str | None = None
    stop_reason: str | None = None
    tags: Sequence[str] = ()
    expected: Any = None
    """The item's expected value (shown beside a failing answer), cut to `ANSWER_CAP` characters
    of JSON when longer."""

    @property
    def key(self) -> tuple[str, int]:
        """`(item_id, sample)`: a sample's identity in the log."""
        return (self.item_id, self.sample)

    def to_json(self) -> dict[str, Any]:
        """The sample line as a dict."""
        data = asdict(self)
        data["tags"] = list(self.tags)
        return {"type": "sample", **data}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "sample line") -> SampleRecord:
        """A record from its line; `ValueError` naming the first field at fault (`where` says
        which line)."""
        unknown = sorted(set(data) - _RECORD_FIELDS - {"type"})
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown}")
        missing = sorted({"item_id", "sample", "score", "passed"} - set(data))
        if missing:
            raise ValueError(f"{where}: missing fields {missing}")
        for name, check in _FIELD_CHECKS.items():
            if name in data and not check(data[name]):
                raise ValueError(f"{where}: field {name!r} has a bad value {data[name]!r:.80}")
        values = {k: v for k, v in data.items() if k != "type"}
        values["tags"] = tuple(values.get("tags", ()))
        return cls(**values)


#: Characters of the final answer kept in the log (the transcript has all of it).
ANSWER_CAP = 4000

_RECORD_FIELDS = frozenset(f.name for f in fields(SampleRecord))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _text_or_none(value: Any) -> bool:
    return value is None or isinstance(value, str)


_FIELD_CHECKS: dict[str, Any] = {
    "item_id": lambda v: isinstance(v, str) and bool(v),
    "sample": _count,
    "score": lambda v: _number(v) and 0.0 <= v <= 1.0,
    "passed": lambda v: isinstance(v, bool),
    "explanation": _text_or_none,
    "answer": _text_or_none,
    "transcript": _text_or_none,
    "usage": lambda v: isinstance(v, dict) and all(_count(n) for n in v.values()),
    "latency_s": lambda v: _number(v) and v >= 0,
    "retries": _count,
    "error_kind": lambda v: v is None or v in ERROR_KINDS,
    "error": _text_or_none,
    "stop_reason": _text_or_none,
    "tags": lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v),
}


@dataclass(frozen=True, slots=True)
class EvalLog:
    """A log read back: its header and its sample records in the order written."""

    path: Path
    header: LogHeader
    records: list[SampleRecord]


#: Differences named in the message of a refused resume (all are on the error's `changes`).
_CHANGES_SHOWN = 4


def config_changes(
    before: Mapping[str, Any], after: Mapping[str, Any], path: str = ""
) -> list[tuple[str, Any, Any]]:
    """What differs between two configurations: `(dotted path, before, after)` per leaf.

    A key repeated as its own child (a scorer fingerprint's `scorer` name) is named once.
    """
    changes: list[tuple[str, Any, Any]] = []
    for key in dict.fromkeys([*before, *after]):
        old, new = before.get(key), after.get(key)
        if old == new:
            continue
        where = key if not path or path.rsplit(".", 1)[-1] == key else f"{path}.{key}"
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            changes.extend(config_changes(old, new, where))
        else:
            changes.append((where, old, new))
    return changes


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Complete lines with the byte offset just past each (a torn last line is not yielded)."""
    offset = 0
    with path.open("rb") as file:
        for line in file:
            if not line.endswith(b"\n"):
                return
            offset += len(line)
            yield offset, line


_HEADER_FIELDS = frozenset(f.name for f in fields(LogHeader))


# The latest time `datetime` can show (9999-12-31), so a report can always print `created_at`.
_LAST_TIME = 253402300799.0


def _header_extras(values: Mapping[str, Any]) -> str | None:
    """Why the header's optional fields (and `config.agent`) are unusable, or None."""
    created = values.get("created_at", 0.0)
    if not (_number(created) and 0.0 <= created <= _LAST_TIME):
        return "field 'created_at' is not a time in seconds since 1970"
    if not isinstance(values.get("treadle", ""), str):
        return "field 'treadle' is not a version string"
    if not isinstance(values.get("producer", {}), dict):
        return "field 'producer' is not an object"
    agent = values["config"].get("agent", {})
    if not isinstance(agent, dict):
        return "field 'config.agent' is not an object"
    if not isinstance(agent.get("provider") or {}, dict):
        return "field 'config.agent.provider' is not an object"
    dataset = values["config"].get("dataset", {})
    if not isinstance(dataset, dict):
        return "field 'config.dataset' is not an object"
    if not isinstance(dataset.get("hash", ""), str):
        return "field 'config.dataset.hash' is not a string"
    if not (_count(values["items"]) and _count(values["samples"])):
        return "fields 'items' and 'samples' must be counts"
    return None


def _header(data: Any, path: Path) -> LogHeader:
    if not isinstance(data, dict) or data.get("type") != "header":
        raise PersistenceError(f"{path} is not an evaluation log (its first line is no header).")
    if "session_id" in data and "config_hash" not in data:
        raise PersistenceError(
            f"{path} is a session transcript, not an evaluation log; "
            f"see it with `treadle show {path}`."
        )
    schema = data.get("schema", 0)
    if not _count(schema):
        raise EvalLogDamagedError(
            f"{path}:1: the header's schema is {schema!r}, not a version number; this log "
            "cannot be read.",
            path=str(path),
            line=1,
        )
    if schema > LOG_SCHEMA:
        raise PersistenceError(
            f"{path} was written by a newer Treadle (log schema {schema}); upgrade."
        )
    values = {k: v for k, v in data.items() if k not in ("type", "schema")}
    unknown = sorted(set(values) - _HEADER_FIELDS)
    bad = (
        f"unknown fields {unknown}"
        if unknown
        else next(
            (
                f"field {name!r} is missing or of the wrong type"
                for name, kind in (
                    ("config_hash", str),
                    ("config", dict),
                    ("dataset", str),
                    ("items", int),
                    ("samples", int),
                )
                if not isinstance(values.get(name), kind)
            ),
            None,
        )
    )
    if bad is None:
        bad = _header_extras(values)
    if bad is not None:
        raise EvalLogDamagedError(
            f"{path}:1: the header line is damaged ({bad}); this log cannot be read.",
            path=str(path),
            line=1,
        )
    return LogHeader(**values)


def _scan(
    path: Path,
) -> tuple[LogHeader | None, list[SampleRecord], int, dict[tuple[str, int], int]]:
    """Every complete line of a log, checked: its header, its records and the offset past the
    last complete line. `EvalLogDamagedError` names the first damaged line."""
    header: LogHeader | None = None
    records: list[SampleRecord] = []
    seen: dict[tuple[str, int], int] = {}
    end = 0
    for number, (offset, line) in enumerate(_lines(path), 1):
        end = offset
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = from_json(line)
        except ValueError as err:
            raise _damaged(path, number, f"not JSON ({err})") from None
        if header is None:
            header = _header(data, path)
            continue
        if not isinstance(data, dict) or data.get("type") != "sample":
            raise _damaged(path, number, "not a sample line")
        try:
            record = SampleRecord.from_json(data, where=where)
        except ValueError as err:
            raise _damaged(path, number, str(err).removeprefix(f"{where}: ")) from None
        if record.key in seen:
            raise _damaged(
                path,
                number,
                f"sample {record.sample} of item {record.item_id!r} is already on line "
                f"{seen[record.key]} (two runs wrote this log at once)",
            )
        seen[record.key] = number
        records.append(record)
    return header, records, end, seen


def _damaged(path: Path, number: int, why: str) -> EvalLogDamagedError:
    return EvalLogDamagedError(
        f"{path}:{number}: {why}; repair or delete that line, or start a new log.",
        path=str(path),
        line=number,
    )


def read_log(path: str | os.PathLike[str]) -> EvalLog:
    """The header and records of a log (a torn last line is ignored); `EvalLogDamagedError`
    naming the file and line of a damaged one."""
    p = Path(path)
    if not p.is_file():
        raise PersistenceError(f"no evaluation log at {p}.")
    header, records, _, _ = _scan(p)
    if header is None:
        raise PersistenceError(f"{p} is empty: it has no header line.")
    return EvalLog(p, header, records)


class LogWriter:
    """Appends sample lines (and their transcripts) to a log from a background thread.

    Takes the log's lock first (`EvalLogBusyError` when another run holds it) and keeps it until
    `close`. Opening an existing log checks every line and its configuration hash against
    `header` and cuts a torn last line; opening a missing or empty one writes `header` first.
    """

    def __init__(self, path: str | os.PathLike[str], header: LogHeader) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.header = header
        """This run's header (a resumed log keeps the header it was first written with)."""
        self.done: set[tuple[str, int]] = set()
        """Keys of the samples already in the log when it was opened."""
        self.done_lines: dict[tuple[str, int], int] = {}
        """The line of each of those samples (for an error naming file and line)."""
        self._lock = lock_log(self.path)
        try:
            fresh = not self.path.exists() or self.path.stat().st_size == 0
            if not fresh:
                self._check_and_trim(header)
            self._file = self.path.open("ab")
        except BaseException:
            unlock_log(self._lock)
            raise
        if fresh:
            self._file.write(to_json(header.to_json()) + b"\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        self._queue: queue.SimpleQueue[tuple[Path | None, bytes, bytes] | None] = (
            queue.SimpleQueue()
        )
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="treadle-eval-log", daemon=True)
        self._thread.start()

    def _check_and_trim(self, header: LogHeader) -> None:
        found, records, end, lines = _scan(self.path)
        self.done.update(record.key for record in records)
        self.done_lines.update(lines)
        if found is None:
            raise PersistenceError(f"{self.path} is not an evaluation log; pick another --log.")
        if found.config_hash != header.config_hash:
            changes = config_changes(found.config, header.config)
            said = "; ".join(f"{what}: {_shown(old)} -> {_shown(new)}" for what, old, new in
                             changes[:_CHANGES_SHOWN])  # fmt: skip
            if len(changes) > _CHANGES_SHOWN:
                said += f"; and {len(changes) - _CHANGES_SHOWN} more"
            raise EvalConfigMismatch(
                f"{self.path} was written by a different configuration ("
                f"{said or 'the configuration hash differs'}); resume it with the configuration "
                "it was written with, or write to a new log.",
                log=str(self.path),
                changes=changes,
            )
        if end < self.path.stat().st_size:  # a torn last line from a crash: cut it off
            with self.path.open("r+b") as file:
                file.truncate(end)
                os.fsync(file.fileno())

    def _run(self) -> None:
        try:
            while (entry := self._queue.get()) is not None:
                transcript, body, line = entry
                if transcript is not None:
                    transcript.parent.mkdir(parents=True, exist_ok=True)
                    transcript.write_bytes(body)
                self._file.write(line)
                if self._queue.empty():  # group commit: one fsync per burst of samples
                    self._file.flush()
                    os.fsync(self._file.fileno())
        except BaseException as err:  # reported by close()
            self._error = err
        finally:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def write(
        self, record: SampleRecord, transcript: Path | None = None, body: bytes = b""
    ) -> None:
        """Queue one sample line, and its transcript file first (never blocks)."""
        if self._error is not None:
            raise PersistenceError(f"cannot write {self.path}: {self._error}") from self._error
        self._queue.put((transcript, body, to_json(record.to_json()) + b"\n"))

    def close(self) -> None:
        """Write what is queued, fsync, close and release the lock; re-raise a write error
        (blocks)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._lock >= 0:
            lock, self._lock = self._lock, -1
            unlock_log(lock)
        if self._error is not None:
            raise PersistenceError(f"cannot write {self.path}: {self._error}") from self._error
