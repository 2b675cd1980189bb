"""Moving conversations between JSONL session files and a store.

An import reads the file with the persist layer's reader (`load_session`, the one parser of the
format, which bounds what it accepts) and writes its rows to a new key in one transaction. An
export writes the session file format (header, one line per row, trailer) to a temporary file
and renames it into place, so a reader never sees half an export. File I/O, and the encoding
of the rows, run on the runtime's I/O threads, never on the event loop.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from treadle.errors import ConfigurationError, ConflictError, PersistenceError
from treadle.persist.format import encode_header, encode_row, encode_trailer
from treadle.persist.reader import LoadedSession, load_session
from treadle.runtime.threads import run_internal_io
from treadle.stores.backend import StoreBackend
from treadle.stores.records import check_key
from treadle.tools.unanswered import answer_gaps

__all__ = ["MAX_IMPORT_BYTES", "export_jsonl", "import_jsonl"]


#: Largest session file an import reads (bytes); a bigger file is refused before it is read.
MAX_IMPORT_BYTES = 256 * 1024 * 1024


def _load_bounded(path: Path) -> LoadedSession:
    """`load_session` of a regular file of at most `MAX_IMPORT_BYTES`, never following a link.

    The file is opened first (O_NOFOLLOW: a planted link is refused; O_NONBLOCK: a FIFO does not
    hang the open) and checked with fstat, so a FIFO, a device such as /dev/zero or an oversized
    file is refused before anything is read; the same open file is then read through
    /proc/self/fd where it exists, so the file cannot be swapped after the check.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise PersistenceError(
                f"cannot import {path}: it is a symbolic link; import the file it points to."
            ) from None
        raise PersistenceError(f"cannot read session file {path}: {err.strerror}.") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PersistenceError(
                f"cannot import {path}: it is not a regular file (a FIFO, device or directory); "
                "import a session file written with persist=True."
            )
        if info.st_size > MAX_IMPORT_BYTES:
            raise PersistenceError(
                f"cannot import {path}: it is {info.st_size} bytes, over the import limit of "
                f"{MAX_IMPORT_BYTES} bytes (treadle.stores.transfer.MAX_IMPORT_BYTES)."
            )
        held = Path(f"/proc/self/fd/{fd}")
        if not held.exists():
            return load_session(path, sandbox=False)
        try:
            return load_session(held, sandbox=False)
        except PersistenceError as err:  # name the file, not the descriptor
            raise PersistenceError(str(err).replace(str(held), str(path))) from None
    finally:
        os.close(fd)


async def import_jsonl(
    backend: StoreBackend, path: str | os.PathLike[str], key: str | None = None
) -> tuple[str, int]:
    """Write the rows of the session file at `path` to the new conversation `key` (default: the
    file's session id); `(key, version)`. An existing key is a `ConflictError`, whatever its
    row count (an empty conversation exists, as `fork` counts it)."""
    loaded = await run_internal_io(lambda: _load_bounded(Path(path)))
    target = check_key(key if key is not None else loaded.session.id)
    try:
        # A transcript written before passes answered calls left without results (a session
        # interrupted, then given a message) is stored as a model would accept it.
        version = await backend.append(target, answer_gaps(loaded.session.rows), 0, new=True)
    except ConflictError as err:
        raise ConflictError(
            f"conversation {target!r} already exists in the store (version {err.actual}); "
            "import the file under another key.",
            key=target,
            actual=err.actual,
        ) from None
    return target, version


async def export_jsonl(backend: StoreBackend, key: str, path: str | os.PathLike[str]) -> Path:
    """Write conversation `key` as a session file at `path` (replacing it); the path."""
    stored = await backend.load(check_key(key))

    def encode() -> bytes:  # on the I/O thread: 50,000 rows take a while to encode
        return b"".join(
            [
                encode_header(
                    session_id=key,
                    parent_ids=[stored.parent_key] if stored.parent_key else [],
                    operator="store.export",
                    placement=None,
                    agent_rows=(),
                ),
                *(encode_row(r) for r in stored.rows),
                encode_trailer(
                    rows=len(stored.rows),
                    usage=stored.usage,
                    stop_reason=stored.stop_reason,
                    metadata={**stored.metadata, "conversation": key, "version": stored.version},
                ),
            ]
        )

    target = Path(path)

    def write() -> None:
        data = encode()
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            raise ConfigurationError(
                f"export destination {target} is a symbolic link; remove it or export elsewhere."
            )
        # a unique name opened O_EXCL|O_NOFOLLOW: a file or link planted there is never written
        partial = target.with_name(f".{target.name[:64]}.{secrets.token_hex(8)}.partial")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(partial, flags, 0o600)  # 0600: transcripts can hold private data
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, target)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise

    await run_internal_io(write)
    return target
