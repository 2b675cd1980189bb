"""The results log of an evaluation: a header line, then one line per finished sample.

```
{"type": "header", "schema": 1, "config_hash", "config", "dataset", "items", "samples",
 "created_at", "treadle", "producer"?}
{"type": "sample", "item_id", "sample", "score", "passed", ...}      one per finished sample
```

`LogWriter` appends from a writer thread (the event loop never waits on the disk), writing each
sample's transcript file first and its log line second, and fsyncs the log whenever its queue
drains: a line on disk means its sample is done. A crash leaves at most a torn last line, which
`read_log` ignores and `LogWriter` cuts off before appending. This module must never rewrite a
line already written.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic_core import from_json, to_json

from treadle import __version__
from treadle.errors import EvalConfigMismatch, PersistenceError

__all__ = [
    "LOG_SCHEMA",
    "EvalLog",
    "LogHeader",
    "LogWriter",
    "SampleRecord",
    "config_changes",
    "read_log",
]

#: Version of the log format in every header.
LOG_SCHEMA = 1


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
    def from_json(cls, data: Mapping[str, Any]) -> SampleRecord:
        """A record from its line."""
        fields = {k: v for k, v in data.items() if k != "type"}
        fields["tags"] = tuple(fields.get("tags", ()))
        return cls(**fields)


#: Characters of the final answer kept in the log (the transcript has all of it).
ANSWER_CAP = 4000


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


def _header(data: Any, path: Path) -> LogHeader:
    if not isinstance(data, dict) or data.get("type") != "header":
        raise PersistenceError(f"{path} is not an evaluation log (its first line is no header).")
    if data.get("schema", 0) > LOG_SCHEMA:
        raise PersistenceError(
            f"{path} was written by a newer Treadle (log schema {data['schema']}); upgrade."
        )
    fields = {k: v for k, v in data.items() if k not in ("type", "schema")}
    return LogHeader(**fields)


def read_log(path: str | os.PathLike[str]) -> EvalLog:
    """The header and records of a log (a torn last line is ignored)."""
    p = Path(path)
    if not p.is_file():
        raise PersistenceError(f"no evaluation log at {p}.")
    header: LogHeader | None = None
    records: list[SampleRecord] = []
    try:
        for _, line in _lines(p):
            if not line.strip():
                continue
            data = from_json(line)
            if header is None:
                header = _header(data, p)
            elif data.get("type") == "sample":
                records.append(SampleRecord.from_json(data))
    except (ValueError, TypeError) as err:
        raise PersistenceError(f"{p} has a damaged line ({err}).") from None
    if header is None:
        raise PersistenceError(f"{p} is empty: it has no header line.")
    return EvalLog(p, header, records)


class LogWriter:
    """Appends sample lines (and their transcripts) to a log from a background thread.

    Opening an existing log checks its configuration hash against `header` and cuts a torn last
    line; opening a missing or empty one writes `header` first.
    """

    def __init__(self, path: str | os.PathLike[str], header: LogHeader) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.header = header
        """This run's header (a resumed log keeps the header it was first written with)."""
        self.done: set[tuple[str, int]] = set()
        """Keys of the samples already in the log when it was opened."""
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        if not fresh:
            self._check_and_trim(header)
        self._file = self.path.open("ab")
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
        end = 0
        found: LogHeader | None = None
        for offset, line in _lines(self.path):
            end = offset
            data = from_json(line)
            if found is None:
                found = _header(data, self.path)
            elif data.get("type") == "sample":
                self.done.add((data["item_id"], data["sample"]))
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
        """Write what is queued, fsync and close; re-raise a write error (blocks)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise PersistenceError(f"cannot write {self.path}: {self._error}") from self._error
