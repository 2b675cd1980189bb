"""Batches of pipe messages as bytes, and the frames they cross in, for both ends of a process
worker's socket (each end reads and writes it on its event loop: `Frames`, `frame`).

A batch is pickled whole (one pickle per loop turn); when that fails because one message holds a
value pickle refuses (a lock in an output, a str subclass that refuses pickling in an input),
each message is pickled alone and the ones that fail are replaced by what `refuse` returns (a
failed outcome), so the rest of the batch still crosses. This module must never raise for a
message that cannot be pickled, and never drop one silently.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = [
    "MAX_FRAME",
    "FrameError",
    "Frames",
    "dumps_batch",
    "frame",
    "refuse_outcome",
    "what_cannot_cross",
]

log = logging.getLogger("treadle.distributed")


def _dumps(value: Any) -> bytes:
    return bytes(ForkingPickler.dumps(value))


def frame(payload: bytes) -> bytes:
    """`payload` with the length header `multiprocessing.connection.Connection` reads (a
    worker's end of the pipe is one): 4 bytes big-endian, or -1 and 8 bytes past 2 GiB."""
    n = len(payload)
    if n > 0x7FFFFFFF:
        return struct.pack("!iQ", -1, n) + payload
    return struct.pack("!i", n) + payload


class FrameError(ValueError):
    """Bytes on a worker's socket that no `Connection` writes (a frame length below -1, or one
    past `MAX_FRAME`): the peer's code is broken or hostile, and nothing after it can be read.
    `frames` holds the frames completed before it."""

    def __init__(self, message: str, frames: list[bytes]) -> None:
        super().__init__(message)
        self.frames = frames


#: The longest frame read (1 TiB): a longer length is garbage, not a frame to wait for.
MAX_FRAME = 1 << 40


class Frames:
    """The payloads of `Connection.send_bytes` frames, from bytes as a socket hands them over
    (any split): `feed(data)` returns the frames it completed, in order, and raises
    `FrameError` on a length no `Connection` writes (then on every later call)."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._error = ""

    def feed(self, data: bytes) -> list[bytes]:
        if self._error:
            raise FrameError(self._error, [])
        buffer = self._buffer
        buffer += data
        out: list[bytes] = []
        start, end = 0, len(buffer)
        while end - start >= 4:
            (n,) = _HEAD.unpack_from(buffer, start)
            head = 4
            if n < 0:
                if n != -1:  # a length of -4 read as one never moved on: a loop forever
                    self._refuse(n, out)
                if end - start < 12:  # a frame past 2 GiB: its length follows in 8 bytes
                    break
                (n,) = _LONG.unpack_from(buffer, start + 4)
                if n > MAX_FRAME:
                    self._refuse(n, out)
                head = 12
            if end - start < head + n:
                break
            out.append(bytes(buffer[start + head : start + head + n]))
            start += head + n
        if start:
            del buffer[:start]
        return out

    @property
    def partial(self) -> int:
        """Bytes of a frame not yet complete (at EOF: a frame the peer did not finish)."""
        return len(self._buffer)

    def _refuse(self, length: int, frames: list[bytes]) -> None:
        self._error = f"a frame length {length}, which no Connection writes"
        self._buffer = bytearray()
        raise FrameError(self._error, frames)


class Unreadable(Exception):
    """A message on a worker's socket that cannot be read; the text says which and why."""


def messages(frames: Frames, data: bytes) -> Iterator[Any]:
    """The messages `data` completes on `frames`, unpickled, in order. Raises `Unreadable` at the
    first that cannot be read (a payload pickle refuses, or bytes no `Connection` writes), after
    yielding every message before it: both ends of the socket read their peer this way."""
    try:
        payloads, garbage = frames.feed(data), None
    except FrameError as err:  # bytes no Connection writes: nothing after them is readable
        payloads, garbage = err.frames, err
    for payload in payloads:
        try:
            message = ForkingPickler.loads(payload)
        except Exception as err:  # e.g. a class only the peer has
            raise Unreadable(f"a batch that cannot be read: {type(err).__name__}: {err}") from err
        yield message
    if garbage is not None:
        raise Unreadable(f"a frame that cannot be read ({garbage})")


_HEAD = struct.Struct("!i")
_LONG = struct.Struct("!Q")


def dumps_batch(batch: Any, refuse: Callable[[Any, Exception], Any | None]) -> bytes:
    """`batch` (a list of messages, or None) pickled as `Connection.send` would; a message that
    cannot be pickled is replaced by `refuse(message, error)` (None: left out)."""
    try:
        return _dumps(batch)
    except Exception:  # pickle raises TypeError, PicklingError, AttributeError, RecursionError
        if not isinstance(batch, list):
            raise
    kept: list[Any] = []
    for message in batch:
        try:
            _dumps(message)
        except Exception as err:
            replacement = refuse(message, err)
            if replacement is not None:
                kept.append(replacement)
        else:
            kept.append(message)
    return _dumps(kept)


def what_cannot_cross(value: Any, where: str = "") -> str:
    """Where in `value` (dicts, lists and tuples) the first value pickle refuses is, with its
    type: `metadata['output']['lock'] (_thread.lock)`."""
    kind = type(value)
    if kind is dict:
        for key, item in value.items():
            found = what_cannot_cross(item, f"{where}[{_key_text(key)}]")
            if found:
                return found
        return ""
    if kind is list or kind is tuple:
        for i, item in enumerate(value):
            found = what_cannot_cross(item, f"{where}[{i}]")
            if found:
                return found
        return ""
    try:
        _dumps(value)
    except Exception:
        return f"{where or 'value'} ({kind.__module__}.{kind.__qualname__})"
    return ""


def _key_text(key: Any) -> str:
    """A dict key as `what_cannot_cross` names it: its repr, or its type when that raises."""
    try:
        return repr(key)
    except Exception:  # a caller's key whose __repr__ raises: the path is still named
        return f"<{type(key).__qualname__} key>"


def refuse_outcome(message: Any, err: Exception) -> Any:
    """(a worker, sending a batch) An outcome pickle refused: that pass fails, naming the value
    as a caller reads the output (`messages[1]['content']`, `metadata['output']['lock']`)."""
    if not (isinstance(message, tuple) and message[0] == "done"):
        log.error("a message to the driver could not be pickled: %r", err)
        return None
    _kind, call_id, outcome = message
    try:
        where = _where_in_outcome(outcome)
    except Exception:  # RecursionError (nested too deep to walk), a hostile __eq__ or hash...
        # The pass must still fail alone: a refusal that raised dropped its whole batch, and
        # with no call timeout the map waited for those passes for good.
        where = ""
    try:
        said = str(err)
    except Exception:  # an error raised by a caller's __reduce__ whose own text raises
        said = "its error cannot be shown"
    error = (
        f"{type(err).__name__}: the pass's output cannot be sent back from its worker"
        f" ({where or 'its data'} cannot be pickled: {said})"
    )[:2000]
    records = outcome.get("history")
    if records is None and "kinds" in outcome:  # a finished pass's form: its one attempt
        records = [{"attempt": outcome.get("attempts"), "worker": outcome.get("worker")}]
    history = [
        {**record, "status": "error", "error": error}
        for record in records or ()
        if isinstance(record, dict)
    ]
    failed = {
        name: outcome.get(name) for name in ("index", "session_id", "attempts", "worker", "usage")
    }
    failed.update(status="error", error=error, history=history, metadata={})
    try:
        dumps_batch(failed, refuse_outcome)
    except Exception:  # its usage or history holds the value: send the bare failure
        failed.update(usage={}, history=[])
    return ("done", call_id, failed)


def _where_in_outcome(outcome: Any) -> str:
    """`what_cannot_cross` in a wire outcome, named by the fields a caller knows: its rows are
    the output's `messages` (a row's payload is its message, less the role)."""
    if type(outcome) is not dict:
        return what_cannot_cross(outcome)
    for name, value in outcome.items():
        if name in ("rows", "payloads") and type(value) is list:
            for i, row in enumerate(value):
                payload = row[1] if type(row) is tuple and len(row) == 2 else row
                found = what_cannot_cross(payload, f"messages[{i}]")
                if found:
                    return found
            continue
        found = what_cannot_cross(value, str(name))
        if found:
            return found
    return ""
