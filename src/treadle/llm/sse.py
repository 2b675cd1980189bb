"""Incremental server-sent-events decoder for streamed chat completions.

Feed it bytes as they arrive, in any chunking; it returns the `data` payload of each complete
event. It keeps only the unfinished tail between calls and must never wait for the whole body.
Its work is linear in the bytes fed, however they are cut: a line arriving over many reads
grows in a `bytearray` (extended in place, about a byte held per byte even for reads of two
bytes) and is made `bytes` once, when its end arrives. Adding each read to a `bytes` tail copied
all of it every read: a 16 MiB line in 64 KiB reads took 1.3 s, and one of `MAX_BODY_BYTES`
would have held the event loop for minutes.
Comment lines (`: keep-alive`), `id:` and `retry:` fields are skipped. An `event: error`, and a
non-standard `error: {...}` line (GPUStack), are handed on as an `{"error": ...}` payload even
when the data is a bare object or plain text, so a provider's mid-stream failure always reaches
the client as an error.
"""

from __future__ import annotations

from pydantic_core import from_json, to_json

__all__ = ["DONE", "SSEDecoder"]

DONE = b"[DONE]"
"""The payload OpenAI-compatible servers send as the last event of a stream."""


class SSEDecoder:
    """Turns a byte stream into event payloads: `decoder.feed(chunk) -> [data, ...]`."""

    __slots__ = ("_data", "_error", "_growing", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        # The unfinished line once a read without a line end came (None: it is `_tail`).
        self._growing: bytearray | None = None
        self._data: list[bytes] = []
        self._error = False  # the current event is named `error`

    def feed(self, chunk: bytes) -> list[bytes]:
        """Decode `chunk`; return the payloads of the events it completes (possibly none)."""
        growing = self._growing
        if b"\n" not in chunk:
            if chunk:
                if growing is None:
                    growing = self._growing = bytearray(self._tail)
                    self._tail = b""
                growing.extend(chunk)
            return []
        if growing is not None:
            growing.extend(chunk)
            text = bytes(growing)
            self._growing = None
        else:
            text = self._tail + chunk
        if b"\r" in text:  # CRLF endings: one pass over the buffer, not a check per line
            end = text.rfind(b"\n") + 1
            # A CR ending the unfinished tail stays there: its LF may come with the next read.
            text = text[:end].replace(b"\r\n", b"\n") + text[end:]
        lines = text.split(b"\n")
        self._tail = lines.pop()
        out: list[bytes] = []
        data = self._data
        for line in lines:
            if not line:
                if data:
                    payload = data[0] if len(data) == 1 else b"\n".join(data)
                    out.append(_as_error(payload) if self._error else payload)
                    data = self._data = []
                self._error = False
            elif line[:6] == b"data: ":  # the usual form, one slice
                data.append(line[6:])
            elif line.startswith(b"data:"):
                data.append(line[5:])
            elif line.startswith(b"event:"):
                self._error = line[6:].strip() == b"error"
            elif line.startswith(b"error:"):
                # Not SSE: GPUStack ends a failed stream with an `error: {...}` line. Its
                # message is the provider's answer, so it is handed on as an error payload.
                out.append(_as_error(line[6:].strip()))
            # Comments (":...") and other fields (id, retry) carry nothing we use.
        return out

    def flush(self) -> list[bytes]:
        """At end of stream: the payload of a last event not followed by a blank line."""
        out = self.feed(b"\n\n") if (self._tail or self._growing or self._data) else []
        self._tail = b""
        return out


def _as_error(data: bytes) -> bytes:
    """The data of an `event: error` as an `{"error": ...}` payload."""
    try:
        value = from_json(data)
    except ValueError:
        return to_json({"error": {"message": data.decode("utf-8", "replace")}})
    if isinstance(value, dict) and "error" in value:
        return data
    return to_json({"error": value if isinstance(value, dict) else {"message": str(value)}})
