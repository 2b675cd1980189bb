"""`SessionWriter`: appends a pass's rows to its JSONL file without blocking the event loop.

Every write runs in a worker thread. Each line is flushed as it is written (a crash loses at most
the line being written, which readers ignore as torn); a turn boundary, the tool intents and each
tool result are also fsynced. The file is created with mode 0600 because transcripts can hold
private data. A pass that ends by an error or cancellation closes the file without a trailer,
which is how readers know it did not end cleanly.

One writer per path: the file is opened without truncation and locked (`flock`, exclusive,
non-blocking) before anything is written, so a second pass given the same path fails at once with
`PersistenceError` and the first pass's file stays intact. The lock lasts until the file closes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import anyio

from treadle.errors import PersistenceError
from treadle.persist.format import encode_header, encode_intent, encode_row, encode_trailer
from treadle.runtime.threads import run_internal_io
from treadle.session import ChunkRow, Usage

__all__ = ["SessionWriter", "default_session_path"]

#: Where `persist=True` writes, relative to the working directory.
DEFAULT_SESSION_DIR = Path(".treadle") / "sessions"


def default_session_path(session_id: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """`<directory or .treadle/sessions>/<session_id>.jsonl`."""
    base = Path(directory) if directory is not None else DEFAULT_SESSION_DIR
    return base / f"{session_id}.jsonl"


def _lock(fd: int, path: Path) -> None:
    """Take the exclusive lock on `fd`, or fail at once if another writer holds it."""
    if sys.platform == "win32":  # no flock there; one writer per path is up to the caller
        return
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise PersistenceError(
            f"{path} is being written by another pass; give each pass its own persist_path."
        ) from None


def _open_private(path: Path) -> IO[bytes]:
    path.parent.mkdir(parents=True, exist_ok=True)
    # No O_TRUNC: a second writer must not clobber the file before it learns it is locked.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    _lock(fd, path)
    os.ftruncate(fd, 0)  # ours now: a new pass replaces what an earlier one left here
    return os.fdopen(fd, "wb")


class SessionWriter:
    """Writes one session file; every method is a coroutine that does its I/O off the loop."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[bytes] | None = None
        self._rows = 0
        self._lock = anyio.Lock()  # tool results finish concurrently; lines never interleave

    @property
    def rows_written(self) -> int:
        """Number of row lines written so far."""
        return self._rows

    async def open(
        self,
        *,
        session_id: str,
        parent_ids: Sequence[str],
        operator: str,
        placement: str | None,
        agent_rows: Sequence[ChunkRow],
        rows: Sequence[ChunkRow],
        placement_options: Mapping[str, Any] | None = None,
        producer: Mapping[str, Any] | None = None,
    ) -> None:
        """Create the file and write the header and the input rows.

        `placement_options` is the session's `placement_spec`; only its env names are written.
        `producer` says what ran the pass (`treadle.persist.producer.producer_record`).
        """
        data = encode_header(
            session_id=session_id,
            parent_ids=parent_ids,
            operator=operator,
            placement=placement,
            agent_rows=agent_rows,
            placement_options=placement_options,
            producer=producer,
        ) + b"".join(encode_row(r) for r in rows)

        def _do() -> None:
            self._file = _open_private(self.path)
            self._file.write(data)
            self._file.flush()
            os.fsync(self._file.fileno())

        await run_internal_io(_do)
        self._rows = len(rows)

    async def _write(self, data: bytes, *, sync: bool = False) -> None:
        file = self._file
        if file is None:
            return

        def _do() -> None:
            file.write(data)
            file.flush()
            if sync:
                os.fsync(file.fileno())

        async with self._lock:
            await run_internal_io(_do)

    async def rows(self, rows: Sequence[ChunkRow], *, turn_boundary: bool = False) -> None:
        """Append row lines (flushed; fsynced when they end a turn)."""
        await self._write(b"".join(encode_row(r) for r in rows), sync=turn_boundary)
        self._rows += len(rows)

    async def intents(self, calls: Sequence[tuple[str, str]]) -> None:
        """Record that these `(tool_call_id, name)` calls are about to run (fsynced)."""
        await self._write(b"".join(encode_intent(cid, name) for cid, name in calls), sync=True)

    async def finish(
        self, *, usage: Usage, stop_reason: str | None, metadata: Mapping[str, Any]
    ) -> None:
        """Write the trailer (a graceful end) and close the file."""
        await self._write(
            encode_trailer(
                rows=self._rows, usage=usage, stop_reason=stop_reason, metadata=metadata
            ),
            sync=True,
        )
        await self.aclose()

    async def aclose(self) -> None:
        """Close without a trailer (the pass did not end gracefully). Safe to call twice."""
        file, self._file = self._file, None
        if file is not None:
            await run_internal_io(file.close)

    def close_now(self) -> None:
        """Close synchronously (used where awaiting is impossible, e.g. during cancellation)."""
        file, self._file = self._file, None
        if file is not None:
            file.close()
