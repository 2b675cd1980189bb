"""`ResultsWriter`: pass outcomes appended to a JSONL file as they arrive; `read_results` back.

One line per outcome (see `PassOutcome.to_json`), flushed per line so a crash of the driver loses
at most the line being written. Writes happen on a writer thread so the event loop never waits
on the disk. This module must never hold more than the lines not yet written.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic_core import PydanticSerializationError, from_json, to_json

from treadle.distributed.outcome import PassOutcome

__all__ = ["ResultsWriter", "read_results"]


class ResultsWriter:
    """Append outcomes to `path` (created or truncated) from a background thread."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("wb")
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="treadle-results", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while (line := self._queue.get()) is not None:
                self._file.write(line)
                if self._queue.empty():
                    self._file.flush()
        except BaseException as err:  # reported by close()
            self._error = err
        finally:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def write(self, outcome: PassOutcome) -> PassOutcome:
        """Queue one outcome line (never blocks); return the outcome written.

        An outcome JSON cannot hold (an output of bytes, a lone surrogate) is written, and
        returned, as `status="error"` naming the value: that item fails, not the map."""
        data = outcome.to_json()
        try:
            line = to_json(data)
        except PydanticSerializationError as err:
            outcome = dataclasses.replace(
                outcome,
                status="error",
                messages=None,
                metadata={},
                error=(
                    "ResultsFileError: the outcome cannot be written to the results file as "
                    f"JSON: {_unwritable(data)}: {err}"
                )[:2000],
            )
            line = to_json(outcome.to_json())
        self._queue.put(line + b"\n")
        return outcome

    def close(self) -> None:
        """Write what is queued, fsync and close; re-raise a write error (blocks)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error


def _unwritable(value: Any, path: str = "") -> str:
    """Where in `value` (an outcome's JSON data) the part JSON cannot hold is, with its type:
    `['metadata']['output'] (bytes)`. Only walked when writing failed."""
    parts: Any = ()
    if isinstance(value, dict):
        parts = value.items()
    elif isinstance(value, (list, tuple)):
        parts = enumerate(value)
    for key, part in parts:
        try:
            to_json(part)
        except PydanticSerializationError:
            return _unwritable(part, f"{path}[{key!r}]")
    return f"{path} ({type(value).__name__})"


def read_results(path: str | os.PathLike[str]) -> Iterator[PassOutcome]:
    """The outcomes in a results file, in the order they were written (a torn last line is
    skipped)."""
    with Path(path).open("rb") as file:
        for line in file:
            if not line.endswith(b"\n"):
                return
            if line.strip():
                yield PassOutcome.from_json(from_json(line))
